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
    """p' = sigmoid(w * logit(p) + c), (w, c) fitted online by SGD on the log-loss of observed outcomes.

    ``lr``: step size of one update (on the mean gradient of a verification's observations); ``w_range``
    bounds the slope so that a burst of one outcome cannot flip the estimator's ranking."""

    def __init__(self, lr: float = 0.05, w_range: tuple[float, float] = (0.25, 4.0), device=None):
        if not lr > 0:
            raise ValueError(f"online calibration: lr must be > 0, got {lr!r}")
        lo, hi = w_range
        if not 0 < lo <= 1 <= hi:
            raise ValueError(f"online calibration: w_range must satisfy 0 < lo <= 1 <= hi, got {w_range!r}")
        self.lr, self.w_range = float(lr), (float(lo), float(hi))
        self.params = torch.tensor([1.0, 0.0], device=device)  # (w, c)
        self.observations = torch.zeros((), device=device)  # count of outcomes seen (a device scalar)

    def to(self, device) -> OnlineLogitCalibration:
        self.params = self.params.to(device)
        self.observations = self.observations.to(device)
        return self

    def calibrate(self, p: torch.Tensor) -> torch.Tensor:
        """The corrected probabilities, same shape as ``p`` (float32)."""
        w, c = self.params[0], self.params[1]
        return torch.sigmoid(w * logit(p) + c)

    def update(self, p_est: torch.Tensor, kept: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """One SGD step on the observations: ``p_est`` the estimator's raw probabilities, ``kept`` 1/0
        outcomes, ``mask`` which entries were observed (default: all). Shapes broadcast together."""
        z = logit(p_est)
        y = kept.float()
        m = torch.ones_like(z) if mask is None else mask.float()
        n = m.sum()
        w, c = self.params[0], self.params[1]
        err = (torch.sigmoid(w * z + c) - y) * m  # d(log-loss)/d(logit')
        denom = n.clamp_min(1.0)
        grad = torch.stack([(err * z).sum() / denom, err.sum() / denom])
        new = self.params - self.lr * grad
        new[0] = new[0].clamp(*self.w_range)
        self.params = new
        self.observations = self.observations + n

    def state(self) -> dict:
        """(w, c) and the count of outcomes seen, as Python numbers (a host read: for reports only)."""
        w, c = self.params.tolist()
        return {"w": w, "c": c, "observations": int(self.observations)}
