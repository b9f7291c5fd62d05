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


import numpy as np
import torch

from pathlib import Path

from eagle_backbone.policy import GO, Depth, DraftContext, DraftPolicy, Rows, int_at_least
from ldlp.models.features import DRAFT_PREV_DEPTHS, GROUPS, StepFeatures

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


class LearnedPolicy(DraftPolicy):
    """γ by :func:`gamma_by_cost` (``rule="cost"``) or the predicted median length (``rule="median"``, AdaEAGLE's
    use of a predicted length) from a predictor's survival curve over :class:`~ldlp.models.features.StepFeatures`.

    Deployed (``path``: an LDLP folder whose ``inputs`` name its feature groups, ``policy=learned``) it prices steps
    by the engine's step-cost model (:class:`~ldlp.policies.pricing.StepPricing`, as the load-aware policies) and
    learns the seconds a token is worth online: the EMA of its own modelled step seconds over its emitted tokens
    (Dinkelbach's fixed point, reached while decoding), started at ``token_ratio`` × a plain step. In the study
    (``model``: any object with ``survival(x)``) the step seconds and ``token_s`` are given. ``record`` (a list)
    receives every feature vector; ``fixed`` makes it a static-γ behaviour policy that only records.

    One instance serves every slot of a batched engine (a :class:`StepFeatures` per slot); replay drives the same
    object through :class:`~eagle_backbone.policy.OneRow`. The drafter's top-1 probabilities ride in the step's
    one host read (:meth:`reads`)."""

    name = "learned"
    reads_drafts = True
    RULES = ("cost", "median")
    EMA = 0.05  # weight of a step in the online seconds-per-token estimate

    def __init__(self, path: str | None = None, max_gamma: int = 8, rule: str = "cost", token_ratio: float | None = None,
                 cost_dir: str | None = None, model: str | None = None, cost_table: str | None = None,
                 profile_if_missing: bool = True, online_costs: bool = True, *, predictor=None, groups=None,
                 seconds=None, token_s: float | None = None, record: list | None = None, fixed: int | None = None):
        from ldlp.policies.pricing import StepPricing

        if rule not in self.RULES:
            raise ValueError(f"learned policy: rule must be one of {list(self.RULES)}, got {rule!r}")
        self.rule, self.max_gamma = rule, int_at_least(self.name, "max_gamma", max_gamma, 0)
        self.record, self.fixed = record, fixed
        if path is not None:
            if not (Path(path) / "config.json").is_file():
                raise ValueError(f"learned policy: path={path} has no config.json; build the predictor first "
                                 "(python scripts/train_step_ldlp.py)")
            predictor = _load_ldlp(str(path))
            groups = predictor.config.inputs
            meta = predictor.config.meta or {}
            token_ratio = meta.get("token_ratio") if token_ratio is None else token_ratio
            self.needs_costs = True
            self.pricing = StepPricing(self.name, cost_dir, model, cost_table, profile_if_missing, online_costs)
        elif predictor is None and fixed is None:
            raise ValueError("learned policy: give path (a predictor folder) or a predictor")
        self.path, self.predictor = path, predictor
        self.groups = tuple(groups or GROUPS)
        self._seconds = None if seconds is None else np.asarray(seconds)
        self.token_s = token_s  # fixed (the study); None: learned online
        self.token_ratio = float(token_ratio) if token_ratio is not None else 0.4
        self._ema = None  # (seconds, tokens) of the online estimate
        self.state: dict[int, StepFeatures] = {}
        self._depths: list[tuple[int, list[int], torch.Tensor]] = []  # this step's (depth, rows, top-1 on the device)

    # ---- prices ----
    def check_pair(self, target, candidates) -> None:
        if self.predictor is not None and hasattr(self.predictor, "config"):
            d = self.predictor.config.feature_dim
            if getattr(target, "hidden_size", d) != d:
                raise ValueError(f"learned policy: {self.path} reads features of size {d} but this target's have "
                                 f"size {target.hidden_size}: it was built for another target")

    def bind(self, engine) -> None:
        super().bind(engine)
        if self.pricing is not None:
            self.pricing.bind(engine)

    def seconds(self) -> np.ndarray:
        if self._seconds is not None:
            return self._seconds
        memo = self.pricing.memo("learned_seconds")
        if "table" not in memo:
            memo["table"] = step_seconds_table(self.pricing.costs, self.max_gamma)
        return memo["table"]

    def token_seconds(self) -> float:
        if self.token_s is not None:
            return self.token_s
        if self._ema is None:
            return self.token_ratio * float(self.seconds()[0, 0])
        return self._ema[0] / self._ema[1]

    # ---- the protocol ----
    def begin(self, slot: int, prompt_ids: list[int], max_new_tokens: int | None = None) -> None:
        self.state[slot] = StepFeatures(self.groups)

    def _context(self, rows: Rows, i: int) -> DraftContext:
        return DraftContext(step=len(rows.accepted[i]) if rows.accepted else 0, last_token=0, feature=rows.features[i],
                            accepted_history=rows.accepted[i] if rows.accepted else [],
                            drafted_history=rows.drafted[i] if rows.drafted else [], position=rows.positions[i],
                            _embed=rows.embed, _target_stats=lambda: rows.target_stats[i],
                            _embedding=rows.embeddings[i] if "ef" in self.groups else None)

    def plan(self, rows: Rows) -> list[int]:
        self._depths = []
        x = np.stack([self.state[b].before(self._context(rows, i)) for i, b in enumerate(rows.slots)])
        if self.record is not None:
            self.record.extend(x)
        caps = [min(c, self.max_gamma) for c in rows.caps]
        if self.fixed is not None:
            return [min(self.fixed, c) for c in caps]
        S = self.predictor.survival_of(x) if hasattr(self.predictor, "survival_of") else self.predictor.survival(x)
        if self.rule == "median":
            return [min(int((s >= 0.5).sum()), c) for s, c in zip(S, caps)]
        seconds, token_s = self.seconds(), self.token_seconds()
        return [gamma_by_cost(s[: seconds.shape[0] - 1], seconds, token_s, c) for s, c in zip(S, caps)]

    def stop(self, d: Depth) -> torch.Tensor:
        if d.depth <= DRAFT_PREV_DEPTHS:
            self._depths.append((d.depth, list(d.rows), d.probs.max(-1).values))
        return torch.full_like(d.tokens, GO)

    def reads(self) -> dict[str, torch.Tensor]:
        return {f"top1_{depth}": top1 for depth, _, top1 in self._depths}

    def observe(self, rows: Rows, drafted: list[int], accepted: list[int], extra: dict | None = None) -> None:
        seen = {}
        for depth, at, _ in self._depths:
            for row, p in zip(at, (extra or {})[f"top1_{depth}"]):
                seen[(row, depth)] = float(p)
        online = self.token_s is None and self.fixed is None  # a fixed token worth, or a recorder: nothing to learn
        seconds = self.seconds() if online else None
        for i, b in enumerate(rows.slots):
            st = self.state[b]
            for depth in range(1, DRAFT_PREV_DEPTHS + 1):
                if (i, depth) in seen:
                    st.saw_top1(depth, seen[(i, depth)])
            st.observe()
            if seconds is not None:  # the seconds a token is worth: this policy's own, as it decodes
                s, n = float(seconds[drafted[i], accepted[i]]), accepted[i] + 1
                if self._ema is None:
                    self._ema = (self.token_seconds() * n, float(n))
                self._ema = ((1 - self.EMA) * self._ema[0] + self.EMA * s, (1 - self.EMA) * self._ema[1] + self.EMA * n)
        self._depths = []


def _load_ldlp(path: str):
    from ldlp.policies.threshold import _load_ldlp as load

    return load(path)
