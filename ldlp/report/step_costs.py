"""The load sweep page's step-cost sections and plot: the online step-cost model against the measured steps,
and where the gap to the best static γ comes from, written from ``ldlp.bench.comparisons.step_costs``'s rows."""

from __future__ import annotations

from ldlp.bench.comparisons.step_costs import HINDSIGHT, WARMUP, decomposition, summary
from ldlp.report.figures import pyplot, save_figure


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _signed(x) -> str:
    return "–" if x is None else f"{100 * x:+.1f}%"


def _ms(x) -> str:
    return "–" if x is None else f"{x:.1f}"


def markdown_lines(result: dict) -> list[str]:
    """The page's section: predicted against measured step time per (contender, C, T), with the error."""
    rows = result.get("step_costs") or []
    if not rows:
        return []
    s = summary(rows)
    lines = ["", "## Step costs: the online model against the measured steps", "",
             f"Each contender's engines share one online step-cost model (eagle_backbone/step_cost.py), kept across "
             f"its runs; a cost-driven policy warm-starts it from its cost table and plans with it. A step counts "
             f"once its model has seen {WARMUP} steps; the error is (predicted − measured) / measured, per step. On a "
             "CPU the costs are fitted to each step's CPU time and a running stretch (wall over CPU time) makes "
             "them wall milliseconds: the CPU column is the model's own error, the wall columns add what the "
             "scheduler did to each step.", ""]
    if s:
        w = s["worst"]
        lines += [f"Median absolute error, median over the rows: **{_pct(s['median'])}** of the wall time, "
                  f"**{_pct(s['cpu_median'])}** of the CPU time; worst row (wall): "
                  f"{_pct(w['median_abs_error'])} ({w['contender']}, C={w['concurrency']}, T={w['temperature']:g}).", ""]
    lines += ["| contender | C | T | steps | measured ms | predicted ms | median abs error | p90 abs error | median error "
              "| CPU-time median abs error |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["temperature"], r["contender"], r["concurrency"])):
        lines.append(f"| {r['contender']} | {r['concurrency']} | {r['temperature']:g} | {r['n']} | {_ms(r['measured_ms'])} "
                     f"| {_ms(r['predicted_ms'])} | {_pct(r['median_abs_error'])} | {_pct(r['p90_abs_error'])} "
                     f"| {_signed(r['median_error'])} | {_pct(r.get('cpu_median_abs_error'))} |")
    if any(r.get("gamma") is not None for r in rows):
        lines += ["", "![the online model's error by (C, γ)](step_costs_by_gamma.png)"]
    h = result.get("hindsight")
    if h:
        stretch = h.get("stretch", 1.0)
        costs = ", ".join(f"{k} {stretch * v:.4g}" for k, v in zip(h["features"], h["theta"]))
        lines += ["", f"Costs measured in hindsight (one fit to all {h['records']} timed steps, `step_costs.json`; "
                  f"its median absolute error on them {_pct(h.get('median_abs_error'))} of the wall time, "
                  f"{_pct(h.get('cpu_median_abs_error'))} of the CPU time; stretch {h.get('stretch', 1.0):.2f}): "
                  f"{costs} ms."]
    return lines


def decomposition_lines(rows: list[dict]) -> list[str]:
    """The page's section on where each policy's gap to the best static γ comes from (:func:`decomposition`)."""
    d = decomposition(rows)
    if not d:
        return []
    def f(x, signed=False):
        return "–" if x is None else (f"{x:+.3f}" if signed else f"{x:.3f}")
    lines = ["", "## Where the gap to the best static γ comes from", "",
             "Tokens/s over the best static γ at (C, T), paired: each policy on its online step-cost model, the same "
             f"policy on the costs measured in hindsight (`policy.cost_model=step_costs.json`, label \"{HINDSIGHT.strip()}\"), "
             "and the batched oracle on those costs (the true acceptance). **costs** = hindsight − online: what better "
             "costs would win; **acceptance** = true acceptance − hindsight: what exact acceptance would win on top.", "",
             "| policy | C | T | online | hindsight costs | true acceptance | costs | acceptance |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d:
        lines.append(f"| {r['policy']} | {r['concurrency']} | {r['temperature']:g} | {f(r['online'])} | {f(r['hindsight'])} "
                     f"| {f(r['true_acceptance'])} | {f(r['costs'], True)} | {f(r['acceptance'], True)} |")
    return lines


def plot(result: dict, path) -> object | None:
    """Predicted against measured step ms, the runs' sampled steps, one colour per contender, log axes."""
    pts: dict[str, list] = {}
    for r in result.get("runs") or []:
        for p, m in (r.get("step_costs") or {}).get("pairs", []):
            pts.setdefault(r["contender"], []).append((m, p))
    if not pts:
        return None
    _, plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.2, 5.6))
    lo = min(min(m, p) for v in pts.values() for m, p in v)
    hi = max(max(m, p) for v in pts.values() for m, p in v)
    for lab, v in pts.items():
        ax.scatter([m for m, _ in v], [p for _, p in v], s=6, alpha=0.5, label=lab)
    ax.plot([lo, hi], [lo, hi], color="black", lw=1)
    ax.fill_between([lo, hi], [0.9 * lo, 0.9 * hi], [1.1 * lo, 1.1 * hi], color="grey", alpha=0.15, lw=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step ms")
    ax.set_ylabel("predicted step ms (online model, before the step)")
    ax.set_title("Step costs: predicted against measured (grey: ±10%)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, markerscale=2)
    return save_figure(fig, path)


def plot_by_gamma(result: dict, path) -> object | None:
    """The online model's median signed error per (C, γ): one line per C over the static γ contenders (batched AR
    at γ = 0), per T; the shape of the model's miss (a form that misses large batches bends the lines at high C)."""
    rows = [r for r in result.get("step_costs") or [] if r.get("gamma") is not None and r.get("median_error") is not None]
    if not rows:
        return None
    _, plt = pyplot()

    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(5.2 * len(temps), 4.2), squeeze=False)
    for ax, T in zip(axes[0], temps):
        at = [r for r in rows if r["temperature"] == T]
        for C in sorted({r["concurrency"] for r in at}):
            pts = sorted((r["gamma"], 100 * r["median_error"]) for r in at if r["concurrency"] == C)
            ax.plot([g for g, _ in pts], [e for _, e in pts], marker="o", label=f"C={C}")
        ax.axhline(0, color="black", lw=0.8)
        ax.axhspan(-10, 10, color="grey", alpha=0.15, lw=0)
        ax.set_xlabel("static γ (0: batched AR)")
        ax.set_ylabel("median (predicted − measured) / measured, %")
        ax.set_title(f"Step-cost model error by (C, γ), T={T:g}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)
