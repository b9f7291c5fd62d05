"""How good is a draft-length predictor? Metrics on integer γ, and scikit-learn baselines on the same split.

Every predictor here, the LDLP and the baselines alike, outputs an integer γ in 0..k_max for each
validation position; the label y is how many of k_max greedy drafts the target accepted there. So
drafting γ tokens at that position would have accepted min(γ, y) of them and thrown away max(γ - y, 0).

Baselines, fitted on (a seeded subsample of) the training rows' [e; f] features:

* ``constant``  the median training label, everywhere;
* ``linear``    ridge regression on standardised features, rounded and clamped;
* ``logistic``  multinomial logistic regression over 0..k_max;
* ``hgb``       HistGradientBoostingRegressor with the pinball loss at quantile λ / (1 + λ), which is
                exactly what the asymmetric L1 loss of the regression head estimates; rounded and clamped.
"""

from __future__ import annotations

import numpy as np

from eagle_backbone.runtime import Clock

BASELINES = ("constant", "linear", "logistic", "hgb")


def length_metrics(pred: np.ndarray, label: np.ndarray, under_weight: float) -> dict:
    """How integer predictions ``pred`` fare against labels ``label``: mean error, exact and near hits, drafts
    accepted and wasted per step, the asymmetric L1 loss (their legend: ``ldlp.report.training.METRIC_DOCS``)."""
    pred, label = np.asarray(pred, dtype=np.int64), np.asarray(label, dtype=np.int64)
    if pred.shape != label.shape or pred.ndim != 1 or len(pred) == 0:
        raise ValueError(f"length_metrics: need two equal, non-empty 1-D arrays, got {pred.shape} and {label.shape}")
    err = pred - label
    wrong = err != 0
    return {
        "mae": float(np.abs(err).mean()),
        "acc": float((~wrong).mean()),
        "within1": float((np.abs(err) <= 1).mean()),
        "under": float((err < 0).mean()),
        "wrong_label_mean": float(label[wrong].mean()) if wrong.any() else float("nan"),
        "mean_gamma": float(pred.mean()),
        "accepted": float(np.minimum(pred, label).mean()),
        "wasted": float(np.maximum(err, 0).mean()),
        "asym_l1": float(np.where(err < 0, -under_weight * err, err).mean()),
    }


def _to_length(values: np.ndarray, k_max: int) -> np.ndarray:
    return np.clip(np.rint(values), 0, k_max).astype(np.int64)


def fit_baseline(name: str, x: np.ndarray, y: np.ndarray, k_max: int, under_weight: float, seed: int = 0):
    """Fit baseline ``name`` and return a function features -> integer γ."""
    from sklearn.ensemble import HistGradientBoostingRegressor
    from sklearn.linear_model import LogisticRegression, Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if name == "constant":
        value = int(np.median(y))
        return lambda xs: np.full(len(xs), value, dtype=np.int64)
    if name == "linear":
        model = make_pipeline(StandardScaler(), Ridge(alpha=1.0)).fit(x, y)
        return lambda xs: _to_length(model.predict(xs), k_max)
    if name == "logistic":
        if len(np.unique(y)) < 2:
            value = int(y[0])
            return lambda xs: np.full(len(xs), value, dtype=np.int64)
        model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=3000)).fit(x, y)
        return lambda xs: model.predict(xs).astype(np.int64)
    if name == "hgb":
        q = under_weight / (1.0 + under_weight)
        model = HistGradientBoostingRegressor(loss="quantile", quantile=q, max_iter=100, random_state=seed).fit(x, y)
        return lambda xs: _to_length(model.predict(xs), k_max)
    raise ValueError(f"unknown baseline {name!r}; choose from {BASELINES}")


def evaluate_all(ldlp_pred: np.ndarray, ldlp_name: str, x_train: np.ndarray, y_train: np.ndarray,
                 x_val: np.ndarray, y_val: np.ndarray, k_max: int, under_weight: float,
                 baselines: list[str] = BASELINES, max_fit_rows: int | None = 20000, seed: int = 0,
                 seconds: dict | None = None) -> dict:
    """{predictor name: metrics} for the LDLP's predictions and each baseline, all on the validation rows
    (``seconds``, when given, receives each baseline's fit + predict time)."""
    clock = Clock()
    results = {ldlp_name: length_metrics(ldlp_pred, y_val, under_weight)}
    if max_fit_rows is not None and len(y_train) > max_fit_rows:
        keep = np.random.default_rng(seed).choice(len(y_train), max_fit_rows, replace=False)
        x_train, y_train = x_train[keep], y_train[keep]
    for name in baselines:
        start = clock()
        predict = fit_baseline(name, x_train, y_train, k_max, under_weight, seed)
        results[name] = length_metrics(predict(x_val), y_val, under_weight)
        if seconds is not None:
            seconds[name] = clock() - start
    return results
