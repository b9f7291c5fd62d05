"""What the draft-length predictors read beyond ``[e; f]``, each defined once: the oracle collector stores these
values, replay hands the stored values to the policies, and the policies compute them in the engine from the
same tensors with the same functions (``tests/test_predictor_features.py`` checks that the three agree).

* :func:`confidence`: top-1 probability, top-1 minus top-2 margin and entropy of a distribution (softmax at
  temperature 1, float32). Of the target's distribution that produced the last token (``target_stats``: free
  from the verify logits, ``lm_head(f)``), and of the drafter's at each depth.
* :func:`history`: the sequence's own recent steps (accepted and drafted counts, an EMA of the accepted
  length), from the host lists the engine keeps anyway.
"""

from __future__ import annotations

import math

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
