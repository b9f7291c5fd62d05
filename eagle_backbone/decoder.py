"""One sequence at a time: the batched engine with one slot (:class:`SpeculativeDecoder`), and plain decoding
without drafts (:func:`autoregressive_generate`)."""

from __future__ import annotations

import weakref

import torch

from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.candidates import CandidateGenerator
from eagle_backbone.policy import DraftPolicy, StaticPolicy
from eagle_backbone.sampling import SamplingConfig
from eagle_backbone.step_records import GenerationOutput
from eagle_backbone.target import TargetModel


def _stream_seed(seed, device) -> int:
    """The slot's random-stream seed: an int as it is; a ``torch.Generator`` (one stream over several
    generations: the turns of a conversation) draws it, so every call continues that stream; None draws it
    from torch's global generator."""
    if isinstance(seed, torch.Generator):
        return int(torch.randint(0, 2**62, (), generator=seed, device=seed.device))
    if seed is None:
        return int(torch.randint(0, 2**62, ()))
    return int(seed)


# profiled components -> the per-generation clocks of GenerationStats
_CLOCKS = {"draft": "draft_s", "verify": "target_s", "prefill": "target_s", "read": "target_s",
           "host": "target_s"}


class SpeculativeDecoder:
    """Speculative decoding of one sequence at a time: a one-slot :class:`BatchedSpeculativeEngine`, built once
    per sampling setting and reused (its caches are preallocated).

    ``profile``: run the engine in profiled mode and fill the per-component clocks of the stats (``draft_s``,
    ``target_s``, ``policy_s``; CUDA events on a GPU, one synchronisation a step). Off by default: the timed
    loop marks nothing (on this CPU the marks cost about 1% of a step at γ = 4)."""

    def __init__(self, target: TargetModel, candidates: CandidateGenerator | None, policy: DraftPolicy | None = None,
                 attn: str | None = None, profile: bool = False, capacity: int | None = None):
        self.target, self.candidates = target, candidates
        self.policy = policy if policy is not None else StaticPolicy(4)
        self.attn, self.capacity = attn, capacity
        self.profile = profile
        self._engines: dict[SamplingConfig, BatchedSpeculativeEngine] = {}
        self.engine(SamplingConfig())  # checks the pair and the policy now, not mid-run

    def engine(self, sampling: SamplingConfig) -> BatchedSpeculativeEngine:
        if sampling not in self._engines:
            self._engines[sampling] = BatchedSpeculativeEngine(
                self.target, self.candidates, slots=1, policy=lambda: self.policy, sampling=sampling,
                capacity=self.capacity,
                attn=self.attn, profile=self.profile)
        return self._engines[sampling]

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int = 128, sampling: SamplingConfig = SamplingConfig(),
                 seed: int | torch.Generator | None = None) -> GenerationOutput:
        eng = self.engine(sampling)
        eng.prof.s = {}
        eng.admit(0, prompt_ids, max_new_tokens, _stream_seed(seed, self.target.device))  # checks both
        own = eng.policy_s  # from here: the policy's begin() runs before the clock starts
        while eng.busy():
            eng.step()
        s = eng.state[0]
        for name, secs in eng.prof.s.items():
            attr = _CLOCKS.get(name)
            if attr:
                setattr(s.stats, attr, getattr(s.stats, attr) + secs)
        s.stats.policy_s = eng.policy_s - own  # the policy's own calls, timed in every mode
        return GenerationOutput(s.new, s.stats)


_AR_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> its one-slot AR engines


def autoregressive_generate(target: TargetModel, prompt_ids, max_new_tokens: int = 128,
                            sampling: SamplingConfig = SamplingConfig(), seed: int | torch.Generator | None = None,
                            attn: str | None = None) -> GenerationOutput:
    """Plain decoding of one sequence: the one-slot engine without drafts (kept per target and setting)."""
    engines = _AR_ENGINES.setdefault(target, {})
    if (sampling, attn) not in engines:
        engines[(sampling, attn)] = SpeculativeDecoder(target, None, StaticPolicy(0), attn=attn)
    out = engines[(sampling, attn)].generate(prompt_ids, max_new_tokens, sampling, seed)
    out.stats.target_s = out.stats.wall_s
    return out
