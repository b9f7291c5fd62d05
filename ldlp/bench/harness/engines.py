"""The one engine factory of the benchmarks: what every engine of an experiment shares (the target, the candidate
generator, the cache capacity, the attention math) is bound once, and each run builds its
:class:`~eagle_backbone.batched_engine.BatchedSpeculativeEngine` from it with what that run sets (slots, policy,
sampling, the cost model, the prefill settings, profiled mode), or a batch-1 decoder (:meth:`EngineFactory.decoder`)."""

from __future__ import annotations

from dataclasses import dataclass

from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.decoder import SpeculativeDecoder


def capacity_for(prompts, max_new_tokens: int) -> int:
    """The cache capacity a workload needs: its longest prompt, its budget of new tokens and two more."""
    return max(len(p) for p in prompts) + max_new_tokens + 2


@dataclass(frozen=True)
class EngineFactory:
    target: object
    candidates: object = None  # a CandidateGenerator; None: batched AR
    capacity: int | None = None  # None: the engine's default
    attn: str | None = None  # None: the target's default

    @classmethod
    def for_prompts(cls, target, candidates, prompts, max_new_tokens: int, attn: str | None = None) -> EngineFactory:
        """Engines whose caches hold every prompt of ``prompts`` and ``max_new_tokens`` more (:func:`capacity_for`)."""
        return cls(target, candidates, capacity_for(prompts, max_new_tokens), attn)

    def __call__(self, slots: int, policy=None, sampling=None, **engine) -> BatchedSpeculativeEngine:
        """An engine of ``slots`` slots; ``engine``: the engine's other settings (cost_model, prefill,
        max_batched_tokens, profile, ...)."""
        return BatchedSpeculativeEngine(self.target, self.candidates, slots=slots, policy=policy, sampling=sampling,
                                        capacity=self.capacity, attn=self.attn, **engine)

    def decoder(self, policy=None, profile: bool = False) -> SpeculativeDecoder:
        """A batch-1 decoder over the same pair and settings (a one-slot engine, reused from prompt to prompt)."""
        return SpeculativeDecoder(self.target, self.candidates, policy, attn=self.attn, profile=profile,
                                  capacity=self.capacity)
