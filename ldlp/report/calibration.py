"""Calibration of probability estimates against hard (0/1) or soft (beta in [0, 1]) labels.

A soft label ``beta`` is the probability of the event (a sampled draft being kept), so every score is
the expectation over the event: log loss and Brier score of the duplicated examples (label 1 with
weight ``beta``, label 0 with weight ``1 - beta``, scikit-learn's ``sample_weight``), and the expected
calibration error over ``n_bins`` equal-width bins of the estimate, ``sum_b n_b / n * |mean p_b - mean
beta_b|``. On hard labels :func:`reliability` gives exactly :func:`sklearn.calibration.calibration_curve`'s
points (a test checks it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ldlp.report.figures import pyplot, save_figure

EPS = 1e-7


def duplicated(p: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels, estimates, weights) of the soft labels as weighted hard examples; zero weights dropped."""
    p, beta = np.asarray(p, np.float64), np.asarray(beta, np.float64)
    y = np.concatenate([np.ones(len(p)), np.zeros(len(p))])
    w = np.concatenate([beta, 1.0 - beta])
    keep = w > 0
    return y[keep], np.concatenate([p, p])[keep], w[keep]


def reliability(p: np.ndarray, beta: np.ndarray, n_bins: int = 10) -> dict:
    """Per non-empty bin of equal width on [0, 1]: mean estimate, mean label, count."""
    p, beta = np.asarray(p, np.float64), np.asarray(beta, np.float64)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    which = np.searchsorted(edges[1:-1], p, side="right")  # calibration_curve's binning
    count = np.bincount(which, minlength=n_bins)
    sum_p = np.bincount(which, weights=p, minlength=n_bins)
    sum_y = np.bincount(which, weights=beta, minlength=n_bins)
    nz = count > 0
    return {"mean_predicted": (sum_p[nz] / count[nz]).tolist(), "mean_observed": (sum_y[nz] / count[nz]).tolist(),
            "count": count[nz].tolist()}


def expected_calibration_error(p: np.ndarray, beta: np.ndarray, n_bins: int = 10) -> float:
    r = reliability(p, beta, n_bins)
    count = np.asarray(r["count"], np.float64)
    if not count.sum():
        return float("nan")
    gap = np.abs(np.asarray(r["mean_predicted"]) - np.asarray(r["mean_observed"]))
    return float((count * gap).sum() / count.sum())


def scores(p: np.ndarray, beta: np.ndarray, n_bins: int = 10) -> dict:
    """Log loss, Brier score, ECE, AUC (None when one outcome only), mean estimate and mean label."""
    from sklearn.metrics import brier_score_loss, log_loss, roc_auc_score

    p = np.clip(np.asarray(p, np.float64), EPS, 1 - EPS)
    beta = np.asarray(beta, np.float64)
    if len(p) == 0:
        return {"examples": 0}
    y, pp, w = duplicated(p, beta)
    both = len(np.unique(y)) == 2
    return {"log_loss": float(log_loss(y, pp, sample_weight=w, labels=[0, 1])),
            "brier": float(brier_score_loss(y, pp, sample_weight=w)),
            "ece": expected_calibration_error(p, beta, n_bins),
            "auc": float(roc_auc_score(y, pp, sample_weight=w)) if both else None,
            "mean_predicted": float(p.mean()), "mean_label": float(beta.mean()), "examples": len(p),
            "reliability": reliability(p, beta, n_bins)}


def plot_reliability(curves: dict, path: str | Path, title: str) -> Path:
    """One reliability diagram: ``curves`` maps a legend label to a :func:`reliability` dict; written
    atomically (:func:`~ldlp.report.figures.save_figure`)."""
    _, plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 5.0))
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls=":", label="perfectly calibrated")
    for label, r in curves.items():
        style = "--" if "online" in label else "-"
        ax.plot(r["mean_predicted"], r["mean_observed"], style, marker="o", ms=3, label=label)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("estimated acceptance (bin mean)")
    ax.set_ylabel("label mean (beta; greedy: kept)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path, dpi=110)


def _fmt(v, nd=3) -> str:
    return "–" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.{nd}f}"


def write_draft_acceptance_report(results: list[dict], out_root: str | Path, n_bins: int = 10) -> dict:
    """Score the predictions of :func:`ldlp.training.draft_acceptance.train_at_temperature` (one dict per
    temperature): ``metrics.json``, ``metrics.md`` and ``reliability.png`` in each head's folder and a
    summary ``calibration.md`` / ``calibration.json`` in ``out_root``; returns the summary."""
    from eagle_backbone.io import atomic_write_json, atomic_write_text

    out_root = Path(out_root)
    summary = {"n_bins": n_bins, "temperatures": []}
    lines = ["# Per-position acceptance heads: calibration", "",
             ("Estimates of a_i = P(draft i kept | drafts 1..i-1 kept) scored against the labels (greedy: drafter "
              "argmax == target argmax; sampled: beta = sum min(p, q)), on held-out rows of the training domain and on "
              f"out-of-domain prompts. ECE over {n_bins} equal-width bins. `head + online recalibration` replays each "
              "stream in order through a fresh `ldlp.models.calibration.OnlineLogitCalibration`, predicting every position "
              "before its outcome (the seeded keep decision) updates it."), "",
             "| T | set | estimator | log loss | Brier | ECE | AUC | mean estimate | mean label | examples |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        t, head_dir = res["temperature"], Path(res["head_dir"])
        metrics = {k: res[k] for k in ("temperature", "head_dir", "train_examples", "k_max", "C", "online_calibration")}
        metrics["sets"] = {}
        curves = {}
        md = [f"## Draft acceptance head, temperature {t}", "",
              (f"{res['train_examples']} training examples, k_max = {res['k_max']}, C = {res['C']}; online "
               f"recalibration options {res['online_calibration'] or 'OnlineLogitCalibration defaults'}. "
               "Reliability diagram: [reliability.png](reliability.png)."), "",
              "| set | estimator | log loss | Brier | ECE | AUC | mean estimate | mean label | examples |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for set_name, s in res["sets"].items():
            metrics["sets"][set_name] = {"online_final": s["online_final"], "estimators": {}}
            for est, p in s["estimates"].items():
                sc = scores(p, s["beta"], n_bins)
                metrics["sets"][set_name]["estimators"][est] = sc
                row = (f"{set_name} | {est} | {_fmt(sc['log_loss'])} | {_fmt(sc['brier'])} | {_fmt(sc['ece'])} | "
                       f"{_fmt(sc['auc'])} | {_fmt(sc['mean_predicted'])} | {_fmt(sc['mean_label'])} | {sc['examples']} |")
                md.append("| " + row)
                if est.startswith("head"):
                    lines.append(f"| {t} | " + row)
                    curves[f"{set_name}: {est}"] = sc["reliability"]
        plot_reliability(curves, head_dir / "reliability.png", f"draft acceptance head, T = {t}")
        atomic_write_json(head_dir / "metrics.json", metrics)
        atomic_write_text(head_dir / "metrics.md", "\n".join(md) + "\n")
        summary["temperatures"].append(metrics)
    lines += ["", "Per temperature: " + ", ".join(
        f"[T = {r['temperature']}]({Path(r['head_dir']).name}/metrics.md)" for r in results)]
    atomic_write_json(out_root / "calibration.json", summary)
    atomic_write_text(out_root / "calibration.md", "\n".join(lines) + "\n")
    return summary
