"""Token selection and verification: the whole of what makes speculative decoding lossless.

Greedy: keep drafts while they equal the target's argmax. Sampling (Leviathan et al.; Chen et al.): keep
a draft x ~ q with probability min(1, p(x)/q(x)); at the first rejection draw the replacement from
normalize(max(p - q, 0)) (p itself when that is all zero); when every draft is kept draw the bonus token
from p. Both act on every slot of a batch at once with tensor ops (no host reads); a batch of one is one
sequence.

Random numbers are counter-based: the uniform a sequence uses for draw ``j`` of its decoding step
``step`` is a hash of (its seed, step, j) (splitmix64 in int64 arithmetic, which wraps). A sequence's
sampled output therefore depends only on its own seed and its own steps, never on which other sequences
share the batch or in which slot it sits, and the numbers are made on whatever device the target is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), then softmax; applied alike to target and drafter."""
    # at least float32 (half-precision softmax is too coarse for acceptance ratios), float64 stays
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logits = logits / (cfg.temperature if cfg.temperature > 0 else 1.0)
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the tokens strictly before it already reach top_p; the first always stays
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= cfg.top_p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)


# draw indices inside one decoding step: draft i (1-based) uses DRAFT + i - 1, its acceptance test
# ACCEPT + i - 1, the final (replacement or bonus) token FINAL
DRAFT, ACCEPT, FINAL, PER_STEP = 0, 1024, 2048, 4096

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_C1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_C2 = -7723592293110705685  # 0x94D049BB133111EB


def confidence(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (..., 3) float32: top-1 probability, top-1 minus top-2 probability and entropy (nats) of
    ``softmax(logits)`` at temperature 1. The one definition of a distribution's confidence that the oracle
    collector stores and the draft-length policies read (the target's at the last verified position:
    :attr:`~eagle_backbone.policy.Rows.target_stats`)."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, 2, dim=-1).values
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    return torch.stack([top[..., 0], top[..., 0] - top[..., 1], entropy], dim=-1)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijective scramble of int64 (multiplication wraps modulo 2^64)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _C1
    x = (x ^ _shr(x, 27)) * _C2
    return x ^ _shr(x, 31)


def uniforms(seeds: torch.Tensor, steps: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in [0, 1): ``seeds``, ``steps`` (R,) int64, ``draws`` (R, n) or (n,) int64 -> (R, n)."""
    if draws.dim() == 1:
        draws = draws[None]
    key = mix64(mix64(seeds)[:, None] ^ (steps[:, None] * PER_STEP + draws))
    return (_shr(key, 11)).to(torch.float64) * (1.0 / (1 << 53))


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: (R, V) probabilities (need not sum to 1) and (R,) uniforms -> (R,) token ids.
    A zero-probability token is never drawn (its cumulative sum equals its predecessor's)."""
    cdf = probs.to(torch.float64).cumsum(-1)
    x = (u.to(torch.float64) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def accept_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) elementwise (1 where q(x) = 0, as in eagle_backbone.sampling)."""
    return torch.where(q_x > 0, (p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)).clamp(max=1.0),
                       torch.ones_like(p_x))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) over the last dim, p where that is all zero."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def verify_greedy_batch(draft: torch.Tensor, lengths: torch.Tensor, target_logits: torch.Tensor):
    """``draft`` (R, K), ``lengths`` (R,), ``target_logits`` (R, K+1, V) -> (accepted (R,), next token (R,))."""
    best = target_logits.argmax(-1)
    K = draft.shape[1]
    if K == 0:
        return torch.zeros_like(lengths), best[:, 0]
    valid = torch.arange(K, device=draft.device)[None] < lengths[:, None]
    a = ((draft == best[:, :K]) & valid).long().cumprod(1).sum(1)
    return a, best.gather(1, a[:, None])[:, 0]


def verify_sampling_batch(draft: torch.Tensor, lengths: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                          u_accept: torch.Tensor, u_final: torch.Tensor):
    """Speculative sampling for R chains at once.

    ``draft`` (R, K) tokens, ``lengths`` (R,) drafted per row, ``q`` (R, K, V) the drafter's distributions
    (None when K = 0), ``p`` (R, K+1, V) the target's, ``u_accept`` (R, K) and ``u_final`` (R,) uniforms.
    Returns (accepted count (R,), next token (R,)): the replacement at the first rejection or the bonus."""
    K = draft.shape[1]
    if K == 0:
        return torch.zeros_like(lengths), sample_rows(p[:, 0], u_final)
    idx = draft[..., None]
    p_x = p[:, :K].gather(2, idx)[..., 0]
    q_x = q.gather(2, idx)[..., 0]
    keep = u_accept < accept_probability(p_x, q_x)  # u >= min(1, p/q) rejects, as in verify_sampling
    valid = torch.arange(K, device=draft.device)[None] < lengths[:, None]
    a = (keep & valid).long().cumprod(1).sum(1)
    rejected = (a < lengths)[:, None]
    p_at = p.gather(1, a[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]
    q_at = q.gather(1, a.clamp(max=K - 1)[:, None, None].expand(-1, 1, q.shape[-1]))[:, 0]
    # all kept: q_at is masked to 0 and the residual is p itself (the bonus distribution)
    final = residual(p_at, q_at * rejected)
    return a, sample_rows(final, u_final)


def one_step_output_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exact distribution of the first emitted token when one draft x ~ q is checked against p,
    computed from :func:`accept_probability` and :func:`residual`, the functions verification uses.
    Equals p (the proof of losslessness)."""
    out = torch.zeros_like(p)
    for x in torch.nonzero(q > 0).flatten().tolist():
        a = accept_probability(p[x], q[x])
        out[x] += q[x] * a
        out += q[x] * (1 - a) * residual(p, q)
    return out
