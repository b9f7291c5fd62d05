"""The trained predictors' pages: ``metrics.md`` next to ``metrics.json`` in the folder of an exported LDLP
(``scripts/train_ldlp.py``; the summary: :func:`ldlp.training.predictor.run_ldlp_training`) or acceptance head
(``scripts/train_acceptance.py``; the metrics: :func:`ldlp.training.acceptance.train_acceptance_head`)."""

from __future__ import annotations

from pathlib import Path

from eagle_backbone.io import atomic_write_text

PAGE = "metrics.md"

# the legend of the LDLP's table: what each metric of ldlp.training.baselines.length_metrics measures
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


def ldlp_metrics_markdown(summary: dict) -> str:
    """The LDLP against the baselines on the validation positions, the metrics' legend and the forward time."""
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


def acceptance_head_markdown(m: dict) -> str:
    """The acceptance head next to the drafter's probabilities alone on the validation split, and its AUC by step."""
    lines = ["## Acceptance head", "",
             f"Logistic regression (C = {m['C']}) on the drafter state and its probabilities, predicting whether "
             f"the target keeps the draft extended by one more token; {m['train_examples']} training examples "
             f"from {m['oracle_dir']} (k_max = {m['k_max']}).", ""]
    val = m.get("validation")
    if val:
        lines += ["| inputs (validation split) | AUC | log loss | Brier | examples | positive rate |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, s in val.items():
            auc = "–" if s["auc"] is None else f"{s['auc']:.3f}"
            lines.append(f"| {name.replace('_', ' ')} | {auc} | {s['log_loss']:.3f} | {s['brier']:.3f} | "
                         f"{s['examples']} | {s['positive_rate']:.3f} |")
        by_step = m.get("validation_auc_by_step") or {}
        if by_step:
            lines += ["", "AUC by draft step: " + ", ".join(
                f"{k}: {'–' if v is None else f'{v:.2f}'}" for k, v in by_step.items())]
    return "\n".join(lines) + "\n"


def write_ldlp_metrics(out_dir: str | Path, summary: dict) -> str:
    """Write ``metrics.md`` (atomically) next to the exported LDLP's ``metrics.json``; returns the page."""
    page = ldlp_metrics_markdown(summary)
    atomic_write_text(Path(out_dir) / PAGE, page)
    return page


def write_acceptance_head_metrics(out_dir: str | Path, metrics: dict) -> str:
    """Write ``metrics.md`` (atomically) next to the acceptance head's ``metrics.json``; returns the page."""
    page = acceptance_head_markdown(metrics)
    atomic_write_text(Path(out_dir) / PAGE, page)
    return page
