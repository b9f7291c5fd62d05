"""A draft length chosen by expected gain against cost, from a predictor of how many drafts the target keeps.

The predictor reads :func:`~ldlp.models.features.step_features` (the feature groups, computed on the device for
all rows at once, the same function in replay and in the engine).

:func:`gamma_by_cost` is the decision rule, no tuned threshold: with ``S_m`` the predicted chance that the first m
drafts are all kept, drafting k tokens emits ``1 + S_1 + ... + S_k`` tokens on average and costs the step's
expected seconds; it picks the k that maximises tokens minus seconds divided by the seconds a token is worth
(``token_s``: the policy's own seconds per emitted token, Dinkelbach's fixed point for the best ratio of tokens to
seconds). For survival curves that fall with m and costs linear in k this is the per-token rule "draft token m
only while S_m × (token_s − the seconds an accepted token adds) exceeds the seconds a drafted token costs"
(``tests/test_predictor_features.py`` checks both against brute force).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from scipy.special import expit

from eagle_backbone.policy import GO, Depth, DraftPolicy, EngineView, Rows, int_at_least
from eagle_backbone.runtime import to_device
from ldlp.models.calibration import OnlineLogitCalibration, logit
from ldlp.models.features import DRAFT_PREV_DEPTHS, GROUPS, step_features


def expected_gain(survival, seconds, token_s: float, terms=None, monotone: bool = False) -> torch.Tensor:
    """(R, K+1) float64 (or (K+1,) for one row): per γ = 0..K, expected emitted tokens minus expected step seconds
    over ``token_s``. ``survival`` (R, K): S_m = P(the first m drafts are all kept); ``seconds`` (≥ K+1, ≥ K+1):
    ``seconds[k, a]`` a step drafting k tokens of which a are kept (a ≤ k); ``terms``: its :func:`_step_terms`,
    precomputed (the policy keeps them per price); ``monotone``: the curve already falls with m within [0, 1] (an
    LDLP's distribution head), so it is not made so here."""
    S = torch.as_tensor(survival, dtype=torch.float64)
    one = S.dim() == 1
    S = S[None] if one else S
    K = S.shape[1]
    W, c = terms if terms is not None else _step_terms(torch.as_tensor(seconds, dtype=torch.float64,
                                                                       device=S.device), K)
    if not monotone:
        S = torch.cummin(S.clamp(0.0, 1.0), dim=1).values  # a survival curve cannot rise
    both = torch.addmm(c, S, W)  # (R, 2(K+1)): expected tokens, then expected seconds, per γ = 0..K
    gain = both[:, : K + 1] - both[:, K + 1:] / token_s
    return gain[0] if one else gain


def _step_terms(seconds: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W, c)``, (K, 2(K+1)) and (2(K+1),): expected tokens and seconds per γ = 0..K are linear in the survival
    curve, ``[tokens | seconds] = S @ W + c`` (one product a decision: a step's policy time is a handful of ops).

    With S_0 = 1: tokens_k = 1 + S_1 + ... + S_k, and seconds_k = Σ_{a<k} (S_a − S_{a+1}) seconds[k, a] +
    S_k seconds[k, k], so S_j (j ≤ k) weighs seconds[k, j] − seconds[k, j − 1] and the constant is seconds[k, 0]."""
    M = seconds[: K + 1, : K + 1].to(torch.float64)
    kept = torch.ones(K, K + 1, dtype=M.dtype, device=M.device).triu(1)  # S_m counts in tokens_k when m ≤ k
    steps = torch.tril(M[:, 1:] - M[:, :-1], -1).T  # [j - 1, k]: seconds[k, j] - seconds[k, j - 1] for j ≤ k
    W = torch.cat([kept, steps], dim=1).contiguous()
    c = torch.cat([torch.ones(K + 1, dtype=M.dtype, device=M.device), M[:, 0]])
    return W, c


def gamma_by_cost(survival, seconds, token_s: float, max_gamma: int | None = None, terms=None,
                  monotone: bool = False):
    """The draft length with the largest :func:`expected_gain` (the shortest among equals), at most ``max_gamma``:
    an int for one survival curve, an (R,) int64 tensor for a batch."""
    gain = expected_gain(survival, seconds, token_s, terms, monotone)
    if max_gamma is not None:
        gain = gain[..., : max_gamma + 1]
    g = torch.argmax(gain, dim=-1)  # the first of equal maxima
    return int(g) if g.dim() == 0 else g


def batch_cap(S: torch.Tensor, gammas: torch.Tensor | None, tables, fixed_ms: float, feed_ms: float,
              token_s: float) -> torch.Tensor:
    """(R,) the rows' γ capped at the one batch-wide depth G that maximises the step's expected tokens minus its
    seconds over ``token_s``, priced by the step-cost model itself: under load a row that drafts deeper than the
    others pays a drafter pass of its own at every extra depth, which a row's share of the step does not see.

    ``S`` (R, K) survival curves, ``gammas`` (R,) each row's own choice (None: every row drafts G, one depth for
    the step), ``tables`` the costs' device lookups at R rows (:class:`~ldlp.policies.pricing.StepTables`),
    ``fixed_ms`` a step's overhead and ``feed_ms`` the drafter's catch-up (paid when any row drafts). Every
    candidate G at once, on the device: no host read."""
    R, K = S.shape
    G = torch.arange(K + 1, device=S.device)
    own = torch.full((R,), K, device=S.device) if gammas is None else gammas
    capped = torch.minimum(own[None, :], G[:, None])  # (K+1, R)
    kept = torch.cat([torch.zeros_like(S[:, :1]), S.cumsum(1)], 1)  # (R, K+1): expected kept drafts by γ
    tokens = R + kept.T.gather(0, capped).sum(1)  # (K+1,)
    scored = (capped + 1).sum(1)
    depth = torch.arange(1, K + 1, device=S.device)
    drafting = (capped[:, None, :] >= depth[None, :, None]).sum(2)  # (K+1, K): rows drafting at each depth
    ms = fixed_ms + tables.target[scored] + torch.where(drafting > 0, tables.draft[drafting], 0.0).sum(1)
    ms = ms + torch.where(capped.amax(1) > 0, feed_ms, 0.0)
    best = torch.argmax(tokens - ms / 1e3 / token_s)
    return capped[best]


class CpuDecider:
    """An LDLP's cost-rule decision for one row in numpy (:meth:`LearnedPolicy._one_row_cpu`): the network as
    :class:`~ldlp.models.predictor.NumpyLDLP` and the rule's linear terms (:func:`_step_terms`)."""

    def __init__(self, ldlp):
        self.ldlp, self.net = ldlp, ldlp.numpy_decoder()
        self._terms = None

    def gamma(self, terms: tuple, token_s: float, cap: int, wc: tuple[float, float] = (1.0, 0.0),
              **inputs) -> tuple[int, np.ndarray]:
        """γ and the head's raw hazard logits (for :class:`HazardCalibration`); ``terms``: :func:`_step_terms`
        (torch, on the CPU; their numpy views kept while they stand); ``wc``: the online correction."""
        if self._terms is None or self._terms[0] is not terms:
            self._terms = (terms, terms[0].numpy(), terms[1].numpy())
        _, W, c = self._terms
        K = W.shape[0]
        z = self.net.output(**inputs)[:K]
        S = np.exp(np.cumsum(-np.logaddexp(0.0, -(wc[0] * z + wc[1]))))  # Π sigmoid of the corrected logits
        both = S @ W + c
        gain = both[: K + 1] - both[K + 1:] / token_s
        return int(np.argmax(gain[: cap + 1])), z


class HazardCalibration:
    """Online Platt correction of a survival head's hazards, learnt from the accepted lengths the policy sees.

    A distribution head predicts, per depth m, the hazard logit z_m of P(draft m kept | drafts 1..m-1 kept). Off the
    labels' conditions (sampling at T > 0, where a draft is kept with probability min(1, p/q) and the head learnt
    greedy agreement; another domain) the level and the spread of those logits are wrong. Each verified step says,
    for every drafted depth up to the first rejection, whether the event happened, an unbiased target at any
    temperature; :class:`~ldlp.models.calibration.OnlineLogitCalibration` fits sigmoid(w·z + c) to them. Where the
    head carries no information w falls towards 0 and the policy drafts the running rate's best uniform γ; where it
    is right (w, c) stay near (1, 0).

    The hazards of each plan wait per slot until the step they decided is observed: a policy that plans ahead has
    planned the next step by then, so each slot keeps a short queue."""

    def __init__(self, decay: float = 0.98, prior: float = 4.0, update_every: int = 32, start=(1.0, 0.0)):
        self.fit = OnlineLogitCalibration(decay=decay, prior=prior, start=start)
        self.update_every = int(update_every)
        self.wc = tuple(float(v) for v in start)
        self.outcomes = 0  # observed depths so far (the fit has taken those of its completed batches)
        self._planned: dict[int, list[np.ndarray]] = {}  # slot -> hazard logits of its plans not yet observed

    def reset(self, slot: int) -> None:
        self._planned.pop(slot, None)

    def planned(self, slot: int, z: np.ndarray) -> None:
        self._planned.setdefault(slot, []).append(z)

    def observed(self, slot: int, drafted: int, accepted: int) -> None:
        queue = self._planned.get(slot)
        if not queue:
            return
        z = queue.pop(0)
        reached = min(drafted, accepted + 1, len(z))  # depths reached: kept up to accepted, then one rejection
        kept = min(accepted, reached)
        self.outcomes += reached
        if self.fit.add(expit(z[:reached]).tolist(), [1.0] * kept + [0.0] * (reached - kept), self.update_every,
                        torch.float64):
            self.wc = tuple(float(v) for v in self.fit.params.numpy())  # the fit lives on the host: no device read

    def state(self) -> dict:
        return {**self.fit.state(), "outcomes": self.outcomes}


def step_seconds(costs, drafted: int, accepted: int, rows: int = 1) -> float:
    """Seconds of one batch-1 step, read from the cost table at one slot (replay prices its steps so, and the learned
    policy its choices): :meth:`~eagle_backbone.cost.CostTable.step_ms` with ``drafted`` draft depths,
    ``drafted + 1`` tokens scored and the drafter's catch-up over ``accepted + 1`` tokens (this step's emitted
    tokens: the engine feeds them at the next step, so a sequence's total is the same). With ``rows`` > 1: a row's
    share of a step of that many rows that all draft and keep alike (the learned policy's price at that load)."""
    R = int(rows)
    return costs.step_ms(R, [R] * drafted, R * (drafted + 1), accepted + 1) / 1e3 / R


def step_seconds_table(costs, k_max: int, rows: int = 1) -> np.ndarray:
    """(k_max+1, k_max+1) seconds of a row's step drafting k and keeping a, in a batch of ``rows``
    (:func:`step_seconds`)."""
    t = np.zeros((k_max + 1, k_max + 1))
    for k in range(k_max + 1):
        for a in range(k + 1):
            t[k, a] = step_seconds(costs, k, a, rows)
    return t


class LearnedPolicy(DraftPolicy):
    """γ by :func:`gamma_by_cost` (``rule="cost"``) or the predicted median length (``rule="median"``, AdaEAGLE's
    use of a predicted length) from a predictor's survival curve over :func:`step_features`.

    It plans ahead: right after verification, on the device, from the step just verified (its accept counts and
    the drafter's top-1 probabilities, not yet read), so its γ rides in the step's one host read. Replay drives
    the same object one row at a time (:class:`~ldlp.bench.harness.replay.OneSequence`).

    Deployed (``path``: an LDLP folder whose ``inputs`` name its feature groups, ``policy=learned``) it prices steps
    by the engine's step-cost model (:class:`~ldlp.policies.pricing.StepPricing`, as the load-aware policies) at the
    step's load (R rows: a row's share of a step in which every row drafts and keeps alike, so that under load a
    draft costs its marginal share of a batched pass) and learns the seconds a token is worth while decoding: the
    EMA of its modelled seconds over its emitted tokens, started at ``token_ratio`` × a plain step. Under load
    ``batch`` turns the rows' choices into the step's (:func:`batch_cap`). In the study (``predictor``: any object
    with ``survival(x)``) the step seconds and ``token_s`` are given. ``record`` (a list) receives every feature
    vector; ``fixed`` makes it a static-γ behaviour policy that only records."""

    name = "learned"
    reads_drafts = True
    plans_ahead = True
    RULES = ("cost", "median")
    BATCH = ("uniform", "cap", "rows")  # under load: one depth for the step, the rows' γ capped at it, their own
    EMA = 0.05  # weight of a step in the online seconds-per-token estimate

    def __init__(self, path: str | None = None, max_gamma: int = 8, rule: str = "cost", token_ratio: float | None = None,
                 pricing=None, recalibrate: bool | None = None, batch: str = "uniform", *, predictor=None, groups=None,
                 seconds=None, token_s: float | None = None, record: list | None = None, fixed: int | None = None):
        from ldlp.policies.pricing import StepPricing

        if rule not in self.RULES:
            raise ValueError(f"learned policy: rule must be one of {list(self.RULES)}, got {rule!r}")
        self.rule, self.max_gamma = rule, int_at_least(self.name, "max_gamma", max_gamma, 0)
        if recalibrate is not None and not isinstance(recalibrate, bool):
            raise ValueError(f"learned policy: recalibrate must be true, false or null (when sampling), got {recalibrate!r}")
        self.recalibrate = recalibrate
        if batch not in self.BATCH:
            raise ValueError(f"learned policy: batch must be one of {list(self.BATCH)}, got {batch!r}")
        self.batch = batch
        self.calibration = HazardCalibration() if recalibrate else None
        self.record, self.fixed = record, fixed
        if path is not None:
            if not (Path(path) / "config.json").is_file():
                raise ValueError(f"learned policy: path={path} has no config.json; build the predictor first "
                                 "(python scripts/train_step_ldlp.py)")
            predictor = _load_ldlp(str(path))
            if predictor.config.head != "distribution":
                raise ValueError(f"learned policy: {path} has a {predictor.config.head} head; it needs the "
                                 "distribution head (python scripts/train_step_ldlp.py trains one)")
            groups = predictor.config.inputs
            meta = predictor.config.meta or {}
            token_ratio = meta.get("token_ratio") if token_ratio is None else token_ratio
            self.needs_costs = True
            self.pricing = StepPricing.of(self.name, pricing)  # its ``pricing`` node: the cost table and the costs
        elif predictor is None and fixed is None:
            raise ValueError("learned policy: give path (a predictor folder) or a predictor")
        self.path, self.predictor = path, predictor
        self.groups = tuple(groups or GROUPS)
        # the drafter's distributions are read only for the group that needs them (a read each depth costs time)
        self.reads_drafts = "draft_prev" in self.groups
        self._seconds = None if seconds is None else np.asarray(seconds)
        self.token_s = token_s  # fixed (the study); None: learned online
        self.token_ratio = float(token_ratio) if token_ratio is not None else 0.4
        self._ema: tuple[float, float] | None = None  # (seconds, tokens) of the online estimate
        self._priced: dict = {}  # rows -> (the costs' identity and version, their seconds table at that load)
        self._rows = 1  # the load (rows) of the step being planned or observed
        self._device_terms = None
        self._cpu: CpuDecider | None = None  # the one-row numpy path (_one_row_cpu), per predictor weights
        self._depths: list[tuple[int, list[int], torch.Tensor]] = []  # this step's (depth, rows, top-1s), on the device

    # ---- prices ----
    def bind(self, view: EngineView) -> None:
        config, target = getattr(self.predictor, "config", None), view.target
        if config is not None and getattr(target, "hidden_size", config.feature_dim) != config.feature_dim:
            raise ValueError(f"learned policy: {self.path} reads features of size {config.feature_dim} but this "
                             f"target's have size {target.hidden_size}: it was built for another target")
        if self.recalibrate is None:  # null: only off the labels' conditions (greedy labels, a sampling engine)
            if view.greedy:
                self.calibration = None
            elif self.calibration is None:
                self.calibration = HazardCalibration()
        if self.pricing is not None:
            self.pricing.bind(view)

    def seconds(self) -> np.ndarray:
        """The seconds table at the current load (``_rows``); given (the study), the same at every load."""
        if self._seconds is not None:
            return self._seconds
        costs = self.pricing.costs
        key = (id(costs), getattr(costs, "version", 0))  # an online model refits: a new version, new prices
        priced = self._priced.get(self._rows)
        if priced is None or priced[0] != key:
            self._priced[self._rows] = priced = (key, step_seconds_table(costs, self.max_gamma, self._rows))
        return priced[1]

    def _terms(self, K: int, device) -> tuple:
        """The seconds table on the device and its :func:`_step_terms`, kept while the prices stand."""
        seconds = self.seconds()
        cached = self._device_terms
        if cached is None or cached[0] is not seconds or cached[1] != (K, str(device)):
            t = torch.as_tensor(seconds, dtype=torch.float64, device=device)
            self._device_terms = cached = (seconds, (K, str(device)), t, _step_terms(t, K))
        return cached[2], cached[3]

    def token_seconds(self) -> float:
        if self.token_s is not None:
            return self.token_s
        if self._ema is None:
            return self.token_ratio * float(self.seconds()[0, 0])
        return self._ema[0] / self._ema[1]

    # ---- the protocol ----
    def _draft_prev(self, R: int, device) -> torch.Tensor:
        """(R, DRAFT_PREV_DEPTHS) the drafter's top-1s of the step just verified (-1 where it did not draft)."""
        out = torch.full((R, DRAFT_PREV_DEPTHS), -1.0, device=device)
        for depth, at, top1 in self._depths:
            out[to_device(at, device), depth - 1] = top1.float()
        return out

    def begin(self, slot: int, prompt_ids: list[int], max_new_tokens: int | None = None) -> None:
        self._depths = []  # replay's last step of the previous sequence (the engine's plan ahead has used its own)
        if self.calibration is not None:
            self.calibration.reset(slot)

    def plan(self, rows: Rows) -> torch.Tensor | list[int]:
        self._rows = len(rows)
        device = rows.features.device
        one_cpu = (len(rows) == 1 and device.type == "cpu" and self.rule == "cost" and self.fixed is None
                   and self.record is None and hasattr(self.predictor, "survival_tensor")
                   and getattr(getattr(self.predictor, "config", None), "head", None) == "distribution")
        if one_cpu and self.groups == ("ef",):  # [e; f] alone: no feature vector to build
            return [self._one_row_cpu(rows)]
        x = step_features(rows, self.groups, self._draft_prev(len(rows), device) if "draft_prev" in self.groups else None)
        self._depths = []  # used: a step that drafts nothing leaves none for the next plan
        if self.record is not None:
            self.record.extend(x.cpu().numpy())
        cap = self.max_gamma
        if self.fixed is not None:
            return torch.full((len(rows),), min(self.fixed, cap), dtype=torch.long, device=device)
        if one_cpu:
            return [self._one_row_cpu(rows, x[0])]
        monotone = hasattr(self.predictor, "survival_tensor")  # an LDLP's curve falls with m by construction
        if monotone:
            S = self.predictor.survival_tensor(x)
        else:  # a study model (numpy)
            S = torch.as_tensor(self.predictor.survival(x.cpu().numpy()), device=device)
        if self.calibration is not None:
            S = self._recalibrated(rows, S)
        if self.rule == "median":
            return (S >= 0.5).sum(-1).clamp(max=cap).long()
        K = min(S.shape[1], self.seconds().shape[0] - 1)
        table, terms = self._terms(K, device)
        gammas = gamma_by_cost(S[:, :K], table, self.token_seconds(), cap, terms, monotone).reshape(-1)
        if len(rows) == 1 or self.pricing is None or self.batch == "rows":  # batch 1, the study, the ablation
            return gammas
        from ldlp.policies.pricing import StepTables

        costs, R = self.pricing.costs, len(rows)
        fed = self._ema[1] if self._ema else 1.0  # the drafter's catch-up: a row's emitted tokens a step (its EMA)
        return batch_cap(S[:, :K].double(), gammas if self.batch == "cap" else None, StepTables.of(costs, R, device),
                         costs.overhead_ms(R), costs.feed_ms(R, fed), self.token_seconds())

    def _recalibrated(self, rows: Rows, S: torch.Tensor) -> torch.Tensor:
        """The survival curves with :class:`HazardCalibration`'s correction; each row's raw hazard logits queued."""
        S = torch.cummin(S.double().clamp(1e-12, 1.0), dim=1).values
        h = S / torch.cat([torch.ones_like(S[:, :1]), S[:, :-1]], dim=1)
        z = logit(h).double()
        for slot, row in zip(rows.slots, z.cpu().numpy()):
            self.calibration.planned(slot, row)
        w, c = self.calibration.wc
        return torch.cumprod(torch.sigmoid(w * z + c), dim=1)

    def _decider(self) -> CpuDecider:
        """The predictor in numpy for one row on a CPU: a snapshot of the weights (checking their versions every step
        costs 30 µs): a policy's predictor is frozen while it decides; a changed predictor is a new policy (or
        predictor attribute)."""
        if self._cpu is None or self._cpu.ldlp is not self.predictor:
            self._cpu = CpuDecider(self.predictor)
        return self._cpu

    def _one_row_cpu(self, rows: Rows, x: torch.Tensor | None = None) -> int:
        """γ of one row on a CPU, in numpy: the same network and rule, but right after the target's forward the
        caches are cold and each torch op pays its dispatch (about 10 µs), so the torch path cost ~400 µs a step
        (3% of a step here); with the first layer's [e] part kept per token, this costs about half of that."""
        decider = self._decider()
        K = min(self.predictor.config.k_max, self.seconds().shape[0] - 1)
        terms = self._terms(K, torch.device("cpu"))[1]
        inputs = decider.net.ef_inputs(rows) if x is None else {"x": x}  # x None: [e; f] alone
        cal = self.calibration
        g, z = decider.gamma(terms, self.token_seconds(), self.max_gamma, (1.0, 0.0) if cal is None else cal.wc,
                               **inputs)
        if cal is not None:
            cal.planned(rows.slots[0], z)
        return g

    def stop(self, d: Depth) -> torch.Tensor:
        if d.depth <= DRAFT_PREV_DEPTHS:
            self._depths.append((d.depth, list(d.rows), d.probs.max(-1).values))
        return torch.full_like(d.tokens, GO)

    def report(self) -> dict:
        return {} if self.calibration is None else {"recalibration": self.calibration.state()}

    def observe(self, rows: Rows, drafted: list[int], accepted: list[int], extra: dict | None = None) -> None:
        if self.calibration is not None:
            for slot, d, a in zip(rows.slots, drafted, accepted):
                self.calibration.observed(slot, d, a)
        if self.token_s is not None or self.fixed is not None:
            return  # a fixed token worth, or a recorder: nothing to learn
        self._rows = len(rows)
        seconds = self.seconds()
        for d, a in zip(drafted, accepted):  # the seconds a token is worth: this policy's own, as it decodes
            s, n = float(seconds[min(d, len(seconds) - 1), min(a, d, len(seconds) - 1)]), a + 1
            if self._ema is None:
                self._ema = (self.token_seconds() * n, float(n))
            self._ema = ((1 - self.EMA) * self._ema[0] + self.EMA * s, (1 - self.EMA) * self._ema[1] + self.EMA * n)


def adopt_calibration(policy, held: HazardCalibration | None) -> HazardCalibration | None:
    """Give ``policy`` (a learned policy that recalibrates) the correction another instance of it has been fitting
    (a benchmark builds a policy per run; a server keeps one): returns the correction it now holds, or None for a
    policy without one. Plans still waiting are the old run's: dropped."""
    own = getattr(policy, "calibration", None)
    if own is None or not isinstance(policy, LearnedPolicy):
        return None
    if held is not None and held is not own:
        held._planned.clear()
        policy.calibration = held
    return policy.calibration


def _load_ldlp(path: str):
    from ldlp.policies.threshold import load_ldlp

    return load_ldlp(path)
