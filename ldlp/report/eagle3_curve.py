"""The EAGLE-3 head's learning curve page: ``curve.jsonl`` (written while it trains,
:mod:`eagle_backbone.train.eagle3_curve`) as a table of τ per step, prompt set and temperature beside the
reference drafter's τ on the same prompts, and a plot of the ratio against training tokens."""

from __future__ import annotations

import json
from pathlib import Path

from eagle_backbone.errors import MissingInput
from eagle_backbone.io import atomic_write_text
from ldlp.report.figures import pyplot, save_figure


def read_curve(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise MissingInput(f"no learning curve at {path} (train with drafter_training.curve.every=N)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not any(r["step"] is not None for r in rows):
        raise ValueError(f"{path}: no point of the training head yet")
    return rows


def curve_table(rows: list[dict], offset_tokens: int = 0) -> tuple[list[str], list[list]]:
    """(columns, rows): one row per step, τ of every (set, T) and its ratio to the reference's τ there.
    ``offset_tokens``: block tokens the head had seen before this run (a continued head)."""
    ref = {(r["set"], r["temperature"]): r["tau"] for r in rows if r["step"] is None}
    ref_name = next((r["drafter"] for r in rows if r["step"] is None), None)
    cells = sorted({(r["set"], r["temperature"]) for r in rows if r["step"] is not None})
    head = {(r["step"], r["set"], r["temperature"]): r for r in rows if r["step"] is not None}
    steps = sorted({r["step"] for r in rows if r["step"] is not None})
    columns = ["step", "block tokens (M)"] + [f"{s} T={t:g}" for s, t in cells]
    out = []
    for step in steps:
        row = [step, None]
        for c in cells:
            r = head.get((step,) + c)
            if r is None:
                row.append(None)
                continue
            row[1] = (offset_tokens + (r.get("block_tokens") or 0)) / 1e6
            row.append((r["tau"], r["tau"] / ref[c] if c in ref else None))
        out.append(row)
    if ref:
        out.append([f"{ref_name} (reference)", None] + [(ref[c], 1.0) if c in ref else None for c in cells])
    return columns, out


def curve_markdown(rows: list[dict], title: str, offset_tokens: int = 0) -> str:
    columns, table = curve_table(rows, offset_tokens)
    first = next(r for r in rows if r["step"] is not None)
    lines = [f"### {title}", "",
             f"τ at static γ = {first['gamma']}, {first['prompts']} prompts per set, {first['max_new_tokens']} new tokens; "
             "each cell τ (ratio to the reference's τ on the same prompts). Sampled decodes use seed + prompt index.", "",
             "| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
    for row in table:
        cells = [str(row[0]), "" if row[1] is None else f"{row[1]:.2f}"]
        cells += ["" if c is None else (f"{c[0]:.2f}" + ("" if c[1] is None else f" ({c[1]:.3f})")) for c in row[2:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_curve_page(curve_path: str | Path, out_dir: str | Path, title: str, offset_tokens: int = 0) -> dict:
    """curve.md and curve.png (ratio to the reference against block tokens, one line per set and T) in out_dir."""
    rows = read_curve(curve_path)
    out_dir = Path(out_dir)
    md = curve_markdown(rows, title, offset_tokens)
    atomic_write_text(out_dir / "curve.md", md)
    columns, table = curve_table(rows, offset_tokens)
    _, plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    points = [r for r in table if isinstance(r[0], int)]
    for j, name in enumerate(columns[2:]):
        xy = [(r[1], r[2 + j][1]) for r in points if r[2 + j] is not None and r[2 + j][1] is not None and r[1] is not None]
        if xy:
            ax.plot(*zip(*xy), marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training block tokens seen (millions)")
    ax.set_ylabel("τ / reference τ (γ = 6)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, out_dir / "curve.png")
    return {"md": str(out_dir / "curve.md"), "png": str(out_dir / "curve.png"), "markdown": md}
