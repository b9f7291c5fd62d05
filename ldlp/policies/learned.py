"""A draft length chosen by expected gain against cost, from a predictor of how many drafts the target keeps.

Its predictor reads :class:`~ldlp.models.features.StepFeatures` (the feature groups, computed by one object in
replay and in the engine).

:func:`gamma_by_cost` is the decision rule, no tuned threshold: with ``S_m`` the predicted chance that the
first m drafts are all kept, drafting k tokens emits ``1 + S_1 + ... + S_k`` tokens on average and costs the
step's expected seconds; it picks the k that maximises tokens minus seconds divided by the seconds a token is
worth (``token_s``: the policy's own seconds per emitted token, a fixed point the study finds by iterating). For
survival curves that fall with m and costs linear in k this is the per-token rule "draft token m+1 only while
S_{m+1} × token_s exceeds its marginal cost" (tests check both against brute force).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from eagle_backbone.policy import DraftContext, DraftLengthPolicy
from ldlp.models.features import GROUPS, StepFeatures

def expected_gain(survival: np.ndarray, seconds: np.ndarray, token_s: float) -> np.ndarray:
    """Per γ = 0..K: expected emitted tokens minus expected step seconds / ``token_s``.

    ``survival`` (K,): S_m = P(the first m drafts are all kept); ``seconds`` (K+1, K+1): ``seconds[k, a]`` a
    step drafting k tokens of which a are kept (a <= k)."""
    K = len(survival)
    S = np.concatenate([[1.0], np.clip(survival, 0.0, 1.0), [0.0]])
    S = np.minimum.accumulate(S)  # a survival curve cannot rise
    out = np.empty(K + 1)
    for k in range(K + 1):
        p_a = S[: k + 1] - np.concatenate([S[1: k + 1], [0.0]])  # P(A = a) for a < k, and P(A = k) = S_k
        tokens = 1.0 + S[1: k + 1].sum()
        out[k] = tokens - float(p_a @ seconds[k, : k + 1]) / token_s
    return out


def gamma_by_cost(survival: np.ndarray, seconds: np.ndarray, token_s: float, max_gamma: int | None = None) -> int:
    """The draft length with the largest :func:`expected_gain` (the shortest among equals), at most ``max_gamma``."""
    gain = expected_gain(survival, seconds, token_s)
    if max_gamma is not None:
        gain = gain[: max_gamma + 1]
    return int(np.argmax(gain))


def step_seconds_table(costs, k_max: int) -> np.ndarray:
    """(k_max+1, k_max+1) seconds of a batch-1 step drafting k and keeping a, from the cost table replay prices
    by (:func:`ldlp.bench.replay.step_seconds`)."""
    from ldlp.bench.replay import step_seconds

    t = np.zeros((k_max + 1, k_max + 1))
    for k in range(k_max + 1):
        for a in range(k + 1):
            t[k, a] = step_seconds(costs, k, a)
    return t


class CostRulePolicy(DraftLengthPolicy):
    """γ by :func:`gamma_by_cost` (``rule="cost"``) or the predicted median length (``rule="median"``) from a
    predictor's survival curve over :class:`StepFeatures`.

    ``model`` has ``survival(x: (n, F)) -> (n, K)``; ``seconds`` is :func:`step_seconds_table`; ``token_s`` the
    seconds a token is worth. ``record`` (a list), when given, receives each step's feature vector (the study's
    training rows are recorded this way, so training and deployment compute features alike)."""

    name = "cost_rule"

    RULES = ("cost", "median")

    def __init__(self, model, seconds: np.ndarray, token_s: float, groups=GROUPS, max_gamma: int | None = None,
                 record: list | None = None, fixed: int | None = None, rule: str = "cost"):
        if rule not in self.RULES:
            raise ValueError(f"cost_rule policy: rule must be one of {list(self.RULES)}, got {rule!r}")
        self.rule = rule  # median: AdaEAGLE's use of a predicted length (the baseline of the cost rule)
        self.model, self.seconds, self.token_s = model, np.asarray(seconds), float(token_s)
        self.features = StepFeatures(groups)
        self.max_gamma = max_gamma
        self.record, self.fixed = record, fixed  # fixed: a behaviour policy's static γ (recording only)

    def __deepcopy__(self, memo):  # PerSlot copies a policy per slot: share the model, copy the sequence's state
        new = copy.copy(self)
        new.features = StepFeatures(self.features.groups)
        return new

    def begin(self, prompt_ids) -> None:
        self.features.begin()

    def gamma(self, ctx: DraftContext) -> int:
        x = self.features.before(ctx)
        if self.record is not None:
            self.record.append(x)
        cap = ctx.max_gamma if self.max_gamma is None else min(ctx.max_gamma, self.max_gamma)
        if self.fixed is not None:
            return min(self.fixed, cap)
        S = self.model.survival(x[None])[0]
        if self.rule == "median":
            return min(int((S >= 0.5).sum()), cap)
        return gamma_by_cost(S, self.seconds, self.token_s, cap)

    def keep_drafting(self, ctx: DraftContext, i: int, token: int, probs: torch.Tensor) -> bool:
        self.features.saw(i, probs)
        return True

    def observe(self, ctx: DraftContext, drafted: int, accepted: int) -> None:
        self.features.observe()
