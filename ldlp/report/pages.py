"""The generated results pages: marker blocks in Markdown files that a command rewrites.

A page's numbers come from the run that wrote them: a block between ``<!-- NAME:start -->`` and
``<!-- NAME:end -->`` is replaced as a whole, with the command that regenerates it.
"""

from __future__ import annotations

import os
from pathlib import Path

from eagle_backbone.io import atomic_write_text


def replace_readme_block(readme: str | Path, name: str, body: str) -> bool:
    """Put ``body`` between ``<!-- {name}:start -->`` and ``<!-- {name}:end -->`` in ``readme`` (written
    atomically). Returns False, and changes nothing, when the README or its markers are missing."""
    readme = Path(readme)
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if not readme.is_file():
        return False
    text = readme.read_text()
    if start not in text or end not in text:
        return False
    head, rest = text.split(start, 1)
    atomic_write_text(readme, head + "\n".join([start, body.strip("\n"), end]) + rest.split(end, 1)[1])
    return True


def update_readme(readme: str | Path, md_path: str | Path, png_path: str | Path, command: str, note: str = "") -> bool:
    """Replace the block between ``<!-- results:start -->`` and ``<!-- results:end -->`` in ``readme``
    with the generated table (``md_path``), the plot and the command that regenerates them, so that
    the README's numbers always come from a run. Returns False (and changes nothing) without markers."""
    readme, md_path, png_path = Path(readme), Path(md_path), Path(png_path)
    rel = lambda p: os.path.relpath(p, readme.parent)  # noqa: E731
    table = md_path.read_text().strip().split("\n")
    if table and table[0].startswith("## "):
        table = table[1:]  # the README gives its own heading
    body = "\n".join([f"Regenerate with `{command}` ({note}table: [{rel(md_path)}]({rel(md_path)}), CSV next to it).",
                      "", *table, "", f"![tokens/s against γ]({rel(png_path)})"])
    return replace_readme_block(readme, "results", body)


def publish_pooled(readme: str | Path, pooled: dict, out_dir: str | Path, command: str) -> bool:
    """Put the pooled head-to-head table (``ldlp.bench.comparisons.pool.pool_folders``'s result) into ``readme``'s
    ``<!-- head_to_head_long:start -->`` block, with links relative to it."""
    from ldlp.report.headtohead import pooled_markdown

    rel = lambda f: os.path.relpath(f, Path(readme).parent)  # noqa: E731
    table = Path(out_dir) / "pooled.md"
    body = (f"Regenerate with `{command}` (table: [{rel(table)}]({rel(table)})).\n\n"
            + pooled_markdown(pooled, [rel(Path(f).parent / "head_to_head.md") for f in pooled["files"]]))
    return replace_readme_block(readme, "head_to_head_long", body)
