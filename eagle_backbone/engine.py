"""Speculative decoding with a per-step draft length, and the autoregressive baseline.

One step: the policy picks γ; the candidate generator drafts up to γ tokens (the policy may stop it
early); one target forward scores the last accepted token plus the drafts; verification keeps a
prefix and adds one token of the target's own (the correction, or the bonus when all are kept);
both caches roll back to what was kept. Greedy output equals the target's greedy output token for
token; sampled output has the target's distribution. Batch size is 1, the latency setting that
speculative decoding papers measure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_backbone.candidates import CandidateGenerator
from eagle_backbone.metrics import GenerationStats
from eagle_backbone.policy import DraftContext, DraftLengthPolicy, StaticPolicy
from eagle_backbone.runtime import Clock
from eagle_backbone.sampling import SamplingConfig, probs_from_logits, sample, verify_greedy, verify_sampling
from eagle_backbone.target import TargetModel, rollback


@dataclass
class GenerationOutput:
    tokens: list[int]  # new tokens only, EOS included when generated
    stats: GenerationStats


def check_prompt(prompt_ids, target: TargetModel) -> list[int]:
    ids = prompt_ids.flatten().tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
    if not ids:
        raise ValueError("empty prompt: give at least one token (e.g. the BOS token)")
    if len(ids) >= target.max_length:
        raise ValueError(f"prompt has {len(ids)} tokens but the target's context is {target.max_length}: "
                         "no position is left to generate")
    bad = [t for t in ids if not 0 <= t < target.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the target vocabulary [0, {target.vocab_size})")
    return ids


def _check_budget(max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")


def _finish(new: list[int], eos: set[int], max_new_tokens: int) -> list[int]:
    """Cut at the first EOS (kept) and at the budget: never emit more than plain decoding would."""
    for i, t in enumerate(new):
        if t in eos:
            return new[: min(i + 1, max_new_tokens)]
    return new[:max_new_tokens]


def _rng(seed: int | torch.Generator | None, device=None) -> torch.Generator | None:
    """A fresh generator seeded with ``seed``, on ``device`` (the target's: sampling draws on the device the
    probabilities are on; on a CPU the stream is the one ``torch.Generator()`` gives); a generator passed in
    is used as it is (one random stream over several generations: the turns of a conversation)."""
    if seed is None or isinstance(seed, torch.Generator):
        return seed
    return torch.Generator(device=device or "cpu").manual_seed(seed)


class SpeculativeDecoder:
    """Drives a target with a candidate generator and a draft-length policy."""

    def __init__(self, target: TargetModel, candidates: CandidateGenerator, policy: DraftLengthPolicy | None = None):
        self.target, self.candidates = target, candidates
        self.policy = policy if policy is not None else StaticPolicy(4)
        if hasattr(self.policy, "check_pair"):  # sizes of a policy's own model against the pair: now, not mid-run
            self.policy.check_pair(target, candidates)

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int = 128, sampling: SamplingConfig = SamplingConfig(),
                 seed: int | None = None) -> GenerationOutput:
        target, cand, policy = self.target, self.candidates, self.policy
        ids = check_prompt(prompt_ids, target)
        _check_budget(max_new_tokens)
        if max_new_tokens == 0:
            return GenerationOutput([], GenerationStats())
        rng, clock, eos = _rng(seed, target.device), Clock(target.device), target.eos_token_ids
        policy.begin(ids)
        stats = GenerationStats()
        t_start = clock()

        cache = target.new_cache()
        logits, feats = target(torch.tensor([ids], device=target.device), cache)
        x = self._select(logits[0, -1], sampling, rng)
        cand.start(ids, feats[0])
        tokens, new = ids + [x], [x]
        last_feature = feats[0, -1]
        stats.target_forwards = 1
        t_draft = clock()
        stats.target_s += t_draft - t_start

        step = 0
        # x sits at position len(tokens) - 1, which must lie inside the context to be scored
        while len(new) < max_new_tokens and x not in eos and len(tokens) <= target.max_length:
            n = len(tokens)
            # the step emits at most γ + 1 tokens and scores positions n-1 .. n-1+γ
            max_gamma = min(max_new_tokens - len(new) - 1, target.max_length - n)
            ctx = DraftContext(step=step, last_token=x, feature=last_feature, position=len(new),
                               accepted_history=stats.accept_lengths, drafted_history=stats.draft_lengths,
                               max_gamma=max_gamma, _embed=target.embed)
            t0 = clock()
            gamma = policy.gamma(ctx)
            if not isinstance(gamma, int) or gamma < 0:
                raise ValueError(f"policy {policy.name!r} returned gamma={gamma!r}; it must be an integer >= 0")
            gamma = min(gamma, max_gamma)
            t1 = clock()
            stats.policy_s += t1 - t0

            draft, dists = [], []
            if gamma > 0:
                keep_s = 0.0

                def keep(i, tok, probs, state):
                    nonlocal keep_s
                    k0 = clock()
                    ctx.draft_state = state
                    ok = policy.keep_drafting(ctx, i, tok, probs)
                    keep_s += clock() - k0
                    return ok

                draft, dists = cand.propose(tokens, gamma, keep, sampling, rng)
                t2 = clock()
                stats.draft_s += t2 - t1 - keep_s
                stats.policy_s += keep_s
            else:
                t2 = t1

            logits, feats = target(torch.tensor([[x] + draft], device=target.device), cache)
            if sampling.greedy:
                a, x = verify_greedy(draft, logits[0])
            else:
                a, x = verify_sampling(draft, dists, probs_from_logits(logits[0], sampling), rng)
            rollback(cache, n + a)
            accepted = draft[:a] + [x]
            tokens += accepted
            new += accepted
            last_feature = feats[0, a]
            t3 = clock()
            stats.target_s += t3 - t2
            cand.commit(n + a, feats[0, : a + 1])
            stats.draft_s += clock() - t3

            stats.target_forwards += 1
            stats.drafted_tokens += len(draft)
            stats.accepted_tokens += a
            stats.draft_lengths.append(len(draft))
            stats.accept_lengths.append(a)
            t4 = clock()
            policy.observe(ctx, len(draft), a)
            stats.policy_s += clock() - t4
            step += 1
            if any(t in eos for t in accepted):
                break

        out = _finish(new, eos, max_new_tokens)
        cut_drafts = max(0, len(new) - len(out) - 1)  # kept drafts after EOS are never emitted: waste
        if cut_drafts:
            stats.accepted_tokens -= cut_drafts
            stats.accept_lengths[-1] -= cut_drafts
        stats.new_tokens = len(out)
        stats.wall_s = clock() - t_start
        return GenerationOutput(out, stats)

    @staticmethod
    def _select(logits: torch.Tensor, sampling: SamplingConfig, rng) -> int:
        return int(logits.argmax()) if sampling.greedy else sample(probs_from_logits(logits, sampling), rng)


@torch.inference_mode()
def autoregressive_generate(target: TargetModel, prompt_ids, max_new_tokens: int = 128,
                            sampling: SamplingConfig = SamplingConfig(), seed: int | None = None) -> GenerationOutput:
    """Plain decoding with the KV cache: one target forward per token."""
    ids = check_prompt(prompt_ids, target)
    _check_budget(max_new_tokens)
    rng, clock, eos = _rng(seed, target.device), Clock(target.device), target.eos_token_ids
    stats = GenerationStats()
    t_start = clock()
    cache = target.new_cache()
    inp = torch.tensor([ids], device=target.device)
    new: list[int] = []
    n = len(ids)  # positions the target has processed
    while len(new) < max_new_tokens:
        logits, _ = target(inp, cache)
        x = SpeculativeDecoder._select(logits[0, -1], sampling, rng)
        new.append(x)
        stats.target_forwards += 1
        if x in eos or n >= target.max_length:
            break
        inp = torch.tensor([[x]], device=target.device)
        n += 1
    stats.new_tokens = len(new)
    stats.wall_s = stats.target_s = clock() - t_start
    return GenerationOutput(new, stats)
