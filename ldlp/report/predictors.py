"""The predictor study's page and plot (``scripts/study_predictors.py``; the numbers:
ldlp/bench/comparisons/predictors.py)."""

from __future__ import annotations

import math
from pathlib import Path

from ldlp.report.figures import pyplot, save_figure


def _pct(v) -> str:
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{100 * v:+.1f}%"


def _row(r: dict, first: str) -> str:
    return (f"| {first} | {r['train_examples']} | {r['mae']:.3f} | {r['auc_1']:.3f} | {r['auc_mean']:.3f} | "
            f"{r['tau']:.2f} | {r['vs_best_static']:.3f} | {_pct(r['headroom'])} |")


HEAD = ("| {} | training examples | MAE | AUC, first draft | AUC, mean m = 1..K | τ | modelled vs best static γ | "
        "headroom captured |\n|---|---:|---:|---:|---:|---:|---:|---:|")


def learning_curve_plot(runs: list[dict], path: Path) -> None:
    _, plt = pyplot()
    runs = sorted(runs, key=lambda r: r["train_examples"])
    n = [r["train_examples"] for r in runs]
    fig, ax = plt.subplots(1, 3, figsize=(12, 3.4))
    ax[0].plot(n, [r["auc_mean"] for r in runs], "o-", label="mean m = 1..K")
    ax[0].plot(n, [r["auc_1"] for r in runs], "s--", label="first draft")
    ax[0].set_ylabel("AUC (validation)")
    ax[0].legend()
    ax[1].plot(n, [r["mae"] for r in runs], "o-")
    ax[1].set_ylabel("MAE of the median length")
    ax[2].plot(n, [100 * (r["headroom"] or 0.0) for r in runs], "o-")
    ax[2].axhline(0, color="grey", lw=0.8)
    ax[2].set_ylabel("headroom captured (%), modelled")
    for a in ax:
        a.set_xscale("log")
        a.set_xlabel("training examples (steps)")
        a.grid(alpha=0.3)
    save_figure(fig, path, dpi=110)


def _positions(oracle) -> str:
    records = oracle if isinstance(oracle, list) else [oracle]
    counts = [(r.get("counts") or {}).get("positions") for r in records]
    return "?" if None in counts else str(sum(counts))


def study_page(done: dict, oracle_dir: str, plot_dir: Path | None = None) -> str:
    runs = list(done.get("runs", {}).values())
    ident, ref = done["identity"], done["reference"]
    best_static = max((v, k) for k, v in ref.items() if k.startswith("static"))
    ex = done.get("examples", {})
    lines = [
        "# Predictor study: features, models, labels and the decision rule", "",
        f"Oracle collection{'s' if isinstance(ident['oracle'], list) else ''} `{oracle_dir}` ({_positions(ident['oracle'])} "
        "positions); "
        f"examples recorded by replaying static γ = {ident['behaviours']} over it: {ex.get('train', '?')} training "
        f"steps, {ex.get('validation', '?')} validation steps. A model predicts the survival curve S_m = P(label ≥ m), "
        f"m = 1..{ident['K']}; the policy drafts the γ that maximises expected tokens minus expected seconds over the "
        "seconds a token is worth (the cost rule, `ldlp/policies/learned.py`). Modelled speed is replay of that policy "
        f"on the validation sequences, priced by {ident['costs'].get('source')}; best static γ there: "
        f"{best_static[1]} ({best_static[0]:.1f} tokens/s), oracle {ref['oracle']:.1f} tokens/s "
        f"(headroom {_pct(ref['oracle'] / best_static[0] - 1)}).", "",
        "Regenerate: `python scripts/study_predictors.py oracle_dir=...` (this folder's study.json has every number "
        "and the settings); the head-to-head folders beside it and their replay pages: the commands in "
        "[docs/predictors.md](../../../docs/predictors.md#reproduce).", ""]
    sections = [("models", "Models, every feature", "model"), ("learning_curve", "Learning curve", "model, examples"),
                ("ablation", "Feature ablation", "features"), ("rules", "Decision rules", "model, rule")]
    for sec, title, first in sections:
        rs = [r for r in runs if r["section"] == sec]
        if not rs:
            continue
        lines += [f"## {title}", "", HEAD.format(first)]
        if sec == "learning_curve":
            rs.sort(key=lambda r: r["train_examples"])
        for r in rs:
            lines.append(_row(r, r["name"]))
        if sec == "models":
            lines += ["", "Decision time per step (one row's survival curve and the rule, median): " + ", ".join(
                f"{r['name']} {r['decision_us']:.0f} µs" for r in rs if "decision_us" in r) + "."]
        lines.append("")
    curve = [r for r in runs if r["section"] == "learning_curve"]
    if curve and plot_dir is not None:
        learning_curve_plot(curve, Path(plot_dir) / "learning_curve.png")
        lines += ["![learning curve](learning_curve.png)", ""]
    return "\n".join(lines)


def beside_markdown(entries: list[dict], labels: list[str], h2h: dict, where: str) -> str:
    own = [lab for lab in labels if any(f"{lab}_with_policy" in e for e in entries)]
    lines = [f"### Replay beside the head to head ({where})", "",
             f"Each contender replayed on oracle labels of the head to head's own prompts ({h2h['n_prompts']} prompts "
             f"of {h2h['dataset']}, {h2h['max_new_tokens']} new tokens), priced by each cost model, as a ratio to "
             f"{h2h['reference']}; beside it the ratio the head to head measured. Replay prices the steps alone; "
             "`+ policy time` adds each contender's own measured policy time (its share of the seconds) on top. "
             "τ counts each prompt's forward and first token in both.", "",
             "| contender | measured | 95% interval | " + " | ".join(f"replay: {lab}" for lab in labels)
             + "".join(f" | replay: {lab} + policy time" for lab in own) + " | policy time | τ measured | τ replay |",
             "|---|---:|---:|" + "---:|" * (len(labels) + len(own)) + "---:|---:|---:|"]
    for e in entries:
        ci = e.get("ci95")
        cells = [f"{e[f'{lab}_ratio']:.3f}" if f"{lab}_ratio" in e else "–" for lab in labels]
        cells += [f"{e[f'{lab}_with_policy']:.3f}" if f"{lab}_with_policy" in e else "–" for lab in own]
        share = f"{100 * e['policy_share']:.1f}%" if e.get("policy_share") is not None else "–"
        lines.append(f"| {e['contender']} | {e['measured']:.3f} | "
                     + (f"{ci[0]:.3f} – {ci[1]:.3f}" if ci else "–") + " | " + " | ".join(cells)
                     + f" | {share} | {e['tau_measured']:.2f} | "
                     + (f"{e['tau_replay']:.2f}" if "tau_replay" in e else "–") + " |")
    return "\n".join(lines) + "\n"
