"""Load-aware draft length: per-slot γ from acceptance estimates and a measured cost model.

Each step the policy chooses, for every running slot b, how many drafts to score, to maximise the batch's
expected emitted tokens per second:

    E = Σ_b (1 + Σ_{i ≤ γ_b} S_bi),   S_bi = Π_{j ≤ i} a_bj   (a_bj: P(draft j kept | drafts < j kept))
    T = overhead(R) + feed(R) + Σ_depths draft(A_d) + target(R, N = Σ_b (γ_b + 1))

with ``target``, ``draft``, ``feed`` and ``overhead`` read from the engine's step-cost model
(:class:`~eagle_backbone.step_cost.OnlineCostModel`): warm-started from the :class:`~eagle_backbone.cost.CostTable`
profiled on this machine, then fitted to the engine's own timed steps as it runs (``online_costs=false``: the
table as profiled; ``cost_model=FILE``: a model fitted in hindsight, frozen). Drafting goes depth by depth
because a_bi needs the drafter's state at depth i.

Two policies share :class:`LoadAwarePolicy` (and the tree and oracle budgets build on it) (the cost table, the running acceptance rate, the plan of a
step and the batch-1 hooks):

* :class:`LoadAwareMarginal` (``policy=load_aware``, ``load_aware_head``): the cost model with per-slot
  estimates.

  1. ``plan``: is drafting worth its fixed cost (the drafter's catch-up forward and a first depth) at this
     load? :func:`uniform_gamma`, a geometric chain at the running acceptance rate, gives the best uniform
     γ for R slots; if that is 0 the step is plain decoding (no drafter work): under heavy load the
     policy is batched AR.
  2. ``stop`` at depth d: the estimator gives a_bd for the rows that drafted, and :func:`allocate_depth`
     (the allocation, on the device: sorts and prefix sums over the A rows, tested against brute force)
     picks the drafts to score and the rows that draft on (see its docstring for the objective).
  3. ``observe``: each verification's outcomes (draft i kept or the first rejection) update an online
     logistic recalibration of the estimates (:mod:`ldlp.models.calibration`) and the running acceptance rate.

* :class:`LoadAwareStep` (``load_aware_step``, ablation): the cost model without per-slot estimates, one γ
  for the whole batch from the load and the running acceptance rate (as SGLang's batch-size schedules do).

Estimators (marginal and fixed): ``confidence`` (the drafter's top probability, recalibrated online: no
training) or the folder of a trained :class:`~ldlp.models.acceptance.DraftAcceptanceHead` per temperature
(``t0.0``, ``t0.7``...; β = Σ min(p, q) labels at T > 0), which reads the drafter state too.

No host read inside a step: the estimates, survivals and codes stay on the device, the cost table's
lookups are device vectors (:class:`StepTables`), and the raw estimates reach the host with the step's
one read, for the recalibration. The engine times the policy's own calls (``engine.policy_s``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_backbone.cost import CostTable, cost_key, load_or_profile
from eagle_backbone.policy import DROP, GO, STOP, Depth, DraftPolicy, Rows
from eagle_backbone.step_cost import OnlineCostModel
from ldlp.models.calibration import EPS, OnlineLogitCalibration

log = logging.getLogger(__name__)

KEEP, KEEP_AND_DRAFT = STOP, GO  # the allocation's names for the protocol's codes


# ---- the allocation: pure functions of host numbers ---------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """A step's plan so far: ``E`` expected emitted tokens, ``N`` scored tokens, ``T`` milliseconds (0-d
    device tensors inside a step; floats where a caller builds one by hand)."""

    E: torch.Tensor | float
    N: torch.Tensor | float
    T: torch.Tensor | float


@dataclass(frozen=True)
class DepthCosts:
    """What one draft depth's choices cost, for a depth of A drafting rows in a step of R: ``draft_ms`` this
    depth's drafter forward (already spent, whatever is kept), ``token_ms`` (m) the target's milliseconds
    per scored token at the plan's N (the secant over this depth's A tokens), and ``next_depth_ms[k]`` the
    next depth's drafter forward and bookkeeping over k rows (k = 0..R)."""

    draft_ms: torch.Tensor | float
    token_ms: torch.Tensor | float
    next_depth_ms: torch.Tensor

    @classmethod
    def from_table(cls, costs: CostTable, R: int, A, N) -> DepthCosts:
        """From the table's lookups over integer counts (:class:`StepTables`); A and N may be device scalars."""
        device = A.device if isinstance(A, torch.Tensor) else torch.device("cpu")
        return StepTables.of(costs, R, device).depth(A, N)


class StepTables:
    """The cost table's lookups for a step of R rows as device vectors over integer counts: ``target[n]`` the
    verification of n scored tokens in all, ``draft[k]`` a draft depth over k rows. A depth's costs are then
    indexing, with no host read."""

    def __init__(self, costs: CostTable | OnlineCostModel, R: int, n_max: int, device):
        self.R = R
        self.target = torch.tensor([costs.target_ms(R, n) for n in range(n_max + 1)], dtype=torch.float64, device=device)
        self.draft = torch.tensor([costs.draft_ms(k, R) for k in range(R + 1)], dtype=torch.float64, device=device)

    @classmethod
    def of(cls, costs: CostTable | OnlineCostModel, R: int, device) -> StepTables:
        """Built once per cost model version, R and device (a step scores at most R · (γ + 1) tokens, γ ≤ 32 in
        the engine)."""
        version = getattr(costs, "version", 0)
        memo = costs.__dict__.setdefault("_step_tables_", {})
        if memo.get("version") != version:
            memo.clear()
            memo["version"] = version
        key = (R, str(device))
        if key not in memo:
            memo[key] = cls(costs, R, 34 * R, device)
        return memo[key]

    def depth(self, A, N) -> DepthCosts:
        A = torch.as_tensor(A, device=self.draft.device)
        N = torch.as_tensor(N, device=self.draft.device).to(torch.long)
        token = (self.target[N + A] - self.target[N]) / A.clamp_min(1)
        return DepthCosts(self.draft[A], token, self.draft)


@dataclass(frozen=True)
class DepthAllocation:
    """Per drafted row of a depth: ``codes`` (0 drop, 1 keep and stop, 2 keep and draft on); ``budget`` the
    plan after this depth (its forward and the kept drafts added)."""

    codes: torch.Tensor
    budget: Budget


def marginal_prefix(values_desc: torch.Tensor, E, T, m) -> torch.Tensor:
    """How many of ``values_desc`` (expected tokens, sorted descending, each costing ``m`` ms) to add to a
    plan of E expected tokens in T ms so that E / T is largest: add while value / m is at least the rate
    so far (each addition then raises the rate, and the first that would lower it ends the prefix). On the
    device: the condition for every prefix at once, then the length of the run of passes."""
    k = torch.arange(values_desc.shape[0], device=values_desc.device, dtype=torch.float64)
    E_before = E + torch.cumsum(values_desc, 0) - values_desc
    ok = values_desc * (T + m * k) >= E_before * m
    return torch.cumprod(ok.to(torch.long), 0).sum()


def allocate_depth(survival: torch.Tensor, accept: torch.Tensor, can_continue: torch.Tensor,
                   budget: Budget, costs: DepthCosts) -> DepthAllocation:
    """The load-aware allocation at one draft depth, for the A rows that drafted there, on the device.

    ``survival[j]``: S_j, the probability that row j's draft at this depth survives verification (its
    earlier drafts' and its own acceptance estimates multiplied); ``accept[j]``: a_j, the estimate behind
    it, so that S_j · a_j predicts the survival of row j's next draft; ``can_continue[j]``: whether row j
    may draft another depth (its cap). ``budget``: the plan before this depth; ``costs``: see
    :class:`DepthCosts`. The objective, in two parts (each maximised exactly, tested against brute force):

    1. Scored drafts K ⊆ rows: maximise the plan's rate ρ = (E + Σ_K S_j) / (T + draft_ms + m · |K|),
       every scored token costing m ≥ 0 (the global greedy budget of DSpark and vLLM's adaptive
       verification, taken in descending S: :func:`marginal_prefix`).
    2. Rows that draft on, C ⊆ {j ∈ K: can_continue[j]}: maximise, at the rate ρ of part 1,
       Σ_C S_j · a_j − ρ · (m · |C| + next_depth_ms[|C|]): the predicted next survivals net of their
       target tokens and the next depth's forward (C empty scores 0; ties go to the smaller C).

    Rows outside K get code 0, K \\ C code 1, C code 2."""
    S, a = survival.to(torch.float64), accept.to(torch.float64)
    A, dev = S.shape[0], S.device
    E, N, T = budget.E, budget.N, budget.T + costs.draft_ms  # this depth's drafter forward is spent
    m = costs.token_ms
    order = torch.sort(S, descending=True, stable=True).indices
    n_kept = marginal_prefix(S[order], E, T, m)
    kept = torch.zeros(A, dtype=torch.bool, device=dev)
    kept[order] = torch.arange(A, device=dev) < n_kept
    E = E + torch.where(kept, S, 0.0).sum()
    N = N + n_kept
    T = T + m * n_kept
    # who drafts on: the best prefix of the predicted next survivals, net of the next depth's forward
    on = kept & can_continue
    value = torch.where(on, S * a, -1.0)  # candidates first (values >= 0), in descending value
    order2 = torch.sort(value, descending=True, stable=True).indices
    k = torch.arange(1, A + 1, device=dev)
    net = torch.cumsum(value[order2].clamp_min(0.0), 0) - (E / T) * (k * m + costs.next_depth_ms[k])
    net = torch.where(k <= on.sum(), net, float("-inf"))
    best_k = torch.argmax(torch.cat([net.new_zeros(1), net]))  # the first best: ties go to the smaller C
    go = torch.zeros(A, dtype=torch.bool, device=dev)
    go[order2] = k <= best_k
    codes = torch.where(kept, torch.where(go, KEEP_AND_DRAFT, KEEP), DROP)
    return DepthAllocation(codes, Budget(E, N, T))


def allocate_depth_host(survival: list[float], accept: list[float], can_continue: list[bool], budget: Budget,
                        costs: DepthCosts) -> tuple[list[int], Budget]:
    """:func:`allocate_depth` on host floats (the same objective, the same ties), for a step of a few rows on a
    CPU, where a read costs nothing and a handful of Python float operations beat twenty small tensor ops."""
    A = len(survival)
    E, N, T, m = budget.E, budget.N, budget.T + costs.draft_ms, costs.token_ms
    order = sorted(range(A), key=lambda j: -survival[j])  # stable, as the device's sort
    kept_n, E_run = 0, E
    for k, j in enumerate(order):  # marginal_prefix: add while value / m is at least the rate so far
        if survival[j] * (T + m * k) < E_run * m:
            break
        kept_n, E_run = kept_n + 1, E_run + survival[j]
    kept = set(order[:kept_n])
    E, N, T = E + sum(survival[j] for j in order[:kept_n]), N + kept_n, T + m * kept_n
    value = [survival[j] * accept[j] if j in kept and can_continue[j] else -1.0 for j in range(A)]
    order2 = sorted(range(A), key=lambda j: -value[j])
    best, best_k, run = 0.0, 0, 0.0
    for k in range(1, sum(v >= 0 for v in value) + 1):
        run += max(value[order2[k - 1]], 0.0)
        net = run - (E / T) * (k * m + costs.next_depth_ms[k])
        if net > best:  # the first best: ties go to the smaller set
            best, best_k = net, k
    go = set(order2[:best_k])
    return [(KEEP_AND_DRAFT if j in go else KEEP) if j in kept else DROP for j in range(A)], Budget(E, N, T)


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
    """A drafting step's state between ``plan`` and ``observe`` (rows: positions in the step; device
    tensors). ``caps``: the most each row may draft; ``survival``: each row's survival of its last kept
    draft (1.0 before any); ``going``: rows whose codes still say draft on; ``raw``: each row's raw
    estimates by depth (NaN where it did not draft; for the online recalibration); ``budget``: the marginal
    policy's plan totals (None for the others)."""

    caps: torch.Tensor
    survival: torch.Tensor
    going: torch.Tensor
    raw: torch.Tensor
    budget: Budget | None = None

    @classmethod
    def start(cls, caps: list[int], device, budget: Budget | None = None) -> StepPlan:
        R, G = len(caps), max(caps)
        return cls(torch.tensor(caps, device=device), torch.ones(R, dtype=torch.float64, device=device),
                   torch.ones(R, dtype=torch.bool, device=device),
                   torch.full((R, G), float("nan"), dtype=torch.float64, device=device), budget)


@dataclass
class HostPlan:
    """A drafting step's state on host floats (:class:`StepPlan`'s fields as lists), for the few-row steps a
    CPU engine plans on the host (:attr:`LoadAwareMarginal.host_rows`)."""

    caps: list[int]
    survival: list[float]
    going: list[bool]
    raw: list[list[float]]
    budget: Budget

    @classmethod
    def start(cls, caps: list[int], budget: Budget) -> HostPlan:
        G = max(caps)
        return cls(list(caps), [1.0] * len(caps), [True] * len(caps), [[math.nan] * G for _ in caps], budget)


class LoadAwarePolicy(DraftPolicy):
    """What the load-aware policies share: the cost table, the running acceptance rate and drafter feed, and
    a step's plan. Subclasses choose the step's uniform γ (:meth:`_uniform_gamma`) and, when they read
    drafts, the per-row codes (:meth:`_codes`)."""

    name = "load_aware"
    needs_costs = True

    def __init__(self, cost_dir: str, model: str, temperature: float = 0.0, max_gamma: int = 8,
                 prior: float = 0.7, explore_every: int = 32, profile_if_missing: bool = True,
                 cost_table: str | None = None, online_costs: bool = True, cost_model: str | None = None):
        if not isinstance(max_gamma, int) or isinstance(max_gamma, bool) or max_gamma < 1:
            raise ValueError(f"load_aware policy: max_gamma must be an integer >= 1, got {max_gamma!r}")
        if not 0 < prior < 1:
            raise ValueError(f"load_aware policy: prior must be in (0, 1), got {prior!r}")
        if cost_table is not None and not Path(cost_table).is_file():
            raise ValueError(f"load_aware policy: cost_table={cost_table} does not exist")
        if cost_model is not None and not Path(cost_model).is_file():
            raise ValueError(f"load_aware policy: cost_model={cost_model} does not exist (a step cost model fitted "
                             "by scripts/bench_batch.py: step_costs.json)")
        self.online_costs, self.cost_model_path = bool(online_costs), cost_model
        self.cost_dir, self.model_name, self.temperature = str(cost_dir), str(model), float(temperature)
        self.max_gamma, self.explore_every = max_gamma, int(explore_every)
        self.profile_if_missing, self.cost_table_path = bool(profile_if_missing), cost_table
        self.accept_rate = float(prior)  # running P(draft kept) over observed drafts (an EMA)
        self.feed_tokens = 2.0  # running tokens a row feeds the drafter per step (accepted + 1)
        self.costs: CostTable | OnlineCostModel | None = None  # what the policy prices steps with
        self.table: CostTable | None = None  # the profiled table: the online model's prior
        self.device = torch.device("cpu")
        self.steps = self.drafting_steps = 0
        self._idle = 0
        self._plan: StepPlan | None = None
        self._gamma_memo: dict = {}

    # ---- setup --------------------------------------------------------------------------------------
    def bind_engine(self, engine) -> None:
        if engine.kind is None:
            return  # nothing to draft with: every step is plain decoding
        # the engine's sampling is what the estimates must be calibrated for (a sweep over T reuses one config)
        self.temperature = 0.0 if engine.sampling.greedy else float(engine.sampling.temperature)
        self.device = engine.device
        self._setup(engine.target, engine.candidates, engine.attn)
        self.costs = self._cost_model(engine)

    def _cost_model(self, engine) -> CostTable | OnlineCostModel:
        """What this policy prices steps with: the engine's online model warm-started from the table (default),
        a model fitted in hindsight (``cost_model=FILE``, frozen; the engine records its predictions), or the
        table as profiled (``online_costs=false``)."""
        if self.cost_model_path is not None:
            model = OnlineCostModel.load(self.cost_model_path)
            if engine.cost_model is None:
                engine.cost_model = model
            return model
        if not self.online_costs:
            return self.table
        return engine.attach_costs(self.table, **self._model_options())

    def _model_options(self) -> dict:
        return {}

    def _setup(self, target, candidates, attn: str = "eager") -> None:
        """The cost table for this machine (profiled with engines like the one to serve, when missing)."""
        from eagle_backbone.engine import BatchedSpeculativeEngine

        def factory(R: int, policy=None):
            return BatchedSpeculativeEngine(target, candidates, slots=R, capacity=256, attn=attn, policy=policy)

        key = cost_key(self.model_name, target.dtype, target.device, torch.get_num_threads())
        if self.cost_table_path is not None:
            self.table = CostTable.load(self.cost_table_path, key)
        else:
            self.table = load_or_profile(self.cost_dir, key, factory, self.profile_if_missing, log=log.info)
        self.costs = self.table

    # ---- the plan -----------------------------------------------------------------------------------
    def best_uniform_gamma(self, R: int, cap: int, accept: float) -> int:
        """:func:`uniform_gamma` at the running drafter feed, memoised on the arguments rounded (the answer
        changes in steps)."""
        key = (R, cap, round(accept, 3), round(self.feed_tokens, 1))
        version = getattr(self.costs, "version", 0)
        if self._gamma_memo.get("version") != version:  # the online model refitted: the answers may move
            self._gamma_memo = {"version": version}
        if key not in self._gamma_memo:
            self._gamma_memo[key] = uniform_gamma(self.costs, R, cap, key[2], self.feed_tokens)
        return self._gamma_memo[key]

    def _uniform_gamma(self, caps: list[int]) -> int:
        """The step's γ before per-row choices (0: a plain decoding step)."""
        return self.best_uniform_gamma(len(caps), max(caps), self.accept_rate)

    def _start(self, caps: list[int], g: int) -> tuple[list[int], StepPlan]:
        """(the plan's γ per row, the step's state) for a drafting step of uniform γ ``g``."""
        return caps, StepPlan.start(caps, self.device)

    def plan(self, rows: Rows) -> list[int]:
        caps, R = rows.caps, len(rows)
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
            return [0] * R
        self.drafting_steps += 1
        out, self._plan = self._start(caps, g)
        return out

    # ---- the observation ----------------------------------------------------------------------------
    def reads(self) -> dict[str, torch.Tensor]:
        plan = self._plan
        return {"raw": plan.raw} if isinstance(plan, StepPlan) and self.reads_drafts else {}

    def observe(self, rows: Rows, drafted: list[int], accepted: list[int], extra: dict | None = None) -> None:
        plan = self._plan
        self.feed_tokens += 0.1 * (sum(accepted) / max(1, len(accepted)) + 1 - self.feed_tokens)
        if plan is None:
            return
        raws = plan.raw if isinstance(plan, HostPlan) else (extra or {}).get("raw") or [[] for _ in drafted]
        est, seen_kept, kept = [], [], []
        for raw, n, k in zip(raws, drafted, accepted):
            raw = [r for r in raw if r == r]  # the depths this row drafted (NaN elsewhere)
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

    def _observe_estimates(self, est: list[float], kept: list[float]) -> None:
        """Raw estimates and their observed outcomes (1 kept, 0 the first rejection), for a recalibration."""


class LoadAwareStep(LoadAwarePolicy):
    """Ablation (``policy=load_aware_step``): the cost model without per-slot estimates: every row drafts
    the best uniform γ at the load and the running acceptance rate (capped by its own cap); no draft is
    read."""

    def _start(self, caps: list[int], g: int) -> tuple[list[int], StepPlan]:
        return [min(g, c) for c in caps], StepPlan.start(caps, self.device)


class _PerSlotEstimates(LoadAwarePolicy):
    """A load-aware policy that reads every draft: per-row acceptance estimates a_bd (the drafter's top
    probability or a trained head), recalibrated online, multiplied into survivals; :meth:`_codes` turns
    them into stop codes, on the device."""

    reads_drafts = True

    def __init__(self, cost_dir: str, model: str, temperature: float = 0.0, estimator: str = "confidence",
                 max_gamma: int = 8, recalibrate: bool = True, decay: float = 0.98, prior: float = 0.7,
                 explore_every: int = 32, profile_if_missing: bool = True, cost_table: str | None = None,
                 online_costs: bool = True, cost_model: str | None = None):
        super().__init__(cost_dir, model, temperature, max_gamma, prior, explore_every, profile_if_missing,
                         cost_table, online_costs, cost_model)
        if estimator != "confidence" and not Path(estimator).is_dir():
            raise ValueError(f"load_aware policy: estimator={estimator!r} is neither 'confidence' nor a folder of "
                             "draft acceptance heads (python scripts/train_draft_acceptance.py)")
        self.estimator_spec, self.recalibrate = estimator, bool(recalibrate)
        self.calibration = OnlineLogitCalibration(decay=decay)
        self.head = None
        self._wc = torch.tensor([1.0, 0.0], dtype=torch.float64)  # the online correction's (w, c), on the device
        self._wc_host = (1.0, 0.0)
        self._host_ok = False  # a CPU engine that reads each depth's codes (bind_engine)
        self._pending: tuple[list, list] = ([], [])  # outcomes not yet in the correction
        self.update_every = 32  # outcomes per Newton step of the correction

    def _setup(self, target, candidates, attn: str = "eager") -> None:
        super()._setup(target, candidates, attn)
        self.calibration.to(target.device)
        self._wc = self._wc.to(target.device)
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

    def stop(self, d: Depth) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            return torch.full_like(d.tokens, GO)
        rows = torch.as_tensor(d.rows, device=d.tokens.device)
        raw = self.estimates(d.depth, d.states, d.probs).to(torch.float64)
        a = _corrected_t(raw, self._wc[0], self._wc[1]) if self.recalibrate else raw
        going = plan.going[rows]
        plan.raw[rows, d.depth - 1] = torch.where(going, raw, plan.raw[rows, d.depth - 1])
        S = plan.survival[rows] * a
        codes = self._codes(d.depth, going, S, a, plan.caps[rows] > d.depth)
        codes = torch.where(going, codes, DROP)
        plan.survival[rows] = torch.where(codes != DROP, S, plan.survival[rows])
        plan.going[rows] = going & (codes == GO)
        return codes

    def _codes(self, depth: int, going: torch.Tensor, survival: torch.Tensor, accept: torch.Tensor,
               can_continue: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _observe_estimates(self, est: list[float], kept: list[float]) -> None:
        if not self.recalibrate:
            return
        self._pending[0].extend(est)
        self._pending[1].extend(kept)
        if len(self._pending[0]) >= self.update_every:  # a Newton step per batch of outcomes, not per step
            dev = self._wc.device
            self.calibration.update(torch.tensor(self._pending[0], device=dev), torch.tensor(self._pending[1], device=dev))
            self._wc = self.calibration.params.to(torch.float64)  # stays on the device: no read
            self._pending = ([], [])
            if self._host_ok:  # a CPU: the host copy for the host-float plans costs no synchronisation
                self._wc_host = tuple(self._wc.tolist())


class LoadAwareMarginal(_PerSlotEstimates):
    """``policy=load_aware``: per-slot estimates and the cost model; each depth's drafts and the rows that
    draft on are chosen by :func:`allocate_depth` (see the module docstring), on the device; on a CPU engine
    that reads each depth's codes anyway (``early_exit``), a step of at most ``host_rows`` rows plans on host
    floats (:func:`allocate_depth_host`: the same choices without twenty small tensor ops a depth)."""

    host_rows = 4

    def bind_engine(self, engine) -> None:
        super().bind_engine(engine)
        self._host_ok = engine.device.type == "cpu" and bool(engine.early_exit)
        if self._host_ok:
            self._wc_host = tuple(self._wc.tolist())

    def _start(self, caps: list[int], g: int) -> tuple[list[int], StepPlan | HostPlan]:
        c, R = self.costs, len(caps)
        # the plan so far: every row emits one token; the drafter's catch-up forward is paid
        E, T = float(R), c.overhead_ms(R) + c.feed_ms(R, self.feed_tokens) + c.target_ms(R, R)
        if self._host_ok and R <= self.host_rows:
            return caps, HostPlan.start(caps, Budget(E, R, T))
        f64 = dict(dtype=torch.float64, device=self.device)
        budget = Budget(torch.tensor(E, **f64), torch.tensor(R, device=self.device), torch.tensor(T, **f64))
        return caps, StepPlan.start(caps, self.device, budget)

    def stop(self, d: Depth) -> torch.Tensor | list[int]:
        if not isinstance(self._plan, HostPlan):
            return super().stop(d)
        plan, depth = self._plan, d.depth
        raw = self.estimates(depth, d.states, d.probs).tolist()  # a CPU: the read is no synchronisation
        w, c = self._wc_host
        going = [plan.going[r] for r in d.rows]
        a = [_corrected(x, w, c) for x in raw] if self.recalibrate else raw
        S = [plan.survival[r] * x for r, x in zip(d.rows, a)]
        R, A, N = len(plan.caps), sum(going), plan.budget.N
        cost = self.costs
        costs = DepthCosts(cost.draft_ms(A, R), (cost.target_ms(R, N + A) - cost.target_ms(R, N)) / max(A, 1),
                           [cost.draft_ms(k, R) for k in range(R + 1)])
        codes, plan.budget = allocate_depth_host([s if g else -1.0 for s, g in zip(S, going)], a,
                                                 [g and plan.caps[r] > depth for r, g in zip(d.rows, going)],
                                                 plan.budget, costs)
        for j, r in enumerate(d.rows):
            if going[j]:
                plan.raw[r][depth - 1] = raw[j]
            else:
                codes[j] = DROP
            if codes[j] != DROP:
                plan.survival[r] = S[j]
            plan.going[r] = going[j] and codes[j] == GO
        return codes  # host codes: the engine reads codes each depth here anyway (early_exit)

    def _codes(self, depth: int, going: torch.Tensor, survival: torch.Tensor, accept: torch.Tensor,
               can_continue: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        # rows that stopped take no part: survival 0 is never scored, and they may not continue
        survival = torch.where(going, survival, -1.0)
        costs = StepTables.of(self.costs, plan.caps.shape[0], self.device).depth(going.sum(), plan.budget.N)
        out = allocate_depth(survival, accept, can_continue & going, plan.budget, costs)
        plan.budget = out.budget
        return out.codes


def _corrected(p: float, w: float, c: float) -> float:
    """:func:`_corrected_t` on one host float."""
    p = min(max(p, EPS), 1 - EPS)
    z = w * (math.log(p) - math.log1p(-p)) + c
    return 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))


def _corrected_t(p: torch.Tensor, w, c) -> torch.Tensor:
    """sigmoid(w * logit(p) + c) on the device, as :meth:`OnlineLogitCalibration.calibrate` computes it."""
    p = p.clamp(EPS, 1 - EPS)
    return torch.sigmoid(w * (torch.log(p) - torch.log1p(-p)) + c)


def load_head_for_temperature(folder: str, temperature: float):
    """The draft acceptance head trained at ``temperature`` under ``folder`` (subfolders ``t<T>``)."""
    from ldlp.models.acceptance import DraftAcceptanceHead

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
