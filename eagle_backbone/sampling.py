"""Token selection and the two verification rules (greedy and speculative sampling).

Everything here acts on one chain of drafts for one sequence; it is the whole of what makes
speculative decoding lossless, so it is kept small and tested on exact distributions.
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


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def accept_probability(p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    """min(1, p(x) / q(x)) for a draft x ~ q."""
    qx = float(q[x])
    return 1.0 if qx <= 0 else min(1.0, float(p[x]) / qx)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)): where a rejected draft's replacement is drawn from."""
    r = torch.clamp(p - q, min=0)
    total = r.sum()
    # total == 0 only when p == q, where rejection has probability zero; p is the exact answer then.
    return r / total if total > 0 else p


def verify_greedy(draft: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Keep drafts while they equal the target's argmax. ``target_logits`` (k+1, V) are the target's
    outputs at the last accepted token and at each draft. Returns (accepted count, next token)."""
    best = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return n, best[n]


def verify_sampling(draft: list[int], draft_probs: list[torch.Tensor], target_probs: torch.Tensor,
                    generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al.; Chen et al.). Returns (accepted count, next token):
    the resampled replacement at the first rejection, or the bonus token from p if all are kept."""
    for i, (x, q) in enumerate(zip(draft, draft_probs)):
        p = target_probs[i]
        # on the generator's device: a generator on the target's GPU draws there (a CPU one cannot)
        u = float(torch.rand((), generator=generator, device=generator.device if generator is not None else p.device))
        if u >= accept_probability(p, q, x):
            return i, sample(residual_distribution(p, q), generator)
    return len(draft), sample(target_probs[len(draft)], generator)


def one_step_output_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exact distribution of the first emitted token when one draft x ~ q is checked against p,
    computed from the same two functions :func:`verify_sampling` uses. Equals p (the proof of losslessness)."""
    out = torch.zeros_like(p)
    for x in torch.nonzero(q > 0).flatten().tolist():
        a = accept_probability(p, q, x)
        out[x] += q[x] * a
        out += q[x] * (1 - a) * residual_distribution(p, q)
    return out
