"""Load-aware draft length: per-slot γ from acceptance estimates and a measured cost model.

Each step the policy chooses, for every running slot b, how many drafts to score, to maximise the batch's
expected emitted tokens per second:

    E = Σ_b (1 + Σ_{i ≤ γ_b} S_bi),   S_bi = Π_{j ≤ i} a_bj   (a_bj: P(draft j kept | drafts < j kept))
    T = overhead(R) + feed(R) + Σ_depths draft(A_d) + target(R, N = Σ_b (γ_b + 1))

with ``target``, ``draft``, ``feed`` and ``overhead`` read from a :class:`~eagle_backbone.cost.CostTable`
profiled on this machine. Drafting goes depth by depth because a_bi needs the drafter's state at depth i.

Three policies share :class:`LoadAwarePolicy` (the cost table, the running acceptance rate, the plan of a
step and the batch-1 hooks):

* :class:`LoadAwareMarginal` (``policy=load_aware``, ``load_aware_head``): the cost model with per-slot
  estimates.

  1. ``plan``: is drafting worth its fixed cost (the drafter's catch-up forward and a first depth) at this
     load? :func:`uniform_gamma`, a geometric chain at the running acceptance rate, gives the best uniform
     γ for R slots; if that is 0 the step is plain decoding (no drafter work): under heavy load the
     policy is batched AR.
  2. ``keep_rows`` at depth d: the estimator gives a_bd for the rows that drafted, and
     :func:`allocate_depth` (the allocation: a pure function of host numbers, tested against brute force)
     picks the drafts to score and the rows that draft on (see its docstring for the objective).
  3. ``observe_rows``: each verification's outcomes (draft i kept or the first rejection) update an online
     logistic recalibration of the estimates (:mod:`ldlp.calibration`) and the running acceptance rate.

* :class:`LoadAwareFixed` (``load_aware_fixed``, ablation): the same estimates, a fixed survival threshold
  instead of the cost model (:func:`threshold_codes`).
* :class:`LoadAwareStep` (``load_aware_step``, ablation): the cost model without per-slot estimates, one γ
  for the whole batch from the load and the running acceptance rate (as SGLang's batch-size schedules do).

Estimators (marginal and fixed): ``confidence`` (the drafter's top probability, recalibrated online: no
training) or the folder of a trained :class:`~ldlp.acceptance.DraftAcceptanceHead` per temperature
(``t0.0``, ``t0.7``...; β = Σ min(p, q) labels at T > 0), which reads the drafter state too.

The policy's own cost (estimator, host read of A numbers and the allocation: Python over ≤ slots
numbers a depth) is timed in ``self.own_s``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_backbone.cost import CostTable, cost_key, load_or_profile
from eagle_backbone.policy import BatchDraftPolicy, DraftContext
from ldlp.calibration import EPS, OnlineLogitCalibration

log = logging.getLogger(__name__)

DROP, KEEP, KEEP_AND_DRAFT = 0, 1, 2  # keep_rows' codes per row (BatchDraftPolicy)


# ---- the allocation: pure functions of host numbers ---------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """A step's plan so far: ``E`` expected emitted tokens, ``N`` scored tokens, ``T`` milliseconds."""

    E: float
    N: float
    T: float


@dataclass(frozen=True)
class DepthCosts:
    """What one draft depth's choices cost, from the cost table, for a depth of A drafted rows in a step of R:
    ``draft_ms`` this depth's drafter forward (already spent, whatever is kept), ``token_ms`` (m) the target's
    milliseconds per scored token at the plan's N (the secant over this depth's A tokens), and
    ``next_depth_ms(k)`` the next depth's drafter forward and bookkeeping over k rows."""

    draft_ms: float
    token_ms: float
    next_depth_ms: Callable[[int], float]

    @classmethod
    def from_table(cls, costs: CostTable, R: int, A: int, N: float) -> DepthCosts:
        return cls(costs.draft_ms(A, R), (costs.target_ms(R, N + A) - costs.target_ms(R, N)) / A,
                   lambda k: costs.draft_ms(k, R))


@dataclass(frozen=True)
class DepthAllocation:
    """Per drafted row of a depth: ``codes`` (0 drop, 1 keep and stop, 2 keep and draft on); ``budget`` the
    plan after this depth (its forward and the kept drafts added)."""

    codes: list[int]
    budget: Budget


def marginal_prefix(values_desc: Sequence[float], E: float, T: float, m: float) -> int:
    """How many of ``values_desc`` (expected tokens, sorted descending, each costing ``m`` ms) to add to a
    plan of E expected tokens in T ms so that E / T is largest: add while value / m is at least the rate
    so far (each addition then raises the rate, and the first that would lower it ends the prefix)."""
    k = 0
    for v in values_desc:
        if v * T < E * m:
            break
        E, T, k = E + v, T + m, k + 1
    return k


def allocate_depth(survival: Sequence[float], accept: Sequence[float], can_continue: Sequence[bool],
                   budget: Budget, costs: DepthCosts) -> DepthAllocation:
    """The load-aware allocation at one draft depth, for the A rows that drafted there.

    ``survival[j]``: S_j, the probability that row j's draft at this depth survives verification (its
    earlier drafts' and its own acceptance estimates multiplied); ``accept[j]``: a_j, the estimate behind
    it, so that S_j · a_j predicts the survival of row j's next draft; ``can_continue[j]``: whether row j
    may draft another depth (its cap). ``budget``: the plan before this depth; ``costs``: see
    :class:`DepthCosts`. The objective, in two parts (each maximised exactly, tested against brute force):

    1. Scored drafts K ⊆ rows: maximise the plan's rate ρ = (E + Σ_K S_j) / (T + draft_ms + m · |K|),
       every scored token costing m ≥ 0 (the global greedy budget of DSpark and vLLM's adaptive
       verification, taken in descending S: :func:`marginal_prefix`).
    2. Rows that draft on, C ⊆ {j ∈ K: can_continue[j]}: maximise, at the rate ρ of part 1,
       Σ_C S_j · a_j − ρ · (m · |C| + next_depth_ms(|C|)): the predicted next survivals net of their
       target tokens and the next depth's forward (C empty scores 0; ties go to the smaller C).

    Rows outside K get code 0, K \\ C code 1, C code 2."""
    A = len(survival)
    E, N, T = budget.E, budget.N, budget.T + costs.draft_ms  # this depth's drafter forward is spent
    m = costs.token_ms
    codes = [DROP] * A
    order = sorted(range(A), key=lambda j: -survival[j])
    kept = order[: marginal_prefix([survival[j] for j in order], E, T, m)]
    for j in kept:
        E += survival[j]
        N += 1
        T += m
        codes[j] = KEEP
    # who drafts on: the best prefix of the predicted next survivals, net of the next depth's forward
    nxt = sorted((j for j in kept if can_continue[j]), key=lambda j: -survival[j] * accept[j])
    rate, best_k, best_net, value = E / T, 0, 0.0, 0.0
    for k, j in enumerate(nxt, 1):
        value += survival[j] * accept[j]
        net = value - rate * (k * m + costs.next_depth_ms(k))
        if net > best_net:
            best_k, best_net = k, net
    for j in nxt[:best_k]:
        codes[j] = KEEP_AND_DRAFT
    return DepthAllocation(codes, Budget(E, N, T))


def threshold_codes(survival: Sequence[float], accept: Sequence[float], can_continue: Sequence[bool],
                    threshold: float) -> list[int]:
    """The fixed-threshold ablation's rule (no cost model): keep a draft while its survival is at least
    ``threshold``, and draft on while the predicted next survival S · a is too."""
    return [(KEEP_AND_DRAFT if s * a >= threshold and go else KEEP) if s >= threshold else DROP
            for s, a, go in zip(survival, accept, can_continue)]


def uniform_gamma(costs: CostTable, R: int, cap: int, accept: float, feed_tokens: float) -> int:
    """The γ ≤ ``cap`` that maximises expected tokens per ms for R slots drafting alike at acceptance rate
    ``accept`` (0: plain decoding), with the drafter's catch-up forward over ``feed_tokens`` a row."""
    best_g, best_rate = 0, R / costs.step_ms(R, [], R, feed_tokens)
    value = 0.0
    for g in range(1, cap + 1):
        value += accept ** g
        rate = R * (1 + value) / costs.step_ms(R, [R] * g, R * (g + 1), feed_tokens)
        if rate > best_rate:
            best_g, best_rate = g, rate
    return best_g


# ---- the policies --------------------------------------------------------------------------------------


@dataclass
class StepPlan:
    """A drafting step's state between ``plan`` and ``observe_rows`` (rows: positions in the step).

    ``caps``: the most each row may draft; ``survival``: each row's survival of its last kept draft (1.0
    before any); ``raw``: each row's raw estimates by depth (for the online recalibration); ``budget``:
    the marginal policy's plan totals (None for the others)."""

    caps: list[int]
    survival: list[float]
    raw: list[list[float]]
    budget: Budget | None = None

    @classmethod
    def start(cls, caps: list[int], budget: Budget | None = None) -> StepPlan:
        R = len(caps)
        return cls(caps, [1.0] * R, [[] for _ in range(R)], budget)


class LoadAwarePolicy(BatchDraftPolicy):
    """What the load-aware policies share: the cost table, the running acceptance rate and drafter feed, a
    step's plan, and the batch-1 hooks (R = 1). Subclasses choose the step's uniform γ
    (:meth:`_uniform_gamma`) and, when they read drafts, the per-row codes (:meth:`_codes`)."""

    name = "load_aware"

    def __init__(self, cost_dir: str, model: str, temperature: float = 0.0, max_gamma: int = 8,
                 prior: float = 0.7, explore_every: int = 32, profile_if_missing: bool = True,
                 cost_table: str | None = None):
        if not isinstance(max_gamma, int) or isinstance(max_gamma, bool) or max_gamma < 1:
            raise ValueError(f"load_aware policy: max_gamma must be an integer >= 1, got {max_gamma!r}")
        if not 0 < prior < 1:
            raise ValueError(f"load_aware policy: prior must be in (0, 1), got {prior!r}")
        if cost_table is not None and not Path(cost_table).is_file():
            raise ValueError(f"load_aware policy: cost_table={cost_table} does not exist")
        self.cost_dir, self.model_name, self.temperature = str(cost_dir), str(model), float(temperature)
        self.max_gamma, self.explore_every = max_gamma, int(explore_every)
        self.profile_if_missing, self.cost_table_path = bool(profile_if_missing), cost_table
        self.accept_rate = float(prior)  # running P(draft kept) over observed drafts (an EMA)
        self.feed_tokens = 2.0  # running tokens a row feeds the drafter per step (accepted + 1)
        self.costs: CostTable | None = None
        self.own_s = 0.0  # the policy's own seconds (plan, estimates, allocation, observation)
        self.steps = self.drafting_steps = 0
        self._idle = 0
        self._plan: StepPlan | None = None
        self._gamma_memo: dict[tuple, int] = {}

    # ---- setup --------------------------------------------------------------------------------------
    def bind_engine(self, engine) -> None:
        if engine.kind is None:
            return  # nothing to draft with: every step is plain decoding
        # the engine's sampling is what the estimates must be calibrated for (a sweep over T reuses one config)
        self.temperature = 0.0 if engine.sampling.greedy else float(engine.sampling.temperature)
        self._setup(engine.target, engine.candidates, engine.attn)

    def _setup(self, target, candidates, attn: str = "eager") -> None:
        """The cost table for this machine (profiled with engines like the one to serve, when missing)."""
        from eagle_backbone.engine import BatchedSpeculativeEngine

        def factory(R: int, policy=None):
            return BatchedSpeculativeEngine(target, candidates, slots=R, capacity=256, attn=attn, policy=policy)

        key = cost_key(self.model_name, target.dtype, target.device, torch.get_num_threads())
        if self.cost_table_path is not None:
            self.costs = CostTable.load(self.cost_table_path, key)
        else:
            self.costs = load_or_profile(self.cost_dir, key, factory, self.profile_if_missing, log=log.info)

    # ---- the plan -----------------------------------------------------------------------------------
    def best_uniform_gamma(self, R: int, cap: int, accept: float) -> int:
        """:func:`uniform_gamma` at the running drafter feed, memoised on the arguments rounded (the answer
        changes in steps)."""
        key = (R, cap, round(accept, 3), round(self.feed_tokens, 1))
        if key not in self._gamma_memo:
            self._gamma_memo[key] = uniform_gamma(self.costs, R, cap, key[2], self.feed_tokens)
        return self._gamma_memo[key]

    def _uniform_gamma(self, caps: list[int]) -> int:
        """The step's γ before per-row choices (0: a plain decoding step)."""
        return self.best_uniform_gamma(len(caps), max(caps), self.accept_rate)

    def _start(self, caps: list[int], g: int) -> tuple[list[int], StepPlan]:
        """(the plan's γ per row, the step's state) for a drafting step of uniform γ ``g``."""
        return caps, StepPlan.start(caps)

    def plan(self, caps: list[int]) -> list[int]:
        t0 = time.perf_counter()
        R = len(caps)
        self.steps += 1
        if self.costs is None or not any(caps):
            self._plan = None
            return [0] * R
        caps = [min(c, self.max_gamma) for c in caps]
        g = self._uniform_gamma(caps)
        if g == 0 and self.explore_every and self._idle + 1 >= self.explore_every:
            g = 1  # now and then a short draft, so that the running acceptance rate can follow the text
        self._idle = 0 if g else self._idle + 1
        if g == 0:
            self._plan = None
            self.own_s += time.perf_counter() - t0
            return [0] * R
        self.drafting_steps += 1
        out, self._plan = self._start(caps, g)
        self.own_s += time.perf_counter() - t0
        return out

    # ---- the observation ----------------------------------------------------------------------------
    def observe_rows(self, drafted: list[int], accepted: list[int]) -> None:
        t0 = time.perf_counter()
        plan = self._plan
        self.feed_tokens += 0.1 * (sum(accepted) / max(1, len(accepted)) + 1 - self.feed_tokens)
        if plan is None:
            self.own_s += time.perf_counter() - t0
            return
        est, seen_kept, kept = [], [], []
        for raw, n, k in zip(plan.raw, drafted, accepted):
            seen = min(n, k + 1)  # drafts 1..k kept, draft k+1 (if drafted) the first rejection
            outcome = [1.0] * min(k, seen) + [0.0] * (seen - min(k, seen))
            kept.extend(outcome)
            if len(raw) >= seen:
                est.extend(raw[:seen])
                seen_kept.extend(outcome)
        if kept:
            rate = sum(kept) / len(kept)
            w = min(1.0, len(kept) / 32)  # an EMA whose step grows with the evidence
            self.accept_rate = min(0.99, max(0.01, self.accept_rate + 0.2 * w * (rate - self.accept_rate)))
        if est:
            self._observe_estimates(est, seen_kept)
        self._plan = None
        self.own_s += time.perf_counter() - t0

    def _observe_estimates(self, est: list[float], kept: list[float]) -> None:
        """Raw estimates and their observed outcomes (1 kept, 0 the first rejection), for a recalibration."""

    # ---- the batch-1 engine (R = 1) -----------------------------------------------------------------
    def begin(self, prompt_ids) -> None:
        self._plan = None

    def gamma(self, ctx: DraftContext) -> int:
        return self.plan([ctx.max_gamma])[0] if ctx.max_gamma > 0 else 0

    def keep_drafting(self, ctx, i, token, probs) -> bool:
        if self._plan is None or not self.reads_drafts:
            return True
        states = None if ctx.draft_state is None else ctx.draft_state[None]
        return self.keep_rows(i, [0], states, probs[None])[0] == KEEP_AND_DRAFT

    def observe(self, ctx, drafted, accepted) -> None:
        self.observe_rows([drafted], [accepted])


class LoadAwareStep(LoadAwarePolicy):
    """Ablation (``policy=load_aware_step``): the cost model without per-slot estimates: every row drafts
    the best uniform γ at the load and the running acceptance rate (capped by its own cap); no draft is
    read."""

    reads_drafts = False

    def _start(self, caps: list[int], g: int) -> tuple[list[int], StepPlan]:
        return [min(g, c) for c in caps], StepPlan.start(caps)


class _PerSlotEstimates(LoadAwarePolicy):
    """A load-aware policy that reads every draft: per-row acceptance estimates a_bd (the drafter's top
    probability or a trained head), recalibrated online, multiplied into survivals; :meth:`_codes` turns
    them into keep_rows' codes."""

    reads_drafts = True

    def __init__(self, cost_dir: str, model: str, temperature: float = 0.0, estimator: str = "confidence",
                 max_gamma: int = 8, recalibrate: bool = True, decay: float = 0.98, prior: float = 0.7,
                 explore_every: int = 32, profile_if_missing: bool = True, cost_table: str | None = None):
        super().__init__(cost_dir, model, temperature, max_gamma, prior, explore_every, profile_if_missing,
                         cost_table)
        if estimator != "confidence" and not Path(estimator).is_dir():
            raise ValueError(f"load_aware policy: estimator={estimator!r} is neither 'confidence' nor a folder of "
                             "draft acceptance heads (python scripts/train_draft_acceptance.py)")
        self.estimator_spec, self.recalibrate = estimator, bool(recalibrate)
        self.calibration = OnlineLogitCalibration(decay=decay)
        self.head = None
        self._wc = (1.0, 0.0)  # the online correction's (w, c) as host floats
        self._pending: tuple[list, list] = ([], [])  # outcomes not yet in the correction
        self.update_every = 32  # outcomes per Newton step of the correction

    def _setup(self, target, candidates, attn: str = "eager") -> None:
        super()._setup(target, candidates, attn)
        self.calibration.to("cpu")
        if self.estimator_spec != "confidence":
            if candidates.kind != "eagle":
                raise ValueError("load_aware policy: a draft acceptance head reads EAGLE drafter states; with a draft "
                                 "LM use estimator=confidence")
            self.head = load_head_for_temperature(self.estimator_spec, self.temperature).to(target.device)
            if self.head.config.hidden_size != target.hidden_size:
                raise ValueError(f"load_aware policy: {self.estimator_spec} was trained for hidden size "
                                 f"{self.head.config.hidden_size}, the target has {target.hidden_size}")

    def estimates(self, depth: int, states, probs: torch.Tensor) -> torch.Tensor:
        """Raw acceptance estimates (A,) on the device: the head's, or the drafter's top probability."""
        if self.head is not None:
            return self.head(states, probs, depth)
        return probs.max(-1).values.float()

    def keep_rows(self, depth: int, rows: list[int], states, probs: torch.Tensor) -> list[int]:
        t0 = time.perf_counter()
        plan = self._plan
        raw = self.estimates(depth, states, probs).tolist()  # the host read of this depth
        # the correction in Python: A numbers, cheaper than a dozen small tensor ops
        w, c = self._wc
        a = [_corrected(r, w, c) for r in raw] if self.recalibrate else raw
        for i, r in zip(rows, raw):
            plan.raw[i].append(r)
        S = [plan.survival[i] * ai for i, ai in zip(rows, a)]
        codes = self._codes(depth, rows, S, a, [plan.caps[i] > depth for i in rows])
        for i, s, code in zip(rows, S, codes):
            if code != DROP:
                plan.survival[i] = s
        self.own_s += time.perf_counter() - t0
        return codes

    def _codes(self, depth: int, rows: list[int], survival: list[float], accept: list[float],
               can_continue: list[bool]) -> list[int]:
        raise NotImplementedError

    def _observe_estimates(self, est: list[float], kept: list[float]) -> None:
        if not self.recalibrate:
            return
        self._pending[0].extend(est)
        self._pending[1].extend(kept)
        if len(self._pending[0]) >= self.update_every:  # a Newton step per batch of outcomes, not per step
            self.calibration.update(torch.tensor(self._pending[0]), torch.tensor(self._pending[1]))
            self._wc = tuple(self.calibration.params.tolist())
            self._pending = ([], [])


class LoadAwareMarginal(_PerSlotEstimates):
    """``policy=load_aware``: per-slot estimates and the cost model; each depth's drafts and the rows that
    draft on are chosen by :func:`allocate_depth` (see the module docstring)."""

    def _start(self, caps: list[int], g: int) -> tuple[list[int], StepPlan]:
        c, R = self.costs, len(caps)
        # the plan so far: every row emits one token; the drafter's catch-up forward is paid
        budget = Budget(float(R), float(R), c.overhead_ms(R) + c.feed_ms(R, self.feed_tokens) + c.target_ms(R, R))
        return caps, StepPlan.start(caps, budget)

    def _codes(self, depth: int, rows: list[int], survival: list[float], accept: list[float],
               can_continue: list[bool]) -> list[int]:
        plan = self._plan
        costs = DepthCosts.from_table(self.costs, len(plan.caps), len(rows), plan.budget.N)
        out = allocate_depth(survival, accept, can_continue, plan.budget, costs)
        plan.budget = out.budget
        return out.codes


class LoadAwareFixed(_PerSlotEstimates):
    """Ablation (``policy=load_aware_fixed``): the marginal policy's estimates without its cost model: every
    step drafts (up to the caps), and :func:`threshold_codes` keeps drafts while their estimated survival
    stays at least ``threshold``, at any load."""

    def __init__(self, cost_dir: str, model: str, temperature: float = 0.0, estimator: str = "confidence",
                 max_gamma: int = 8, threshold: float = 0.5, recalibrate: bool = True, decay: float = 0.98,
                 prior: float = 0.7, explore_every: int = 32, profile_if_missing: bool = True,
                 cost_table: str | None = None):
        if not 0 < threshold < 1:
            raise ValueError(f"load_aware policy: threshold must be in (0, 1), got {threshold!r}")
        super().__init__(cost_dir, model, temperature, estimator, max_gamma, recalibrate, decay, prior,
                         explore_every, profile_if_missing, cost_table)
        self.threshold = float(threshold)

    def _uniform_gamma(self, caps: list[int]) -> int:
        return max(caps)

    def _codes(self, depth: int, rows: list[int], survival: list[float], accept: list[float],
               can_continue: list[bool]) -> list[int]:
        return threshold_codes(survival, accept, can_continue, self.threshold)


def _corrected(p: float, w: float, c: float) -> float:
    """sigmoid(w * logit(p) + c), as :meth:`OnlineLogitCalibration.calibrate` computes it, for one float."""
    p = min(max(p, EPS), 1 - EPS)
    z = w * (math.log(p) - math.log1p(-p)) + c
    return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0


def load_head_for_temperature(folder: str, temperature: float):
    """The draft acceptance head trained at ``temperature`` under ``folder`` (subfolders ``t<T>``)."""
    from ldlp.acceptance import DraftAcceptanceHead

    root = Path(folder)
    found = {}
    for sub in root.glob("t*"):
        try:
            found[float(sub.name[1:])] = sub
        except ValueError:
            continue
    match = [p for t, p in found.items() if math.isclose(t, temperature, abs_tol=1e-6)]
    if not match:
        raise ValueError(f"load_aware policy: {root} has no head for temperature {temperature} "
                         f"(found {sorted(found)}); train one: python scripts/train_draft_acceptance.py")
    return DraftAcceptanceHead.from_pretrained(match[0])
