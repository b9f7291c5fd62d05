"""Online recalibration of acceptance estimates from the acceptances observed while decoding.

An acceptance estimator fitted on one domain's labels is often over- or under-confident on another (its
thresholds then stop too early or too late). Every verification tells us, for each drafted position up to
the first rejection, whether the estimate's event happened: draft i kept (1) or rejected (0); positions
after the first rejection are not observed. Under sampling a kept draft is a Bernoulli draw with the true
acceptance probability as its mean, so these outcomes are unbiased targets at any temperature.

:class:`OnlineLogitCalibration` keeps a running logistic correction (Platt scaling fitted online):

    p' = sigmoid(w * logit(p) + c),   w = 1, c = 0 at the start (the estimator as it is)

updated after each verification by one step of gradient descent on the mean log-loss of the observed
outcomes. Everything stays on the device: no host read.
"""

from __future__ import annotations

import torch

EPS = 1e-6


def logit(p: torch.Tensor) -> torch.Tensor:
    p = p.float().clamp(EPS, 1 - EPS)
    return torch.log(p) - torch.log1p(-p)


class OnlineLogitCalibration:
    """p' = sigmoid(w * logit(p) + c), (w, c) fitted online by Newton steps on the log-loss of observed outcomes.

    Each update adds the observations' gradient and Hessian (2x2) to a running Hessian that forgets at
    rate ``decay`` per update (recent text weighs more) and starts at ``prior`` times the identity around
    (w, c) = (1, 0): a few dozen outcomes move the correction, and a burst of one outcome cannot run away.
    ``w`` stays in ``w_range``: 0 means the estimator carries no information (a constant rate); the
    correction never inverts its ranking."""

    def __init__(self, decay: float = 0.98, prior: float = 4.0, w_range: tuple[float, float] = (0.0, 4.0),
                 device=None):
        if not 0 < decay <= 1 or not prior > 0:
            raise ValueError(f"online calibration: need 0 < decay <= 1 and prior > 0, got {decay!r}, {prior!r}")
        lo, hi = w_range
        if not 0 <= lo <= 1 <= hi:
            raise ValueError(f"online calibration: w_range must satisfy 0 <= lo <= 1 <= hi, got {w_range!r}")
        self.decay, self.w_range = float(decay), (float(lo), float(hi))
        self.params = torch.tensor([1.0, 0.0], device=device)  # (w, c)
        self.hessian = prior * torch.eye(2, device=device)
        self.observations = torch.zeros((), device=device)  # count of outcomes seen (a device scalar)

    def to(self, device) -> OnlineLogitCalibration:
        self.params, self.hessian = self.params.to(device), self.hessian.to(device)
        self.observations = self.observations.to(device)
        return self

    def calibrate(self, p: torch.Tensor) -> torch.Tensor:
        """The corrected probabilities, same shape as ``p`` (float32)."""
        w, c = self.params[0], self.params[1]
        return torch.sigmoid(w * logit(p) + c)

    def update(self, p_est: torch.Tensor, kept: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """One Newton step on the observations: ``p_est`` the estimator's raw probabilities, ``kept`` 1/0
        outcomes (or soft ones), ``mask`` which entries were observed (default: all). Shapes broadcast."""
        z = logit(p_est).flatten()
        y = kept.float().flatten().expand_as(z)
        m = torch.ones_like(z) if mask is None else mask.float().flatten().expand_as(z)
        X = torch.stack([z, torch.ones_like(z)], 1)  # (n, 2)
        pr = torch.sigmoid(X @ self.params)
        grad = X.T @ ((pr - y) * m)
        self.hessian = self.decay * self.hessian + (X * (pr * (1 - pr) * m)[:, None]).T @ X
        new = self.params - torch.linalg.solve(self.hessian, grad)
        new[0] = new[0].clamp(*self.w_range)
        self.params = new
        self.observations = self.observations + m.sum()

    def state(self) -> dict:
        """(w, c) and the count of outcomes seen, as Python numbers (a host read: for reports only)."""
        w, c = self.params.tolist()
        return {"w": w, "c": c, "observations": int(self.observations)}
