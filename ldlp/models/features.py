"""What the draft-length predictors read before a step, by group, each defined once: the oracle collector stores
the values it needs, replay hands the stored values to the policies, and the policies compute them in the engine
from the same tensors with the same functions. :class:`StepFeatures` is one sequence's feature state, the same
object in replay and in the engine (through :class:`~eagle_backbone.policy.PerSlot`; ``tests/
test_predictor_features.py`` checks that both record the same vectors):

* ``history``     the sequence's recent accepted lengths, their EMA, whether the last step kept every draft,
                  log(1 + steps) (:func:`history`, from the host lists the engine keeps anyway);
* ``target``      the target's confidence at the last verified position (:func:`confidence`: top-1, top-1 minus
                  top-2, entropy; :attr:`~eagle_backbone.policy.Rows.target_stats`, free from the verify logits);
* ``draft_prev``  the drafter's top-1 probability at depths 1..3 of the previous step (-1 where it did not
                  draft that deep);
* ``position``    log(1 + tokens generated so far);
* ``ef``          AdaEAGLE's ``[e; f]``: the target embedding of the last token and the feature behind it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from eagle_backbone.sampling import confidence  # noqa: F401  (re-exported: the collector's and policies' one definition)

CONFIDENCE_NAMES = ("top1", "margin", "entropy")
HISTORY_STEPS = 3  # the last accepted lengths a feature vector holds
EMA_DECAY = 0.7  # weight of the past in the accepted-length EMA (a step's weight halves in about 2 steps)
HISTORY_NAMES = tuple(f"accepted_{j}" for j in range(1, HISTORY_STEPS + 1)) + ("accepted_ema", "last_full", "steps")


def history(accepted: list[int], drafted: list[int]) -> list[float]:
    """The recent-acceptance features of one sequence before a step, from its past steps' accepted and
    drafted counts (oldest first): the last ``HISTORY_STEPS`` accepted lengths (most recent first, -1 where
    the sequence has fewer steps), their EMA (-1 before the first step), whether the last step kept every
    draft (its accepted length is then censored by γ: the truth may be longer) and log(1 + steps)."""
    last = [float(a) for a in accepted[::-1][:HISTORY_STEPS]]
    last += [-1.0] * (HISTORY_STEPS - len(last))
    ema = -1.0
    for a in accepted:
        ema = float(a) if ema < 0 else EMA_DECAY * ema + (1 - EMA_DECAY) * a
    full = float(bool(drafted) and drafted[-1] > 0 and accepted[-1] == drafted[-1])
    return last + [ema, full, math.log1p(len(accepted))]


DRAFT_PREV_DEPTHS = 3
GROUP_NAMES = {
    "history": HISTORY_NAMES,
    "target": ("target_top1", "target_margin", "target_entropy"),
    "draft_prev": tuple(f"prev_draft_top1_{m}" for m in range(1, DRAFT_PREV_DEPTHS + 1)),
    "position": ("log_position",),
}
GROUPS = (*GROUP_NAMES, "ef")


class StepFeatures:
    """One sequence's feature vector before each step (``groups``: which, in this order); call :meth:`begin` per
    sequence, :meth:`before` at each step, :meth:`saw` per drafted depth and :meth:`observe` after the step."""

    def __init__(self, groups=GROUPS):
        unknown = [g for g in groups if g not in GROUPS]
        if unknown:
            raise ValueError(f"unknown feature groups {unknown}; known: {list(GROUPS)}")
        self.groups = tuple(groups)
        self.begin()

    def begin(self) -> None:
        self._prev = [-1.0] * DRAFT_PREV_DEPTHS
        self._now = [-1.0] * DRAFT_PREV_DEPTHS

    def before(self, ctx) -> np.ndarray:
        """The feature vector before this step (``ctx``: its :class:`~eagle_backbone.policy.DraftContext`)."""
        parts = []
        for g in self.groups:
            if g == "history":
                parts.append(history(ctx.accepted_history, ctx.drafted_history))
            elif g == "target":
                parts.append(ctx.target_stats.tolist())
            elif g == "draft_prev":
                parts.append(list(self._prev))
            elif g == "position":
                parts.append([math.log1p(ctx.position)])
            else:  # ef
                parts.append(torch.cat([ctx.embedding.float(), ctx.feature.float()]).tolist())
        return np.asarray([v for p in parts for v in p], dtype=np.float32)

    def saw_top1(self, depth: int, top1: float) -> None:
        """The drafter's top-1 probability at ``depth`` (1-based) of this step."""
        if depth <= DRAFT_PREV_DEPTHS:
            self._now[depth - 1] = float(top1)

    def observe(self) -> None:
        self._prev, self._now = self._now, [-1.0] * DRAFT_PREV_DEPTHS

    @staticmethod
    def names(groups, d: int | None = None) -> list[str]:
        out = []
        for g in groups:
            out += list(GROUP_NAMES[g]) if g != "ef" else [f"e{j}" for j in range(d or 0)] + [f"f{j}" for j in range(d or 0)]
        return out
