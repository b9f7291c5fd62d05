"""The draft-length policy interface: what decides γ at every step.

The engine asks a policy twice per step:

* ``gamma(ctx)`` before drafting. ``ctx`` carries what a predictor such as the LDLP needs: the last
  accepted token, its embedding, the target feature at the position that produced it (the pair the
  drafter reads next), the step index and the history of accepted lengths.
* ``keep_drafting(ctx, i, token, probs)`` after drafted token ``i`` (1-based) with the drafter's
  distribution ``probs`` over that token; returning False stops the chain early. Threshold methods
  (confidence, entropy, cumulative log-probability) live here, and so do acceptance heads, which read
  ``ctx.draft_state``: the drafter hidden state that ``probs`` came from (EAGLE drafters; None for a
  standalone draft LM).

After verification ``observe(ctx, drafted, accepted)`` lets stateful schedules (transformers'
heuristic) update. ``begin(prompt_ids)`` is called once per generation before the clock starts.
γ = 0 is legal: the engine then takes a plain target step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from eagle_backbone.runtime import to_device


@dataclass
class DraftContext:
    step: int  # 0-based decoding step (one target forward each)
    last_token: int  # the last accepted token, not yet seen by the target
    feature: torch.Tensor  # (d,) target feature at the position that produced last_token
    accepted_history: list[int] = field(default_factory=list)  # accepted drafts per past step
    drafted_history: list[int] = field(default_factory=list)  # drafted tokens per past step
    position: int = 0  # number of tokens generated so far (last_token included)
    max_gamma: int = 0  # what the context and max_new_tokens still allow
    draft_state: torch.Tensor | None = None  # (d,) during keep_drafting: the drafter state behind ``probs``
    _embed: Callable[[torch.Tensor], torch.Tensor] | None = None
    _embedding: torch.Tensor | None = None

    @property
    def embedding(self) -> torch.Tensor:
        """(d,) target input embedding of ``last_token`` (computed on first use)."""
        if self._embedding is None:
            ids = to_device([self.last_token], self.feature.device)
            self._embedding = self._embed(ids)[0]
        return self._embedding


class DraftLengthPolicy:
    """Base class: subclasses set ``name`` and override ``gamma`` (and optionally the hooks)."""

    name = "base"
    adaptive = True  # False for a fixed γ (results report gamma then)

    def begin(self, prompt_ids: list[int]) -> None:
        """Called once per generation, before timing starts."""

    def gamma(self, ctx: DraftContext) -> int:
        raise NotImplementedError

    def keep_drafting(self, ctx: DraftContext, i: int, token: int, probs: torch.Tensor) -> bool:
        return True

    def observe(self, ctx: DraftContext, drafted: int, accepted: int) -> None:
        """Called after each verification."""

    def check_pair(self, target, candidates) -> None:
        """Called when a decoder is built, before any generation: raise a one-line ValueError when the
        policy cannot serve this target and candidate generator (a predictor trained for other sizes)."""


class StaticPolicy(DraftLengthPolicy):
    """A fixed γ every step: EAGLE's and most papers' default."""

    name = "static"
    adaptive = False

    def __init__(self, gamma: int = 4):
        if not isinstance(gamma, int) or gamma < 0:
            raise ValueError(f"static policy: gamma must be an integer >= 0, got {gamma!r}")
        self._gamma = gamma

    @property
    def fixed_gamma(self) -> int:
        return self._gamma

    def gamma(self, ctx: DraftContext) -> int:
        return self._gamma


class BatchDraftPolicy(DraftLengthPolicy):
    """A policy that decides for every slot of a batch at once: one instance is shared by the slots.

    The batched engine calls, per step over the R running slots:

    * ``plan(caps) -> list[int]``: the most each row may draft this step (``caps``: what budgets and the
      context allow); all zeros is a plain decoding step for the batch, with no drafter work at all.
    * ``keep_rows(depth, rows, states, probs) -> list[int]`` after each draft depth, for the A rows that
      drafted at ``depth``: ``rows`` their positions in the step (host ints), ``states`` (A, d) the drafter
      states behind ``probs`` (None for a draft LM), ``probs`` (A, V) the drafter's distributions. Per row:
      0 = drop this draft and stop, 1 = keep it and stop, 2 = keep it and draft the next one.
    * ``observe_rows(drafted, accepted)`` after verification, with host lists (the step's one read).

    ``bind_engine(engine)`` is called once when an engine is built (the cost table is per model, dtype and
    thread count). ``gamma``/``keep_drafting``/``observe`` remain for the batch-1 engine, where R = 1."""

    batch_level = True
    reads_drafts = True  # False: keep_rows is never called (and greedy drafting skips the softmax)

    def bind_engine(self, engine) -> None:
        """Called once by the batched engine that will use this policy."""

    def plan(self, caps: list[int]) -> list[int]:
        raise NotImplementedError

    def keep_rows(self, depth: int, rows: list[int], states, probs: torch.Tensor) -> list[int]:
        return [2] * len(rows)

    def observe_rows(self, drafted: list[int], accepted: list[int]) -> None:
        """Called after each verification of a batched step."""
