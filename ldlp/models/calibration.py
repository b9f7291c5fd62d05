"""Online recalibration of acceptance estimates from the acceptances observed while decoding.

An acceptance estimator fitted on one domain's labels is often over- or under-confident on another (its
thresholds then stop too early or too late). Every verification tells us, for each drafted position up to
the first rejection, whether the estimate's event happened: draft i kept (1) or rejected (0); positions
after the first rejection are not observed. Under sampling a kept draft is a Bernoulli draw with the true
acceptance probability as its mean, so these outcomes are unbiased targets at any temperature.

:class:`OnlineLogitCalibration` keeps a running logistic correction (Platt scaling fitted online):

    p' = sigmoid(w * logit(p) + c),   w = 1, c = 0 at the start (the estimator as it is)

updated after each verification by one step of gradient descent on the mean log-loss of the observed
outcomes. Everything stays on the device: no host read. With ``evidence`` columns it also weighs what the
estimator did not see, ``p' = sigmoid(w * logit(p) + c + v · e)`` (``v`` starts at 0): the learned policy with
in-step evidence (``ldlp/policies/in_step.py``) corrects its predictor's hazards by the drafter's own confidence.
"""

from __future__ import annotations

import torch

EPS = 1e-6


def logit(p: torch.Tensor) -> torch.Tensor:
    p = p.float().clamp(EPS, 1 - EPS)
    return torch.log(p) - torch.log1p(-p)


def hazard_logits(S: torch.Tensor) -> torch.Tensor:
    """(R, K) float64 logits of the hazards P(draft m kept | drafts before it kept) of survival curves ``S`` (R, K),
    made non-increasing and kept off 0 and 1 first."""
    S = torch.cummin(S.double().clamp(EPS, 1.0), dim=1).values
    h = (S / torch.cat([torch.ones_like(S[:, :1]), S[:, :-1]], dim=1)).clamp(EPS, 1 - EPS)
    return torch.log(h) - torch.log1p(-h)


class OnlineLogitCalibration:
    """p' = sigmoid(w * logit(p) + c), (w, c) fitted online by Newton steps on the log-loss of observed outcomes.

    Each update adds the observations' gradient and Hessian (2x2) to a running Hessian that forgets at
    rate ``decay`` per update (recent text weighs more) and starts at ``prior`` times the identity around
    (w, c) = (1, 0): a few dozen outcomes move the correction, and a burst of one outcome cannot run away.
    ``w`` stays in ``w_range``: 0 means the estimator carries no information (a constant rate); the
    correction never inverts its ranking.

    ``groups`` > 1 keeps one independent (w, c) per group (e.g. a draft-tree node's rank among its siblings,
    whose acceptance follows its confidence differently); callers then pass each estimate's ``group``.
    ``evidence`` > 0 adds that many columns ``e`` with weights ``v`` (params ``(w, c, v...)``), started at
    ``start`` (the same layout; default ``(1, 0, 0...)``), where the prior's pull centres."""

    def __init__(self, decay: float = 0.98, prior: float = 4.0, w_range: tuple[float, float] = (0.0, 4.0),
                 device=None, groups: int = 1, evidence: int = 0, start=None):
        if not 0 < decay <= 1 or not prior > 0:
            raise ValueError(f"online calibration: need 0 < decay <= 1 and prior > 0, got {decay!r}, {prior!r}")
        lo, hi = w_range
        if not 0 <= lo <= 1 <= hi:
            raise ValueError(f"online calibration: w_range must satisfy 0 <= lo <= 1 <= hi, got {w_range!r}")
        if not isinstance(groups, int) or groups < 1:
            raise ValueError(f"online calibration: groups must be an integer >= 1, got {groups!r}")
        if not isinstance(evidence, int) or evidence < 0:
            raise ValueError(f"online calibration: evidence must be an integer >= 0, got {evidence!r}")
        n = 2 + evidence
        start = [1.0, 0.0] + [0.0] * evidence if start is None else [float(v) for v in start]
        if len(start) != n:
            raise ValueError(f"online calibration: start needs {n} values (w, c and {evidence} evidence weights), "
                             f"got {len(start)}")
        self.decay, self.w_range, self.groups, self.evidence = float(decay), (float(lo), float(hi)), groups, evidence
        self._params = torch.tensor([start] * groups, device=device)  # (G, 2 + E): (w, c, v...) per group
        self._hessian = prior * torch.eye(n, device=device).repeat(groups, 1, 1)  # (G, 2 + E, 2 + E)
        self.observations = torch.zeros((), device=device)  # count of outcomes seen (a device scalar)
        self.queued: tuple[list[float], list[float]] = ([], [])  # host outcomes :meth:`add` holds for the next step
        self.queued_evidence: list = []  # and their evidence rows

    @property
    def params(self) -> torch.Tensor:
        """(w, c, v...): (2 + E,) with one group, (G, 2 + E) with several."""
        return self._params[0] if self.groups == 1 else self._params

    @property
    def hessian(self) -> torch.Tensor:
        return self._hessian[0] if self.groups == 1 else self._hessian

    def to(self, device) -> OnlineLogitCalibration:
        self._params, self._hessian = self._params.to(device), self._hessian.to(device)
        self.observations = self.observations.to(device)
        return self

    def _wc(self, group):
        if group is None:
            return self._params[0, 0], self._params[0, 1]
        wc = self._params[group]  # (..., 2)
        return wc[..., 0], wc[..., 1]

    def calibrate(self, p: torch.Tensor, group: torch.Tensor | None = None) -> torch.Tensor:
        """The corrected probabilities, same shape as ``p`` (float32); ``group`` (long, p's shape) with groups. (The
        evidence columns' weights are in :attr:`params`; their one user combines them itself.)"""
        w, c = self._wc(group)
        return torch.sigmoid(w * logit(p) + c)

    def update(self, p_est: torch.Tensor, kept: torch.Tensor, mask: torch.Tensor | None = None,
               group: torch.Tensor | None = None, evidence: torch.Tensor | None = None) -> None:
        """One Newton step on the observations: ``p_est`` the estimator's raw probabilities, ``kept`` 1/0
        outcomes (or soft ones), ``mask`` which entries were observed (default: all), ``group`` each one's
        group (with groups), ``evidence`` (n, E) each one's evidence columns (with evidence). Shapes broadcast.
        Each group's step uses its own observations only."""
        z = logit(p_est).flatten()
        y = kept.float().flatten().expand_as(z)
        m = torch.ones_like(z) if mask is None else mask.float().flatten().expand_as(z)
        X = torch.stack([z, torch.ones_like(z)], 1)  # (n, 2)
        if self.evidence:
            X = torch.cat([X, evidence.to(X.dtype).reshape(len(z), self.evidence)], 1)  # (n, 2 + E)
        if group is None:
            g1 = torch.ones(z.shape[0], 1, device=z.device)  # every observation in group 0
            G = 1
        else:
            g1 = torch.nn.functional.one_hot(group.flatten().expand_as(z).long(), self.groups).float()  # (n, G)
            G = self.groups
        pr = torch.sigmoid((X[:, None, :] * self._params[None, :G]).sum(-1)).mul(g1).sum(1)  # own group's p'
        wgt = g1 * m[:, None]  # (n, G)
        grad = torch.einsum("ng,ni->gi", wgt * (pr - y)[:, None], X)  # (G, 2)
        curv = wgt * (pr * (1 - pr))[:, None]
        self._hessian = self.decay * self._hessian + torch.einsum("ng,ni,nj->gij", curv, X, X)
        new = self._params - torch.linalg.solve(self._hessian, grad[..., None])[..., 0]
        new[:, 0] = new[:, 0].clamp(*self.w_range)
        self._params = new
        self.observations = self.observations + m.sum()

    def add(self, p_est: list[float], kept: list[float], every: int, dtype: torch.dtype = torch.float32,
            evidence: list | None = None) -> bool:
        """Queue raw probabilities and their outcomes (and evidence rows, with evidence) as host floats; once
        ``every`` are queued, one Newton step on them (:meth:`update`, in ``dtype``): a decoding loop steps the
        fit per batch of outcomes, not per decoding step. True when it stepped (the caller's copy of the
        parameters is then stale)."""
        self.queued[0].extend(p_est)
        self.queued[1].extend(kept)
        if self.evidence:
            self.queued_evidence.extend(evidence)
        if len(self.queued[0]) < every:
            return False
        dev = self._params.device
        e = torch.tensor(self.queued_evidence, dtype=dtype, device=dev) if self.evidence else None
        self.update(torch.tensor(self.queued[0], dtype=dtype, device=dev), torch.tensor(self.queued[1], device=dev),
                    evidence=e)
        self.queued, self.queued_evidence = ([], []), []
        return True

    def state(self) -> dict:
        """(w, c) and the count of outcomes seen, as Python numbers (a host read: for reports only); with
        groups, lists of w and c by group."""
        if self.groups == 1:
            w, c = self._params[0, :2].tolist()
        else:
            w, c = self._params[:, 0].tolist(), self._params[:, 1].tolist()
        v = {"v": self._params[0, 2:].tolist() if self.groups == 1 else self._params[:, 2:].tolist()} \
            if self.evidence else {}
        return {"w": w, "c": c, **v, "observations": int(self.observations)}
