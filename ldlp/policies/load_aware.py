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

Two policies share :class:`LoadAwarePolicy` (the plan of a step: whether drafting pays at this load, and
the exploration that keeps the rate current); what they price and learn with are objects they hold
(:mod:`ldlp.policies.pricing`: ``pricing``, the running acceptance rate and drafter feed), as the tree and
oracle budgets hold theirs:

* :class:`LoadAwareMarginal` (``policy=load_aware``, ``load_aware_head``): the cost model with per-slot
  estimates.

  1. ``plan``: is drafting worth its fixed cost (the drafter's catch-up forward and a first depth) at this
     load? :func:`uniform_gamma`, a geometric chain at the running acceptance rate, gives the best uniform
     γ for R slots; if that is 0 the step is plain decoding (no drafter work): under heavy load the
     policy is batched AR.
  2. ``stop`` at depth d: the estimator gives a_bd for the rows that drafted, and :func:`allocate_depth`
     (the allocation, on the device: sorts and prefix sums over the A rows, tested against brute force)
     (:mod:`ldlp.policies.allocation`) picks the drafts to score and the rows that draft on (see its
     docstring for the objective).
  3. ``observe``: each verification's outcomes (draft i kept or the first rejection) update an online
     logistic recalibration of the estimates (:mod:`ldlp.models.calibration`) and the running acceptance rate.

* :class:`LoadAwareStep` (``load_aware_step``, ablation): the cost model without per-slot estimates, one γ
  for the whole batch from the load and the running acceptance rate (as SGLang's batch-size schedules do).

Estimators: ``confidence`` (the drafter's top probability, recalibrated online: no
training) or the folder of a trained :class:`~ldlp.models.acceptance.DraftAcceptanceHead` per temperature
(``t0.0``, ``t0.7``...; β = Σ min(p, q) labels at T > 0), which reads the drafter state too.

No host read inside a step: the estimates, survivals and codes stay on the device, the cost table's
lookups are device vectors (:class:`~ldlp.policies.pricing.StepTables`), and the raw estimates reach the host with the step's
one read, for the recalibration. The engine times the policy's own calls (``engine.policy_s``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_backbone.errors import mismatch
from eagle_backbone.policy import DROP, GO, Depth, DraftPolicy, EngineView, Rows, int_at_least
from ldlp.models.calibration import EPS, OnlineLogitCalibration
from ldlp.policies.allocation import allocate_depth, allocate_depth_host
from ldlp.policies.goodput import PLAN, StepReward, arm_priors, goodput_of
from ldlp.policies.pricing import Budget, DepthCosts, DraftGate, FeedRate, RunningRate, StepPricing, StepTables

# ---- the policies --------------------------------------------------------------------------------------


@dataclass
class DraftState:
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
    def start(cls, caps: list[int], device, budget: Budget | None = None) -> DraftState:
        R, G = len(caps), max(caps)
        return cls(torch.tensor(caps, device=device), torch.ones(R, dtype=torch.float64, device=device),
                   torch.ones(R, dtype=torch.bool, device=device),
                   torch.full((R, G), float("nan"), dtype=torch.float64, device=device), budget)


@dataclass
class HostDraftState:
    """A drafting step's state on host floats (:class:`DraftState`'s fields as lists), for the few-row steps a
    CPU engine plans on the host (:attr:`LoadAwareMarginal.host_rows`)."""

    caps: list[int]
    survival: list[float]
    going: list[bool]
    raw: list[list[float]]
    budget: Budget

    @classmethod
    def start(cls, caps: list[int], budget: Budget) -> HostDraftState:
        G = max(caps)
        return cls(list(caps), [1.0] * len(caps), [True] * len(caps), [[math.nan] * G for _ in caps], budget)


class LoadAwarePolicy(DraftPolicy):
    """The load-aware plan of a step: whether drafting pays at this load (the best uniform γ at the running
    acceptance rate, and now and then a short draft to keep that rate current). Variants choose the rows' γ
    from it (:meth:`_start`) and, when they read drafts, the per-row codes (:meth:`_codes`)."""

    name = "load_aware"
    needs_costs = True

    def __init__(self, pricing, max_gamma: int = 8, prior: float = 0.7, explore_every: int = 32, goodput=None):
        self.max_gamma = int_at_least(self.name, "max_gamma", max_gamma, 1)
        # goodput feedback (ldlp/policies/goodput.py): a bandit per load bucket over the static chains and this
        # policy's own plan, rewarded by the tokens per second each step measures
        self.goodput = goodput_of(self.name, goodput, self.max_gamma)
        self._reward = StepReward(self.goodput) if self.goodput is not None else None
        if not 0 < prior < 1:
            raise ValueError(f"{self.name} policy: prior must be in (0, 1), got {prior!r}")
        self.pricing = StepPricing.of(self.name, pricing)  # its ``pricing`` node: the cost table and the costs
        self.gate = DraftGate(explore_every)
        self.accept = RunningRate(prior, 0.01, 0.99)  # P(draft kept) over observed drafts
        self.feed = FeedRate()
        self.temperature = 0.0  # the engine's sampling (bind): what the estimates are calibrated for
        self.device = torch.device("cpu")
        self._plan: DraftState | None = None

    @property
    def costs(self):
        return self.pricing.costs

    # ---- setup --------------------------------------------------------------------------------------
    def bind(self, view: EngineView) -> None:
        super().bind(view)
        self.temperature = 0.0 if view.greedy else float(view.sampling.temperature)
        self.device = view.device
        self.pricing.bind(view)

    # ---- the plan -----------------------------------------------------------------------------------
    def _start(self, caps: list[int], g: int) -> tuple[list[int], DraftState]:
        """(the plan's γ per row, the step's state) for a drafting step of uniform γ ``g``."""
        return caps, DraftState.start(caps, self.device)

    def plan(self, rows: Rows) -> list[int]:
        caps = [min(c, self.max_gamma) for c in rows.caps]
        if self.goodput is not None and self.costs is not None and any(caps):
            prior = arm_priors(self.pricing, len(caps), self.max_gamma, self.accept.value, self.feed.value)
            arm = self.goodput.choose(len(caps), prior)
            if arm != PLAN:  # a static chain this step
                self.gate.steps += 1
                self._plan = None
                return [min(arm, c) for c in caps]
        g = self.gate.gamma(self.pricing, caps, self.accept.value, self.feed.value)
        if g == 0:
            self._plan = None
            return [0] * len(rows)
        out, self._plan = self._start(caps, g)
        return out


    def timed(self, ms: float, shape) -> None:
        if self._reward is not None:
            self._reward.timed(ms, shape, self.costs)

    # ---- the observation ----------------------------------------------------------------------------
    def reads(self) -> dict[str, torch.Tensor]:
        plan = self._plan
        return {"raw": plan.raw} if isinstance(plan, DraftState) and self.reads_drafts else {}

    def observe(self, rows: Rows, drafted: list[int], accepted: list[int], extra: dict | None = None) -> None:
        plan = self._plan
        self.feed.update(accepted)
        if self._reward is not None:
            self._reward.observed(accepted, drafted)
        if plan is None:
            if self.goodput is not None and any(drafted):  # a static chain chosen by the feedback: its outcomes
                kept = sum(min(a, d) for a, d in zip(accepted, drafted))
                self.accept.update(kept, sum(min(d, a + 1) for a, d in zip(accepted, drafted)))
            return
        raws = plan.raw if isinstance(plan, HostDraftState) else (extra or {}).get("raw") or [[] for _ in drafted]
        est, seen_kept, kept = [], [], []
        for raw, n, k in zip(raws, drafted, accepted):
            raw = [r for r in raw if r == r]  # the depths this row drafted (NaN elsewhere)
            seen = min(n, k + 1)  # drafts 1..k kept, draft k+1 (if drafted) the first rejection
            outcome = [1.0] * min(k, seen) + [0.0] * (seen - min(k, seen))
            kept.extend(outcome)
            if len(raw) >= seen:
                est.extend(raw[:seen])
                seen_kept.extend(outcome)
        self.accept.update(sum(kept), len(kept))
        if est:
            self._observe_estimates(est, seen_kept)
        self._plan = None

    def _observe_estimates(self, est: list[float], kept: list[float]) -> None:
        """Raw estimates and their observed outcomes (1 kept, 0 the first rejection), for a recalibration."""


class LoadAwareStep(LoadAwarePolicy):
    """Ablation (``policy=load_aware_step``): the cost model without per-slot estimates: every row drafts
    the best uniform γ at the load and the running acceptance rate (capped by its own cap); no draft is
    read."""

    def _start(self, caps: list[int], g: int) -> tuple[list[int], DraftState]:
        return [min(g, c) for c in caps], DraftState.start(caps, self.device)


class _PerSlotEstimates(LoadAwarePolicy):
    """A load-aware policy that reads every draft: per-row acceptance estimates a_bd (the drafter's top
    probability or a trained head), recalibrated online, multiplied into survivals; :meth:`_codes` turns
    them into stop codes, on the device."""

    reads_drafts = True

    def __init__(self, pricing, estimator: str = "confidence", max_gamma: int = 8, recalibrate: bool = True,
                 decay: float = 0.98, prior: float = 0.7, explore_every: int = 32, goodput=None):
        super().__init__(pricing, max_gamma, prior, explore_every, goodput)
        if estimator != "confidence" and not Path(estimator).is_dir():
            raise ValueError(f"load_aware policy: estimator={estimator!r} is neither 'confidence' nor a folder of "
                             "draft acceptance heads (python scripts/train_draft_acceptance.py)")
        self.estimator_spec, self.recalibrate = estimator, bool(recalibrate)
        self.calibration = OnlineLogitCalibration(decay=decay)
        self.head = None
        self._wc = torch.tensor([1.0, 0.0], dtype=torch.float64)  # the online correction's (w, c), on the device
        self._wc_host = (1.0, 0.0)
        self._host_ok = False  # a CPU engine that reads each depth's codes (bind)
        self.update_every = 32  # outcomes per Newton step of the correction

    def bind(self, view: EngineView) -> None:
        super().bind(view)
        if view.kind is None:
            return
        target = view.target
        self.calibration.to(target.device)
        self._wc = self._wc.to(target.device)
        if self.estimator_spec != "confidence":
            if "acceptance" not in view.candidates.labelled_by:  # heads learn from acceptance labels of its states
                raise ValueError("load_aware policy: a draft acceptance head reads EAGLE drafter states; with a draft "
                                 "LM use estimator=confidence")
            self.head = load_head_for_temperature(self.estimator_spec, self.temperature).to(target.device)
            kind = (self.head.config.meta or {}).get("drafter_kind")
            if kind is not None and kind != view.kind:  # same width, states of another meaning
                mismatch(f"load_aware policy: {self.estimator_spec} was trained on {kind} drafter states and this "
                         f"pair's drafter is {view.kind}: train heads on its labels")
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
        if self.calibration.add(est, kept, self.update_every):
            self._wc = self.calibration.params.to(torch.float64)  # stays on the device: no read
            if self._host_ok:  # a CPU: the host copy for the host-float plans costs no synchronisation
                self._wc_host = tuple(self._wc.tolist())


class LoadAwareMarginal(_PerSlotEstimates):
    """``policy=load_aware``: per-slot estimates and the cost model; each depth's drafts and the rows that
    draft on are chosen by :func:`allocate_depth` (see the module docstring), on the device; on a CPU engine
    that reads each depth's codes anyway (``early_exit``), a step of at most ``host_rows`` rows plans on host
    floats (:func:`allocate_depth_host`: the same choices without twenty small tensor ops a depth)."""

    host_rows = 4

    def bind(self, view: EngineView) -> None:
        super().bind(view)
        self._host_ok = view.device.type == "cpu" and bool(view.early_exit)
        if self._host_ok:
            self._wc_host = tuple(self._wc.tolist())

    def _start(self, caps: list[int], g: int) -> tuple[list[int], DraftState | HostDraftState]:
        c, R = self.costs, len(caps)
        # the plan so far: every row emits one token; the drafter's catch-up forward is paid
        E, T = float(R), c.overhead_ms(R) + c.feed_ms(R, self.feed.value) + c.target_ms(R, R)
        if self._host_ok and R <= self.host_rows:
            return caps, HostDraftState.start(caps, Budget(E, R, T))
        f64 = dict(dtype=torch.float64, device=self.device)
        budget = Budget(torch.tensor(E, **f64), torch.tensor(R, device=self.device), torch.tensor(T, **f64))
        return caps, DraftState.start(caps, self.device, budget)

    def stop(self, d: Depth) -> torch.Tensor | list[int]:
        if not isinstance(self._plan, HostDraftState):
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
