"""The label collections' pages: ``report.md`` next to ``report.json`` in a collection folder, rendered from
the report the collector returns (or ``report.json`` read back), by the script that ran it
(``scripts/collect_oracle.py``: :func:`ldlp.labels.collect.write_report`; ``scripts/collect_acceptance.py``:
:func:`ldlp.labels.acceptance_labels.write_report`)."""

from __future__ import annotations

from pathlib import Path

from eagle_backbone.io import atomic_write_text

PAGE = "report.md"


def oracle_markdown(out: str | Path, report: dict) -> str:
    """An oracle collection's page: positions and time per split, the label histogram, this run's share."""
    lines = [f"# Oracle labels: {Path(out)}", "",
             f"k_max = {report['k_max']}; {report['sequences']} sequences, {report['positions']} positions, "
             f"{report['parts']} parts.", "",
             "| split | sequences | positions | mean label | at k_max | at k_max (uncensored) | seconds | positions/s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in [("all", report)] + list(report["splits"].items()):
        lines.append(f"| {name} | {s['sequences']} | {s['positions']} | {s['mean_label']:.3f} | {s['frac_at_k_max']:.3f} "
                     f"| {s['frac_at_k_max_uncensored']:.3f} | {s['seconds']:.1f} | {s['positions_per_s']:.1f} |")
    total = max(1, report["positions"])
    lines += ["", "Label histogram (all splits):", "", "| label | count | share |", "|---|---|---|"]
    lines += [f"| {k} | {c} | {c / total:.3f} |" for k, c in enumerate(report["label_hist"])]
    run = report.get("this_run")
    if run:
        lines += ["", f"This run ({run.get('worker')}): {run['parts_written']} parts, {run['sequences']} sequences, "
                      f"{run['positions']} positions in {run['wall_seconds']:.1f} s wall "
                      f"({run['positions'] / run['seconds'] if run['seconds'] else 0:.1f} positions/s); "
                      f"{run['parts_complete']}/{run['parts']} of its parts complete."]
    return "\n".join(lines) + "\n"


def acceptance_labels_markdown(out: str | Path, report: dict) -> str:
    """An acceptance-label collection's page: examples, mean beta and kept rate by depth; a partial collection
    says so, with the command that completes it."""
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    missing = report["missing_sequences"]
    lines = [f"# Per-position acceptance labels: {Path(out)}", "",
             (f"temperature = {report['temperature']}, k_max = {report['k_max']}; {report['sequences']} sequences, "
              f"{report['positions']} positions ({', '.join(f'{s}: {n}' for s, n in report['splits'].items())}), "
              f"{report['parts']} parts, {report['seconds']:.1f} s."), "",
             "| depth | examples (earlier drafts kept) | mean beta | kept rate |", "|---:|---:|---:|---:|"]
    if missing:
        lines[2:2] = [f"**Partial collection**: {report['sequences']} of {report['sequences_planned']} sequences "
                      f"({missing} missing); rerun the scripts/collect_acceptance.py command that started it to "
                      "complete it.", ""]
    lines += [f"| {m + 1} | {report['valid_by_depth'][m]} | {fmt(report['mean_beta_by_depth'][m])} | "
              f"{fmt(report['kept_rate_by_depth'][m])} |" for m in range(report["k_max"])]
    return "\n".join(lines) + "\n"


def write_oracle_page(out: str | Path, report: dict) -> Path:
    """Write ``report.md`` (atomically) into the oracle collection ``out``; returns its path."""
    path = Path(out) / PAGE
    atomic_write_text(path, oracle_markdown(out, report))
    return path


def write_acceptance_labels_page(out: str | Path, report: dict) -> Path:
    """Write ``report.md`` (atomically) into the acceptance-label collection ``out``; returns its path."""
    path = Path(out) / PAGE
    atomic_write_text(path, acceptance_labels_markdown(out, report))
    return path
