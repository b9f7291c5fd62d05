"""What a step costs, measured as the engine runs: one online, monotone step-cost model.

Every step the engine (:class:`~eagle_backbone.batched_engine.BatchedSpeculativeEngine`) records its wall time next to
its shape (:class:`StepShape`: running rows, scored tokens, attended keys, draft depths and drafting rows,
tokens the drafter caught up on, prompt tokens joined, a tree). :class:`OnlineCostModel` fits a few costs to
those records:

    ms = fixed + per_row · R + per_token · N + per_key · keys
         + per_draft_forward · (depths + 1) + per_draft_row · Σ_d A_d + per_fed_token · F + per_tree · tree

* **Monotone by construction**: every cost is >= 0 and every feature grows with the work, so more rows,
  tokens, keys or depths never predict a cheaper step.
* **Robust**: Huber weights on relative residuals (iteratively reweighted, scale from the median absolute
  residual), fitted by non-negative least squares; an outlier step (a page fault, another process) moves it
  little.
* **Online**: records age by ``forget`` per step (a window of the last ``window``), so the model follows a
  change of load; it refits every ``refit_every`` records (every 2 × ``refit_every`` after the first 64).
* **CPU time and the stretch.** On a CPU the engine also gives each step's CPU time (the thread's, torch on
  one thread): the costs are fitted to that, which another process on the core does not inflate, and a
  running stretch (wall over CPU time, a geometric average) turns them into wall milliseconds. Every cost
  scales by the same stretch, so the policies' choices follow the CPU-time fit alone; on a GPU (CUDA events)
  the costs are fitted to wall time and the stretch stays 1.
* **Warm-started** from the profiled :class:`~eagle_backbone.cost.CostTable` (the prior): the table's steps
  on its grid are pseudo-records of total weight ``prior_weight``, and a light ridge keeps what the records
  cannot identify at the prior's values (a run at one slot count says nothing of the per-row cost). The
  pseudo-records fade as the engine's own steps accumulate (by ``prior_weight / (prior_weight + records
  seen)``); the ridge does not, so a direction the records never vary stays where the prior put it.

It reads like the table (``target_ms``, ``draft_ms``, ``feed_ms``, ``overhead_ms``, ``step_ms``), so every
cost-driven policy, the batched oracle, replay and tuning read this one model; ``version`` changes at each
refit, for callers that cache what they derived from it. The fit is a handful of 8-column NNLS solves every
few steps (well under a millisecond); it counts as the policy's own time.

:func:`nonnegative_least_squares` is the one solve of every time fitted as non-negative costs of counts: this
model's, vLLM's step model's and replay's linear table's.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from eagle_backbone.io import atomic_write_json

FEATURES = ("fixed", "per_row", "per_token", "per_key", "per_draft_forward", "per_draft_row", "per_fed_token",
            "per_tree")
KEY_UNIT = 1000.0  # attended keys are counted in thousands (keeps the columns of one scale)


def attended_keys(contexts, counts) -> float:
    """Keys the target's attention reads: each of a row's n new tokens sees its row's ``context`` earlier
    positions and the new ones up to itself: Σ_b n_b · (context_b + (n_b + 1) / 2)."""
    return float(sum(n * (c + (n + 1) / 2) for c, n in zip(contexts, counts)))


def nonnegative_least_squares(X: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None,
                              maxiter: int | None = None) -> np.ndarray:
    """The costs θ >= 0 that minimise Σ_i weights_i · (X_i · θ - y_i)² (scipy's Lawson-Hanson ``nnls``, its rows
    scaled by the square roots of ``weights``; ``maxiter`` its iterations, by default 3 per column).

    Every fit of a time as non-negative costs of counts solves this; what each fits differs, and stays with it:
    :class:`OnlineCostModel` fits relative residuals of single steps, Huber-reweighted and with ridge rows that
    pull it toward its prior (a robust estimator that must follow a stream and keep what the steps never vary);
    vLLM's :class:`~ldlp.bench.peers.vllm_schedule.StepModel` fits the median of each cell of like steps,
    weighted by its steps; replay's :func:`~ldlp.bench.harness.replay.fit_costs` fits whole generations'
    seconds, unweighted. The profiled :class:`~eagle_backbone.cost.CostTable` fits nothing: it interpolates its
    measured medians."""
    if weights is not None:
        scale = np.sqrt(weights)
        X, y = X * scale[:, None], y * scale
    theta, _ = nnls(X, y, maxiter=maxiter)
    return theta


@dataclass(frozen=True)
class StepShape:
    """What a step did, on the host: ``rows`` decoding rows scoring ``scored`` tokens in all over ``keys``
    attended keys; ``depth_rows[d]`` rows drafting at depth d + 1; ``fed`` tokens the drafter caught up on
    (its catch-up forward runs whenever a row drafts); ``prefill`` prompt tokens joined into the target
    forward (``prefill_keys`` their keys; the drafter prefills them too); ``tree``: the step grew trees."""

    rows: int
    scored: int
    keys: float
    depth_rows: tuple[int, ...] = ()
    fed: int = 0
    prefill: int = 0
    prefill_keys: float = 0.0
    tree: bool = False
    drafter: bool = True  # whether a drafter reads the joined prompts

    def features(self) -> np.ndarray:
        drafting = any(a > 0 for a in self.depth_rows)
        depths = sum(1 for a in self.depth_rows if a > 0)
        pre_draft = self.prefill > 0 and self.drafter
        return np.array([1.0, self.rows, self.scored + self.prefill, (self.keys + self.prefill_keys) / KEY_UNIT,
                         depths + int(drafting) + int(pre_draft), sum(self.depth_rows),
                         (self.fed if drafting else 0) + (self.prefill if pre_draft else 0), float(self.tree)])


@dataclass
class StepRecord:
    """One timed step: its shape, its wall milliseconds, what the model predicted before seeing it (None
    without a model), and on a CPU the step's own CPU milliseconds and the model's prediction of those."""

    shape: StepShape
    ms: float
    predicted_ms: float | None = None
    gamma: int = 0  # the step's largest planned draft depth (for per-γ accuracy)
    cpu_ms: float | None = None
    predicted_cpu_ms: float | None = None


class OnlineCostModel:
    """The step-cost model (module docstring). ``prior``: a :class:`~eagle_backbone.cost.CostTable` (or None: no
    prior, the fit is the records' alone; until the first fit it predicts 0). ``frozen``: never refit (a model
    fitted in hindsight and loaded for a rerun)."""

    def __init__(self, prior=None, forget: float = 0.99, window: int = 512, refit_every: int = 8,
                 prior_weight: float = 16.0, ridge: float = 1.0, context: float = 128.0, frozen: bool = False,
                 tree_prior_ms: float = 0.0):
        if not 0 < forget <= 1 or window < 8 or refit_every < 1 or prior_weight < 0 or ridge < 0:
            raise ValueError(f"step cost model: need 0 < forget <= 1, window >= 8, refit_every >= 1, prior_weight >= 0 "
                             f"and ridge >= 0; got {forget}, {window}, {refit_every}, {prior_weight}, {ridge}")
        self.forget, self.window, self.refit_every = float(forget), int(window), int(refit_every)
        self.prior_weight, self.ridge, self.frozen = float(prior_weight), float(ridge), bool(frozen)
        self.records: deque[tuple[np.ndarray, float]] = deque(maxlen=self.window)
        self.theta = np.zeros(len(FEATURES))
        self.version = 0
        self.seen = 0
        self.context = float(context)  # running mean context of a decoding row (for predictions by counts)
        self.tree_prior_ms = float(tree_prior_ms)
        self.log_stretch = 0.0  # running log(wall / CPU ms) (0: CPU time not given)
        self.prior_meta: dict | None = None
        self.key: dict | None = None  # the setup its costs were measured on (a cost key: model, dtype, drafter, CPU)
        self._prior_X = np.zeros((0, len(FEATURES)))
        self._prior_y = np.zeros(0)
        self._prior_theta = np.zeros(len(FEATURES))
        self._since = 0
        if prior is not None:
            self.warm_start(prior)

    # ---- the prior -------------------------------------------------------------------------------------
    @property
    def has_prior(self) -> bool:
        return self._prior_y.size > 0 or self.prior_meta is not None

    def warm_start(self, table, gammas=range(0, 9)) -> OnlineCostModel:
        """Pseudo-records from ``table``'s step formula on its grid (its slot counts, γ = 0..8, the drafter
        feeding γ + 1 tokens a row at most 3, the table's profiled context) and the fit to them alone."""
        ctx = float((table.meta or {}).get("context", self.context))
        X, y = [], []
        for R in table.slots:
            for g in gammas:
                fed = min(g + 1, 3)
                n = [g + 1] * R
                shape = StepShape(R, R * (g + 1), attended_keys([ctx] * R, n), tuple([R] * g), R * fed)
                X.append(shape.features())
                y.append(table.step_ms(R, [R] * g, R * (g + 1), fed))
        self._prior_X, self._prior_y = np.array(X), np.array(y)
        self.context = ctx
        self._prior_theta = self._solve(self._prior_X, self._prior_y, np.ones(len(y)), ridge=0.0)
        self._prior_theta[FEATURES.index("per_tree")] = max(self._prior_theta[-1], self.tree_prior_ms)
        self.theta = self._prior_theta.copy()
        self.prior_meta = {"key": getattr(table, "key", None), "path": (table.meta or {}).get("path")}
        self.version += 1
        return self

    # ---- the fit -------------------------------------------------------------------------------------
    def _solve(self, X: np.ndarray, y: np.ndarray, w: np.ndarray, ridge: float | None = None) -> np.ndarray:
        """Non-negative least squares on relative residuals ((x·θ - y) / y), weights ``w``, with Huber
        reweighting and a ridge toward the prior's θ."""
        ridge = self.ridge if ridge is None else ridge
        scale = np.maximum(y, 1e-3)
        A, b = X / scale[:, None], np.ones_like(y)
        col = np.maximum(np.abs(A).mean(0), 1e-9) if len(y) else np.ones(X.shape[1])
        huber = np.ones_like(y)
        theta = self._prior_theta.copy()
        for _ in range(3):
            rows, rhs, weights = [A], [b], [w * huber]
            if ridge > 0:  # pull each cost toward the prior's, in units of that cost's typical share of a step
                pull = math.sqrt(ridge) * np.diag(col)  # the ridge's weight is in these rows: they weigh 1
                rows.append(pull)
                rhs.append(pull.diagonal() * self._prior_theta)
                weights.append(np.ones(len(col)))
            theta = nonnegative_least_squares(np.vstack(rows), np.concatenate(rhs), np.concatenate(weights),
                                              maxiter=50 * X.shape[1])
            r = A @ theta - b
            s = 1.4826 * float(np.median(np.abs(r))) if len(r) else 0.0
            delta = 1.345 * max(s, 0.01)
            huber = np.minimum(1.0, delta / np.maximum(np.abs(r), 1e-12))
        return theta

    def refit(self) -> None:
        """Fit to the records (aged by ``forget``) and the prior's pseudo-records (``prior_weight`` in all)."""
        if not self.records:
            return
        X = np.array([x for x, _ in self.records])
        y = np.array([v for _, v in self.records])
        w = self.forget ** np.arange(len(y) - 1, -1, -1, dtype=float)
        # the prior counts as ``prior_weight`` records at first and fades as the engine's own accumulate
        fade = self.prior_weight / (self.prior_weight + self.seen) if self.prior_weight else 0.0
        if self._prior_y.size:
            X = np.vstack([X, self._prior_X])
            y = np.concatenate([y, self._prior_y])
            w = np.concatenate([w, np.full(self._prior_y.size, fade * self.prior_weight / self._prior_y.size)])
        self.theta = self._solve(X, y, w)
        self.version += 1

    @property
    def stretch(self) -> float:
        """Wall milliseconds per CPU millisecond of a step, lately (1.0 where CPU time is not given)."""
        return math.exp(self.log_stretch)

    def observe(self, shape: StepShape, ms: float, cpu_ms: float | None = None) -> float | None:
        """A timed step (wall ``ms``; ``cpu_ms`` its CPU time, where measured): returns the wall time the model
        predicted for it before seeing it (None before any fit or prior), then learns from it: the costs from
        the CPU time when given (else the wall time), the stretch from their ratio; it refits every
        ``refit_every`` records, half as often after 64."""
        x = shape.features()
        predicted = self.stretch * float(x @ self.theta) if self.version else None
        if self.frozen or not (ms > 0 and math.isfinite(ms)):
            return predicted
        y = float(ms)
        if cpu_ms is not None and cpu_ms > 0:
            ratio = min(max(ms / cpu_ms, 0.5), 50.0)
            self.log_stretch += 0.05 * (math.log(ratio) - self.log_stretch)
            y = float(cpu_ms)
        self.records.append((x, y))
        self.seen += 1
        if shape.rows:
            ctx = shape.keys / max(shape.scored, 1)
            self.context += 0.05 * (ctx - self.context)
        self._since += 1
        if self._since >= self.refit_every * (1 if self.seen <= 64 else 2) or self.version == 0:
            self._since = 0
            self.refit()
        return predicted

    def predict(self, shape: StepShape) -> float:
        """Wall milliseconds (the CPU-time costs times the stretch)."""
        return self.stretch * float(shape.features() @ self.theta)

    def predict_cpu(self, shape: StepShape) -> float:
        """The costs' own milliseconds: CPU time where the model learns from it."""
        return float(shape.features() @ self.theta)

    @property
    def costs(self) -> dict[str, float]:
        """Each cost in wall milliseconds (the stretch applied)."""
        return {name: self.stretch * float(v) for name, v in zip(FEATURES, self.theta)}

    # ---- read like a CostTable (what the policies, the oracle, replay and tuning call) -------------------
    def _theta(self, name: str) -> float:
        return self.stretch * float(self.theta[FEATURES.index(name)])

    def overhead_ms(self, R: int) -> float:
        """The step's fixed part: the fixed cost and the per-row bookkeeping."""
        return self._theta("fixed") + self._theta("per_row") * R

    def target_ms(self, R: int, N: float) -> float:
        """The target's verification of N tokens over R rows at the running context (its fixed part is in
        :meth:`overhead_ms`)."""
        per_row = N / max(R, 1)
        keys = attended_keys([self.context], [per_row]) * R
        return self._theta("per_token") * N + self._theta("per_key") * keys / KEY_UNIT

    def draft_ms(self, A: int, R: int | None = None) -> float:
        """One draft depth over A rows (0 rows: no forward)."""
        return 0.0 if A <= 0 else self._theta("per_draft_forward") + self._theta("per_draft_row") * A

    def feed_ms(self, R: int, tokens_per_row: float) -> float:
        """The drafter's catch-up forward over ``tokens_per_row`` tokens a row."""
        return self._theta("per_draft_forward") + self._theta("per_fed_token") * R * tokens_per_row

    def tree_ms(self) -> float:
        """What growing a tree adds to a step beyond its forwards (selection, packing, moving the path)."""
        return self._theta("per_tree")

    def step_ms(self, R: int, depth_rows, scored: float, fed_per_row: float) -> float:
        """One step of R rows (the formula of :meth:`~eagle_backbone.cost.CostTable.step_ms`)."""
        ms = self.overhead_ms(R) + self.target_ms(R, scored)
        depths = [int(a) for a in depth_rows if a > 0]
        if depths:
            ms += self.feed_ms(R, fed_per_row) + sum(self.draft_ms(a, R) for a in depths)
        return ms

    # ---- a fitted model as a file (costs measured in hindsight) ----------------------------------------
    def to_dict(self) -> dict:
        key = self.key if self.key is not None else (self.prior_meta or {}).get("key")
        return {"features": list(FEATURES), "theta": self.theta.tolist(), "stretch": self.stretch,
                "context": self.context, "records": self.seen, "forget": self.forget, "prior": self.prior_meta,
                "key": key}

    def save(self, path: str | Path) -> Path:
        atomic_write_json(path, self.to_dict())
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> OnlineCostModel:
        """A saved model, frozen (it predicts with the saved costs and never refits)."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable step cost model ({type(e).__name__}: {e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a step cost model is a JSON object (features, theta, stretch), got a "
                             f"{type(raw).__name__}")
        theta = raw.get("theta")
        if raw.get("features") != list(FEATURES) or not isinstance(theta, list) or len(theta) != len(FEATURES):
            raise ValueError(f"{path}: a step cost model needs features {list(FEATURES)} and one cost each (theta); "
                             f"got {raw.get('features')}")

        def number(key, value, low_ok):  # finite, and >= 0 (costs) or > 0 (the stretch, the context)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < 0 or (value == 0 and not low_ok):
                raise ValueError(f"{path}: {key} must be a finite number {'>= 0' if low_ok else '> 0'}, got {value!r}")
            return float(value)

        costs = [number(f"theta[{i}] ({name})", v, True) for i, (name, v) in enumerate(zip(FEATURES, theta))]
        m = cls(frozen=True, context=number("context", raw.get("context", 128.0), False))
        m.theta = np.array(costs, dtype=float)
        m.log_stretch = math.log(number("stretch", raw.get("stretch", 1.0), False))
        m.seen, m.prior_meta, m.version = int(raw.get("records", 0)), {"path": str(path)}, 1
        key = raw.get("key") or (raw.get("prior") or {}).get("key")
        if key is not None and not isinstance(key, dict):
            raise ValueError(f"{path}: key must be a mapping (the setup the costs were measured on), got {key!r}")
        m.key = key
        return m

    @classmethod
    def fit(cls, records: list[StepRecord], prior=None, **kw) -> OnlineCostModel:
        """A model fitted at once to ``records`` (no ageing): the costs measured in hindsight (to the CPU times
        where every record has one, the stretch their median ratio to the wall times)."""
        m = cls(prior, forget=1.0, window=max(8, len(records)), **kw)
        cpu = all(r.cpu_ms for r in records)
        for r in records:
            m.records.append((r.shape.features(), float(r.cpu_ms if cpu else r.ms)))
            m.seen += 1
        if cpu and records:
            m.log_stretch = float(np.median([math.log(max(r.ms / r.cpu_ms, 0.5)) for r in records]))
        m.refit()
        return m


def key_mismatch(fitted: dict | None, engine: dict | None) -> list[str]:
    """The fields on which a cost model's key (``fitted``) and this engine's (``engine``) disagree, as
    "field: fitted vs engine" (none when either key is unknown)."""
    if not fitted or not engine:
        return []
    return [f"{k}: {fitted[k]!r} vs {engine[k]!r}" for k in sorted(set(fitted) & set(engine)) if fitted[k] != engine[k]]
