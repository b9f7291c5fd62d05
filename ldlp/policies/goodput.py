"""Goodput feedback: a cost-driven policy checked against the throughput it actually gets.

The load-aware policies plan on the engine's online step-cost model, whose errors (10-30% on a loaded machine)
decide whether their plan beats a fixed γ. :class:`GoodputFeedback` closes the loop with a bandit per *load
bucket* (the step's running rows, by powers of two: 1, 2, 3-4, 5-8, ...):

* the arms are the static chains γ = 0..G and ``plan`` (the policy's own choice: its allocation, its tree);
* each step's reward is measured: the tokens it emitted over its wall milliseconds (a step that also
  prefilled prompt chunks has the cost model's price of the chunks taken off first). With ``reward:
  expected`` a static chain's step is credited the tokens its drafts emit on average instead of those it did
  emit: 1 + S_1 + … + S_d a row, S the survival curve pooled over every chain step's drafts (:class:`Survival`;
  a greedy draft at depth m does not depend on how many follow it, so every chain measures the same hazards).
  What the text at hand accepts then no longer decides which chain looks faster (one row's tokens a step swing
  from 1 to γ + 1 with the text, its milliseconds a few percent). ``plan`` keeps its measured tokens (a
  policy's own plan earns by choosing its rows and depths, which a pooled curve cannot credit);
* an arm's rate is its discounted tokens over its discounted milliseconds, started at the cost model's
  prediction as ``prior_steps`` pseudo-steps (:meth:`choose`'s ``prior``), so a bucket starts where the
  model points and measurement takes over; every step in a bucket discounts that bucket's evidence by
  ``discount``, so a load or a text that changes is followed;
* it plays the arm of the highest upper bound, rate × (1 + ``bonus`` · sqrt(ln n / n_arm)) (UCB), among the
  *neighbours* of the best measured chain (γ* - 1, γ*, γ* + 1) and ``plan``: rate against γ is unimodal, so
  arms far from the best need no visits;
* with ``monotone`` the centre γ* of a bucket is instead the buckets' best chains made non-increasing in the load
  (an isotonic fit weighted by each bucket's evidence, rounded), as vLLM's Dynamic-SD tables are: on a trace the
  running rows change from step to step, and per-bucket bests measured on a few hundred steps each jump between
  distant γ, whose drafts keep fewer tokens than neighbouring ones (tokens are concave in γ).

Were its estimates right, the best static γ of a bucket would be a floor, less the exploration (measured, it is
not: docs/batched.md#goodput-feedback). :attr:`exploration`
counts the steps on an arm other than the bucket's best by measured rate and the milliseconds they cost
(each step's time × its shortfall against the best rate), which the benchmark pages state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

PLAN = "plan"  # the arm that lets the policy plan as it would without feedback


def load_bucket(rows: int) -> int:
    """0 for one row, 1 for two, 2 for 3-4, 3 for 5-8, ...: ceil(log2(rows))."""
    return max(0, int(rows) - 1).bit_length()


def bucket_label(b: int) -> str:
    lo, hi = (1 if b == 0 else 2 ** (b - 1) + 1), 2 ** b
    return str(hi) if lo == hi else f"{lo}-{hi}"


@dataclass
class _Arm:
    steps: float = 0.0  # discounted steps measured
    tokens: float = 0.0  # discounted tokens
    ms: float = 0.0  # discounted milliseconds
    prior_rate: float | None = None  # tokens per ms the cost model predicts, as prior_steps pseudo-steps
    prior_ms: float = 1.0  # the predicted milliseconds of one step (the pseudo-steps' weight in time)


@dataclass
class _Bucket:
    arms: dict = field(default_factory=dict)
    steps: int = 0


class GoodputFeedback:
    """The bandit of the module docstring. ``choose(R, prior)`` picks the arm of a step of R rows (``prior``:
    {arm: (predicted tokens per ms, predicted ms a step)} from the cost model, for every arm); ``reward(tokens,
    ms)`` measures it. ``history`` keeps (step, rows, arm) of every choice, for the plots."""

    REWARDS = ("measured", "expected")

    def __init__(self, max_gamma: int, discount: float = 0.995, bonus: float = 0.15, prior_steps: float = 4.0,
                 neighbours: int = 1, plan_arm: bool = True, keep_history: bool = True, reward: str = "measured",
                 prefill: str = "price", monotone: bool = False):
        if not 0 < discount <= 1:
            raise ValueError(f"goodput: discount must be in (0, 1], got {discount!r}")
        if reward not in self.REWARDS:
            raise ValueError(f"goodput: reward must be one of {list(self.REWARDS)}, got {reward!r}")
        self.expected = reward == "expected"
        if prefill not in ("price", "skip"):
            raise ValueError(f"goodput: prefill must be 'price' or 'skip', got {prefill!r}")
        self.skip_prefill = prefill == "skip"  # a step that also prefilled teaches nothing (no price taken off)
        if bonus < 0 or prior_steps < 0 or neighbours < 0:
            raise ValueError(f"goodput: bonus, prior_steps and neighbours must be >= 0, got {bonus!r}, "
                             f"{prior_steps!r}, {neighbours!r}")
        self.max_gamma, self.discount, self.bonus = int(max_gamma), float(discount), float(bonus)
        self.prior_steps, self.neighbours, self.plan_arm = float(prior_steps), int(neighbours), bool(plan_arm)
        self.monotone = bool(monotone)
        self.arms = list(range(self.max_gamma + 1)) + ([PLAN] if plan_arm else [])
        self.buckets: dict[int, _Bucket] = {}
        self.history: list[tuple[int, int, object]] | None = [] if keep_history else None
        self.exploration = {"steps": 0, "explore_steps": 0, "ms": 0.0, "explore_ms": 0.0}
        self.steps = 0
        self._last: tuple[int, object] | None = None  # (bucket, arm) awaiting its reward

    # ---- estimates ----------------------------------------------------------------------------------
    def rate(self, arm: _Arm) -> float:
        """Tokens per ms: measured, with the prior's pseudo-steps (none when the arm has no prior)."""
        w = self.prior_steps if arm.prior_rate is not None else 0.0
        ms = arm.ms + w * arm.prior_ms
        return (arm.tokens + w * arm.prior_ms * (arm.prior_rate or 0.0)) / ms if ms > 0 else 0.0

    def best(self, b: int) -> object:
        """The bucket's arm of the highest estimated rate (None before the bucket has any)."""
        bucket = self.buckets.get(b)
        if bucket is None or not bucket.arms:
            return None
        return max(bucket.arms, key=lambda a: self.rate(bucket.arms[a]))

    def best_chain(self, b: int) -> int:
        """The bucket's chain of the highest estimated rate."""
        bucket = self.buckets[b]
        return max((a for a in bucket.arms if a != PLAN), key=lambda a: self.rate(bucket.arms[a]))

    def smoothed(self) -> dict[int, int]:
        """Each bucket's best chain made non-increasing in the load: an isotonic fit over the buckets, each
        weighted by its discounted evidence, rounded (``monotone``)."""
        from sklearn.isotonic import isotonic_regression

        bs = sorted(b for b, bucket in self.buckets.items() if any(a != PLAN for a in bucket.arms))
        if not bs:
            return {}
        weights = [1.0 + sum(arm.steps for arm in self.buckets[b].arms.values()) for b in bs]
        fit = isotonic_regression([float(self.best_chain(b)) for b in bs], sample_weight=weights, increasing=False)
        return {b: int(round(float(g))) for b, g in zip(bs, fit)}

    def candidates(self, b: int) -> list:
        """The arms worth a step in bucket ``b``: the best chain's neighbours (``monotone``: the smoothed best's)
        and ``plan``."""
        bucket = self.buckets[b]
        chains = [a for a in bucket.arms if a != PLAN]
        g = self.smoothed()[b] if self.monotone else self.best_chain(b)
        near = [a for a in chains if abs(a - g) <= self.neighbours] or [self.best_chain(b)]
        return ([PLAN] if PLAN in bucket.arms else []) + near  # plan first: it wins ties

    # ---- the loop -----------------------------------------------------------------------------------
    def choose(self, rows: int, prior: dict) -> object:
        b = load_bucket(rows)
        bucket = self.buckets.setdefault(b, _Bucket())
        for a in self.arms:
            if a in prior:
                arm = bucket.arms.setdefault(a, _Arm())
                arm.prior_rate, arm.prior_ms = float(prior[a][0]), max(1e-6, float(prior[a][1]))
            elif a not in bucket.arms:
                bucket.arms[a] = _Arm()
        total = sum(arm.steps for arm in bucket.arms.values()) + self.prior_steps * len(bucket.arms)

        def upper(a):
            arm = bucket.arms[a]
            n = arm.steps + (self.prior_steps if arm.prior_rate is not None else 0.0)
            if n <= 0:
                return math.inf  # never measured and no prior: try it once
            return self.rate(arm) * (1 + self.bonus * math.sqrt(math.log(max(total, 2.0)) / n))

        choice = max(self.candidates(b), key=upper)
        self._last = (b, choice)
        if self.history is not None:
            self.history.append((self.steps, int(rows), choice))
        self.steps += 1
        return choice

    def reward(self, tokens: float, ms: float) -> None:
        """The measured outcome of the last choice: ``tokens`` emitted in ``ms`` wall milliseconds."""
        if self._last is None or not ms > 0:
            return
        b, a = self._last
        self._last = None
        bucket = self.buckets[b]
        best = self.best(b)
        ex = self.exploration
        ex["steps"] += 1
        ex["ms"] += ms
        if a != best:
            ex["explore_steps"] += 1
            r_best, r_a = self.rate(bucket.arms[best]), self.rate(bucket.arms[a])
            ex["explore_ms"] += ms * max(0.0, 1.0 - r_a / r_best) if r_best > 0 else 0.0
        for arm in bucket.arms.values():  # forget slowly: the bucket's evidence fades as it gets more
            arm.steps, arm.tokens, arm.ms = (arm.steps * self.discount, arm.tokens * self.discount,
                                             arm.ms * self.discount)
        arm = bucket.arms[a]
        arm.steps += 1
        arm.tokens += tokens
        arm.ms += ms
        bucket.steps += 1

    @property
    def pending_chain(self) -> bool:
        """The choice awaiting its reward is a static chain (not ``plan``)."""
        return self._last is not None and self._last[1] != PLAN

    def skip(self) -> None:
        """The last choice gets no reward (a step that cannot be measured)."""
        self._last = None

    # ---- what it learned ----------------------------------------------------------------------------
    def exploration_cost(self) -> float:
        """The share of the measured time lost to steps off the best arm (see the module docstring)."""
        ex = self.exploration
        return ex["explore_ms"] / ex["ms"] if ex["ms"] else 0.0

    def summary(self) -> dict:
        """Per bucket: the best arm, every arm's measured rate (tokens/s) and steps; the exploration."""
        out = {}
        for b, bucket in sorted(self.buckets.items()):
            out[bucket_label(b)] = {
                "best": self.best(b), "steps": bucket.steps,
                "arms": {str(a): {"tokens_per_s": 1e3 * self.rate(arm), "steps": round(arm.steps, 2),
                                  "prior_tokens_per_s": None if arm.prior_rate is None else 1e3 * arm.prior_rate}
                         for a, arm in bucket.arms.items()}}
        return {"buckets": out, "exploration": {**self.exploration, "cost": self.exploration_cost()}}

    def schedule(self) -> dict[int, int]:
        """The best static γ per bucket, keyed by the bucket's largest batch size (a vLLM Dynamic-SD-style
        table from batch size to the number of speculative tokens); a bucket whose best arm is ``plan`` gives its
        best chain."""
        if self.monotone:
            return {2 ** b: g for b, g in self.smoothed().items()}
        return {2 ** b: int(self.best_chain(b)) for b, bucket in sorted(self.buckets.items())
                if any(a != PLAN for a in bucket.arms)}


def adopt(policy, learner: GoodputFeedback | None) -> GoodputFeedback | None:
    """Give ``policy`` (a cost-driven policy with goodput feedback) the ``learner`` another instance of it has
    been filling (a benchmark builds a policy per run; a server keeps one learner): returns the learner it now
    holds (its own when ``learner`` is None), or None for a policy without feedback."""
    own = getattr(policy, "goodput", None)
    if own is None:
        return None
    if learner is not None and learner is not own:
        policy.goodput, policy._reward = learner, StepReward(learner, policy._reward.survival)
    return policy.goodput


class Survival:
    """The pooled survival curve of drafts, S_m = P(drafts 1..m kept), from discounted counts per depth: a row
    that drafted d and kept a reached depths 1..min(d, a + 1) and kept 1..a. Each hazard starts at ``prior``
    over ``prior_n`` pseudo-drafts; evidence fades by ``discount`` a step, as the bandit's does."""

    def __init__(self, depth: int, discount: float = 0.995, prior: float = 0.7, prior_n: float = 2.0):
        self.discount = float(discount)
        self.reached = [prior_n] * (depth + 1)  # index m: depth m (0 unused)
        self.kept = [prior * prior_n] * (depth + 1)

    def tokens(self, drafted: list[int]) -> float:
        """The tokens rows drafting ``drafted`` emit on average: 1 + S_1 + … + S_d a row."""
        cum, s = [0.0], 1.0
        for m in range(1, len(self.reached)):
            s *= self.kept[m] / self.reached[m]
            cum.append(cum[-1] + s)
        return sum(1.0 + cum[min(d, len(cum) - 1)] for d in drafted)

    def update(self, drafted: list[int], accepted: list[int]) -> None:
        self.reached = [r * self.discount for r in self.reached]
        self.kept = [k * self.discount for k in self.kept]
        for d, a in zip(drafted, accepted):
            for m in range(1, min(d, a + 1, len(self.reached) - 1) + 1):
                self.reached[m] += 1.0
                self.kept[m] += 1.0 if m <= a else 0.0


class StepReward:
    """The policy's side of the loop: the tokens a step emitted (from ``observe``; with the feedback's ``reward:
    expected``, a chain step's expected tokens by the pooled :class:`Survival` before this step's outcome) and its
    milliseconds (from the engine's timing hook), the prompt chunks it also prefilled priced off by the cost
    model."""

    def __init__(self, feedback: GoodputFeedback, survival: Survival | None = None):
        self.feedback, self._tokens = feedback, None
        self.survival = survival if survival is not None else Survival(feedback.max_gamma, feedback.discount)

    def observed(self, accepted: list[int], drafted: list[int]) -> None:
        # the curve only where it is read (reward: expected), and from chain steps only: a tree's drafts are not a
        # chain's depths
        if self.feedback.expected and self.feedback.pending_chain:
            self._tokens = self.survival.tokens(drafted)
            self.survival.update(drafted, accepted)
        else:
            self._tokens = sum(a + 1 for a in accepted)

    def timed(self, ms: float, shape, costs) -> None:
        tokens, self._tokens = self._tokens, None
        if tokens is None:
            self.feedback.skip()
            return
        if shape is not None and shape.prefill:
            if self.feedback.skip_prefill or costs is None or not hasattr(costs, "predict"):
                self.feedback.skip()
                return
            ms -= costs.predict(shape) - costs.predict(replace(shape, prefill=0, prefill_keys=0.0))
        self.feedback.reward(tokens, ms)


def goodput_of(policy: str, spec, max_gamma: int, plan_arm: bool = True) -> GoodputFeedback | None:
    """The feedback a policy's ``goodput`` setting asks for: false/None (none), true (the defaults) or a mapping
    of :class:`GoodputFeedback`'s settings plus ``enabled``."""
    if spec is None or spec is False:
        return None
    if spec is True:
        return GoodputFeedback(max_gamma, plan_arm=plan_arm)
    try:
        spec = dict(spec)
    except (TypeError, ValueError):
        raise ValueError(f"{policy} policy: goodput must be true, false or a mapping, got {spec!r}") from None
    if not spec.pop("enabled", True):
        return None
    known = {"discount", "bonus", "prior_steps", "neighbours", "reward", "prefill", "monotone"}
    bad = sorted(set(spec) - known)
    if bad:
        raise ValueError(f"{policy} policy: goodput has unknown keys {bad}; known: enabled, {', '.join(sorted(known))}")
    return GoodputFeedback(max_gamma, plan_arm=plan_arm, **spec)


def chain_priors(costs, R: int, cap: int, accept: float, feed_tokens: float) -> dict:
    """{γ: (tokens per ms, ms)} the cost model predicts for R rows drafting γ alike at acceptance rate ``accept``
    (γ = 0: plain decoding), for γ = 0..cap: the arms' priors."""
    out, value = {}, 0.0
    for g in range(cap + 1):
        value += accept ** g if g else 0.0
        ms = costs.step_ms(R, [R] * g, R * (g + 1), feed_tokens)
        out[g] = (R * (1 + value) / ms, ms)
    return out


def arm_priors(pricing, R: int, cap: int, accept: float, feed_tokens: float) -> dict:
    """Every arm's prior for a step of R rows (memoised per cost version on the rounded rates): the chains'
    :func:`chain_priors`, and for ``plan`` the best of them (a policy's own plan is priced as at least the best
    uniform γ)."""
    memo = pricing.memo("goodput_priors", shared=False)
    key = (R, cap, round(accept, 3), round(feed_tokens, 1))
    if key not in memo:
        chains = chain_priors(pricing.costs, R, cap, key[2], feed_tokens)
        memo[key] = {**chains, PLAN: max(chains.values())}
    return memo[key]
