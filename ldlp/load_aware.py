"""Load-aware draft length: per-slot γ from acceptance estimates and a measured cost model.

Each step the policy chooses, for every running slot b, how many drafts to score, to maximise the batch's
expected emitted tokens per second:

    E = Σ_b (1 + Σ_{i ≤ γ_b} S_bi),   S_bi = Π_{j ≤ i} a_bj   (a_bj: P(draft j kept | drafts < j kept))
    T = overhead(R) + feed(R) + Σ_depths draft(A_d) + target(R, N = Σ_b (γ_b + 1))

with ``target``, ``draft``, ``feed`` and ``overhead`` read from a :class:`~eagle_backbone.batched.cost.CostTable`
profiled on this machine. Drafting goes depth by depth because a_bi needs the drafter's state at depth i:

1. ``plan``: is drafting worth its fixed cost (the drafter's catch-up forward and a first depth) at this
   load? A geometric chain at the running acceptance rate gives the best uniform γ for R slots; if that
   is 0 the step is plain decoding (no drafter work): under heavy load the policy is batched AR.
2. ``keep_rows`` at depth d: the estimator gives a_bd for the rows that drafted; draft d of row b is scored
   when its survival S_bd pays for its target cost at the step's current rate ρ = E/T: S_bd ≥ ρ · m, with
   m the marginal target milliseconds of one more scored token at the current N (the global greedy
   budget of DSpark and vLLM's adaptive verification, taken in descending S within a depth). A row goes on
   to depth d+1 when its predicted next survival S_bd · a_bd also pays for a share of the next depth's
   drafter forward; the rows kept on are the best prefix of that ranking.
3. ``observe_rows``: each verification's outcomes (draft i kept or the first rejection) update an online
   logistic recalibration of the estimates (:mod:`ldlp.calibration`) and the running acceptance rate.

Estimators: ``confidence`` (the drafter's top probability, recalibrated online: no training) or the
folder of a trained :class:`~ldlp.acceptance.DraftAcceptanceHead` per temperature (``t0.0``, ``t0.7``...;
β = Σ min(p, q) labels at T > 0), which reads the drafter state too.

Ablations (``mode``): ``fixed`` keeps the estimates but replaces the cost model by a fixed survival
threshold; ``step`` keeps the cost model but drops the per-slot estimates: one γ for the whole batch
from the load and the running acceptance rate (as SGLang's batch-size schedules do).

The policy's own cost (estimator, host read of A numbers and the allocation: Python over ≤ slots
numbers a depth) is timed in ``self.own_s``.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from eagle_backbone.batched.cost import CostTable, cost_key, load_or_profile
from eagle_backbone.policy import BatchDraftPolicy, DraftContext
from ldlp.calibration import EPS, OnlineLogitCalibration

log = logging.getLogger(__name__)

MODES = ("marginal", "fixed", "step")


class LoadAwarePolicy(BatchDraftPolicy):
    """Per-slot γ from calibrated acceptance estimates and a measured cost model (see the module docstring)."""

    name = "load_aware"

    def __init__(self, cost_dir: str, model: str, temperature: float = 0.0, estimator: str = "confidence",
                 mode: str = "marginal", max_gamma: int = 8, threshold: float = 0.5, recalibrate: bool = True,
                 decay: float = 0.98, prior: float = 0.7, explore_every: int = 32, profile_if_missing: bool = True,
                 cost_table: str | None = None):
        if mode not in MODES:
            raise ValueError(f"load_aware policy: mode must be one of {MODES}, got {mode!r}")
        if not isinstance(max_gamma, int) or isinstance(max_gamma, bool) or max_gamma < 1:
            raise ValueError(f"load_aware policy: max_gamma must be an integer >= 1, got {max_gamma!r}")
        if not 0 < threshold < 1 or not 0 < prior < 1:
            raise ValueError(f"load_aware policy: threshold and prior must be in (0, 1), got {threshold!r}, {prior!r}")
        if estimator != "confidence" and not Path(estimator).is_dir():
            raise ValueError(f"load_aware policy: estimator={estimator!r} is neither 'confidence' nor a folder of "
                             "draft acceptance heads (python scripts/train_draft_acceptance.py)")
        if cost_table is not None and not Path(cost_table).is_file():
            raise ValueError(f"load_aware policy: cost_table={cost_table} does not exist")
        self.cost_dir, self.model_name, self.temperature = str(cost_dir), str(model), float(temperature)
        self.estimator_spec, self.mode, self.max_gamma = estimator, mode, max_gamma
        self.threshold, self.recalibrate, self.explore_every = float(threshold), bool(recalibrate), int(explore_every)
        self.profile_if_missing, self.cost_table_path = bool(profile_if_missing), cost_table
        self.calibration = OnlineLogitCalibration(decay=decay)
        self.accept_rate = float(prior)  # running P(draft kept) over observed drafts (an EMA)
        self.feed_tokens = 2.0  # running tokens a row feeds the drafter per step (accepted + 1)
        self.costs: CostTable | None = None
        self.head = None
        self.own_s = 0.0  # the policy's own seconds (plan, estimates, allocation, observation)
        self.steps = self.drafting_steps = 0
        self._idle = 0
        self._step: dict | None = None
        self._wc = (1.0, 0.0)  # the online correction's (w, c) as host floats
        self._pending: tuple[list, list] = ([], [])  # outcomes not yet in the correction
        self.update_every = 32  # outcomes per Newton step of the correction

    # ---- setup --------------------------------------------------------------------------------------
    def bind_engine(self, engine) -> None:
        if engine.kind is None:
            return  # nothing to draft with: every step is plain decoding
        # the engine's sampling is what the estimates must be calibrated for (a sweep over T reuses one config)
        self.temperature = 0.0 if engine.sampling.greedy else float(engine.sampling.temperature)
        self._setup(engine.target, engine.candidates, engine.attn)

    def _setup(self, target, candidates, attn: str = "eager") -> None:
        """The cost table for this machine (profiled with engines like the one to serve, when missing) and
        the estimator."""
        from eagle_backbone.engine import BatchedSpeculativeEngine

        def factory(R: int, policy=None):
            return BatchedSpeculativeEngine(target, candidates, slots=R, capacity=256, attn=attn, policy=policy)

        key = cost_key(self.model_name, target.dtype, target.device, torch.get_num_threads())
        if self.cost_table_path is not None:
            self.costs = CostTable.load(self.cost_table_path, key)
        else:
            self.costs = load_or_profile(self.cost_dir, key, factory, self.profile_if_missing, log=log.info)
        self.calibration.to("cpu")
        if self.estimator_spec != "confidence":
            if candidates.kind != "eagle":
                raise ValueError("load_aware policy: a draft acceptance head reads EAGLE drafter states; with a draft "
                                 "LM use estimator=confidence")
            self.head = load_head_for_temperature(self.estimator_spec, self.temperature).to(target.device)
            if self.head.config.hidden_size != target.hidden_size:
                raise ValueError(f"load_aware policy: {self.estimator_spec} was trained for hidden size "
                                 f"{self.head.config.hidden_size}, the target has {target.hidden_size}")

    # ---- the allocation -----------------------------------------------------------------------------
    def best_uniform_gamma(self, R: int, cap: int, accept: float) -> int:
        """The γ that maximises expected tokens per ms for R slots drafting alike, at acceptance ``accept``
        (memoised on the arguments rounded: the answer changes in steps)."""
        key = (R, cap, round(accept, 3), round(self.feed_tokens, 1))
        memo = self.__dict__.setdefault("_gamma_memo", {})
        if key not in memo:
            memo[key] = self._best_uniform_gamma(R, cap, key[2])
        return memo[key]

    def _best_uniform_gamma(self, R: int, cap: int, accept: float) -> int:
        c = self.costs
        base = c.overhead_ms(R) + c.target_ms(R, R)
        best_g, best_rate = 0, R / base
        value, t_draft = 0.0, c.feed_ms(R, self.feed_tokens)
        for g in range(1, cap + 1):
            value += accept ** g
            t_draft += c.draft_ms(R, R)
            rate = R * (1 + value) / (c.overhead_ms(R) + t_draft + c.target_ms(R, R * (g + 1)))
            if rate > best_rate:
                best_g, best_rate = g, rate
        return best_g

    def plan(self, caps: list[int]) -> list[int]:
        t0 = time.perf_counter()
        R = len(caps)
        self.steps += 1
        if self.costs is None or not any(caps):
            self._step = None
            return [0] * R
        caps = [min(c, self.max_gamma) for c in caps]
        g = self.best_uniform_gamma(R, max(caps), self.accept_rate) if self.mode != "fixed" else max(caps)
        if g == 0 and self.explore_every and self._idle + 1 >= self.explore_every:
            g = 1  # now and then a short draft, so that the running acceptance rate can follow the text
        self._idle = 0 if g else self._idle + 1
        if g == 0:
            self._step = None
            self.own_s += time.perf_counter() - t0
            return [0] * R
        self.drafting_steps += 1
        if self.mode == "step":
            out = [min(g, c) for c in caps]
            self._step = {"raw": [[] for _ in range(R)]}
        else:
            c = self.costs
            out = caps
            # the plan so far: every row emits one token; the drafter's catch-up forward is paid
            self._step = {"R": R, "caps": caps, "S": [1.0] * R, "E": float(R), "N": float(R),
                          "T": c.overhead_ms(R) + c.feed_ms(R, self.feed_tokens) + c.target_ms(R, R),
                          "raw": [[] for _ in range(R)]}
        self.own_s += time.perf_counter() - t0
        return out

    def estimates(self, depth: int, states, probs: torch.Tensor) -> torch.Tensor:
        """Raw acceptance estimates (A,) on the device: the head's, or the drafter's top probability."""
        if self.head is not None:
            return self.head(states, probs, depth)
        return probs.max(-1).values.float()

    def keep_rows(self, depth: int, rows: list[int], states, probs: torch.Tensor) -> list[int]:
        t0 = time.perf_counter()
        st = self._step
        raw = self.estimates(depth, states, probs).tolist()  # the host read of this depth
        # the correction in Python: A numbers, cheaper than a dozen small tensor ops
        w, c = self._wc
        a = [_corrected(r, w, c) for r in raw] if self.recalibrate else raw
        for i, r in zip(rows, raw):
            st["raw"][i].append(r)
        S = [st["S"][i] * ai for i, ai in zip(rows, a)]
        codes = [0] * len(rows)
        if self.mode == "fixed":
            for j, i in enumerate(rows):
                if S[j] >= self.threshold:
                    codes[j] = 2 if S[j] * a[j] >= self.threshold and st["caps"][i] > depth else 1
                    st["S"][i] = S[j]
        else:
            codes = self._allocate(depth, rows, a, S)
        self.own_s += time.perf_counter() - t0
        return codes

    def _allocate(self, depth: int, rows: list[int], a: list[float], S: list[float]) -> list[int]:
        st, c = self._step, self.costs
        R = st["R"]
        A = len(rows)
        st["T"] += c.draft_ms(A, R)  # this depth's drafter forward is spent
        m = (c.target_ms(R, st["N"] + A) - c.target_ms(R, st["N"])) / A  # ms a scored token, at this size
        codes = [0] * A
        order = sorted(range(A), key=lambda j: -S[j])
        kept = order[: marginal_prefix([S[j] for j in order], st["E"], st["T"], m)]
        for j in kept:
            st["E"] += S[j]
            st["N"] += 1
            st["T"] += m
            st["S"][rows[j]] = S[j]
            codes[j] = 1
        # who drafts on: the best prefix of the predicted next survivals, net of the next depth's forward
        nxt = sorted((j for j in kept if st["caps"][rows[j]] > depth), key=lambda j: -S[j] * a[j])
        rate, best_k, best_net, value = st["E"] / st["T"], 0, 0.0, 0.0
        for k, j in enumerate(nxt, 1):
            value += S[j] * a[j]
            net = value - rate * (k * m + c.draft_ms(k, R))
            if net > best_net:
                best_k, best_net = k, net
        for j in nxt[:best_k]:
            codes[j] = 2
        return codes

    def observe_rows(self, drafted: list[int], accepted: list[int]) -> None:
        t0 = time.perf_counter()
        st = self._step
        self.feed_tokens += 0.1 * (sum(accepted) / max(1, len(accepted)) + 1 - self.feed_tokens)
        if st is None:
            self.own_s += time.perf_counter() - t0
            return
        est, seen_kept, kept = [], [], []
        for raw, n, k in zip(st["raw"], drafted, accepted):
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
        if est and self.recalibrate:
            self._pending[0].extend(est)
            self._pending[1].extend(seen_kept)
            if len(self._pending[0]) >= self.update_every:  # a Newton step per batch of outcomes, not per step
                self.calibration.update(torch.tensor(self._pending[0]), torch.tensor(self._pending[1]))
                self._wc = tuple(self.calibration.params.tolist())
                self._pending = ([], [])
        self._step = None
        self.own_s += time.perf_counter() - t0

    # ---- the batch-1 engine (R = 1) -----------------------------------------------------------------
    def begin(self, prompt_ids) -> None:
        self._step = None

    def gamma(self, ctx: DraftContext) -> int:
        return self.plan([ctx.max_gamma])[0] if ctx.max_gamma > 0 else 0

    def keep_drafting(self, ctx, i, token, probs) -> bool:
        if self._step is None or self.mode == "step" or not self.reads_drafts:
            return True
        states = None if ctx.draft_state is None else ctx.draft_state[None]
        return self.keep_rows(i, [0], states, probs[None])[0] == 2

    def observe(self, ctx, drafted, accepted) -> None:
        self.observe_rows([drafted], [accepted])

    @property
    def reads_drafts(self) -> bool:  # the ablation without per-slot estimates reads no drafts
        return self.mode != "step"


def _corrected(p: float, w: float, c: float) -> float:
    """sigmoid(w * logit(p) + c), as :meth:`OnlineLogitCalibration.calibrate` computes it, for one float."""
    p = min(max(p, EPS), 1 - EPS)
    z = w * (math.log(p) - math.log1p(-p)) + c
    return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0


def marginal_prefix(values_desc: list[float], E: float, T: float, m: float) -> int:
    """How many of ``values_desc`` (expected tokens, sorted descending, each costing ``m`` ms) to add to a
    plan of E expected tokens in T ms so that E / T is largest: add while value / m is at least the rate
    so far (each addition then raises the rate, and the first that would lower it ends the prefix)."""
    k = 0
    for v in values_desc:
        if v * T < E * m:
            break
        E, T, k = E + v, T + m, k + 1
    return k


def allocate_budget(survivals: list[list[float]], E: float, T: float, m: float) -> list[int]:
    """γ per row when every survival S_bi is known up front (rows' lists nonincreasing): the global top
    budget (DSpark, vLLM's adaptive verification): candidates ranked by S over the whole batch, the
    prefix that maximises (E + Σ S) / (T + m · count). The policy applies the same rule depth by depth."""
    cands = sorted(((s, i, b) for b, row in enumerate(survivals) for i, s in enumerate(row)),
                   key=lambda c: (-c[0], c[1]))
    gammas = [0] * len(survivals)
    for _, _, b in cands[: marginal_prefix([c[0] for c in cands], E, T, m)]:
        gammas[b] += 1
    return gammas


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
