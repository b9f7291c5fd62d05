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

from pathlib import Path

import numpy as np

from eagle_backbone.io import atomic_write_json, atomic_write_text
from eagle_backbone.runtime import Clock

BASELINES = ("constant", "linear", "logistic", "hgb")

METRIC_DOCS = {
    "mae": "mean |γ - y|",
    "acc": "fraction with γ = y",
    "within1": "fraction with |γ - y| <= 1",
    "under": "fraction with γ < y (under-prediction: a target pass spent on tokens the drafter had right)",
    "wrong_label_mean": "mean label y of the positions with γ != y",
    "mean_gamma": "mean γ",
    "accepted": "mean min(γ, y): drafts that would be accepted per step",
    "wasted": "mean max(γ - y, 0): drafts that would be thrown away per step",
    "asym_l1": "the asymmetric L1 loss (λ on under-prediction) of the integer γ",
}


def length_metrics(pred: np.ndarray, label: np.ndarray, under_weight: float) -> dict:
    """The metrics of ``METRIC_DOCS`` for integer predictions ``pred`` against labels ``label``."""
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


def ldlp_metrics_markdown(summary: dict) -> str:
    results = summary["results"]
    cols = list(next(iter(results.values())).keys())
    lines = [f"# LDLP validation metrics ({summary['head']} head)", "",
             f"{summary['val_rows']} validation positions (split by conversation), {summary['train_rows']} training "
             f"positions (baselines fitted on {summary.get('baseline_fit_rows', summary['train_rows'])}); "
             f"k_max = {summary['k_max']}, λ = {summary['under_weight']}.", "",
             "| predictor | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, m in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{m[c]:.3f}" for c in cols) + " |")
    lines += ["", *(f"- **{c}**: {METRIC_DOCS[c]}" for c in cols)]
    t = summary.get("timing")
    if t:
        lines += ["", f"Forward time (batch 1, {t['device']}): LDLP {t['ldlp_us']:.1f} µs vs. one target decoding "
                      f"step at context {t['context_len']} {t['target_step_ms']:.2f} ms: "
                      f"{100 * t['ratio']:.2f}% of a step (medians over {t.get('reps', '?')} interleaved "
                      f"repetitions, {t.get('threads', '?')} threads)."]
        if t.get("flag"):
            lines += ["", f"**Timing flagged**: {t['flag']}."]
    return "\n".join(lines) + "\n"


def write_metrics(out_dir: str | Path, summary: dict) -> str:
    """Write ``metrics.json`` and ``metrics.md`` (atomically) next to the exported LDLP; return the table."""
    out = Path(out_dir)
    table = ldlp_metrics_markdown(summary)
    atomic_write_json(out / "metrics.json", summary)
    atomic_write_text(out / "metrics.md", table)
    return table
