"""The resident memory of a long run (:mod:`ldlp.bench.harness.memory`'s summary): one line for a page, and a plot over
time with the rounds marked."""

from __future__ import annotations

from pathlib import Path

from ldlp.report.figures import pyplot, save_figure


def plot_memory(summary: dict | None, path: str | Path) -> Path | None:
    """Resident GB against minutes, each segment's start a dashed line with its label; None without samples."""
    samples = (summary or {}).get("samples") or []
    if len(samples) < 2:
        return None
    _, plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot([t / 60 for t, _ in samples], [v / 2 ** 30 for _, v in samples], lw=1.2)
    for seg in (summary.get("segments") or [])[1:]:
        ax.axvline(seg["start_s"] / 60, ls="--", lw=0.8, color="grey")
        ax.text(seg["start_s"] / 60, ax.get_ylim()[1], f" {seg['label']}", va="top", fontsize=7, color="grey")
    ax.set_xlabel("minutes")
    ax.set_ylabel("resident memory (GB)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def memory_line(summary: dict | None) -> str | None:
    """One line for a page: the peak, each measured segment's peak and floor, and the growth between rounds."""
    if not summary:
        return None
    gb = lambda b: f"{b / 2 ** 30:.2f}"  # noqa: E731
    line = f"Memory (resident, GB): peak {gb(summary['peak_bytes'])} over {summary.get('seconds', 0) / 60:.1f} min"
    segs = summary.get("segments") or []
    if segs:
        line += "; peak / floor per segment: " + ", ".join(
            f"{g['label']} {gb(g['peak_bytes'])} / {gb(g['floor_bytes'])}" + ("" if g["complete"] else " (so far)")
            for g in segs)
    if summary.get("growth") is not None:
        a, b = summary["compared"]
        line += (f"; {b} against {a}: peak {100 * summary['growth']:+.1f}%, floor "
                 f"{100 * summary['floor_growth']:+.1f}%")
    return line + f" (sampled every {summary['every_s']:g} s)."
