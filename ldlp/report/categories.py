"""The per-category tables: Spec-Bench's (from the rows of :mod:`ldlp.bench.comparisons.categories`) and the head to
head's speedup per category."""

from __future__ import annotations

from pathlib import Path

from eagle_backbone.io import atomic_write_text


def _fmt(v, spec: str) -> str:
    return "–" if v is None else spec.format(v)


def category_markdown(entries: list[tuple[str, dict, dict]], heading: str = "####") -> str:
    """The per-category tables of ``entries``, ``(policy label, by_category, overall)`` each (the
    ``by_category`` and ``all_categories`` of a ``results.json``): a Spec-Bench-style table (one column per
    category, one row per policy, cells are Spec-Bench's speedup, "overall" its overall speedup), the
    turns decoded and dropped per category, then each category's τ, tokens/s and speedup next to the
    overall row. An entry may add a fourth item, Spec-Bench's tasks (:func:`specbench_tasks`): the first
    table's columns are then the tasks. Empty unless the entries have two categories or more (one would repeat the overall row)."""
    entries = [e for e in entries if e[1]]
    cats = list(dict.fromkeys(c for e in entries for c in e[1]))
    if len(cats) < 2:
        return ""
    tasks = list(dict.fromkeys(c for e in entries if len(e) > 3 and e[3] for c in e[3])) or cats
    by0, all0 = entries[0][1], entries[0][2]
    counts = ", ".join(f"{c} {by0[c]['n_questions']} ({by0[c]['n_prompts']} turns, {by0[c]['n_dropped']} dropped)"
                       for c in cats if c in by0)
    lines = [f"{heading} Per category", "",
             "Spec-Bench's figures: a cell is the ratio of the mean over questions of tokens/s (each question's "
             "tokens over its seconds) to the AR baseline's; \"overall\" is the same over every question; MAT is "
             "the mean accepted tokens per verification step (the target's own token included).", "",
             f"Questions per category (turns decoded, turns dropped for length): {counts}; in all "
             f"{all0['n_questions']} questions, {all0['n_prompts']} turns, {all0['n_dropped']} dropped.", "",
             "| Policy | " + " | ".join(tasks) + " | overall | MAT |",
             "|---|" + "---:|" * (len(tasks) + 2)]
    for label, by, overall, *rest in entries:
        by_task = rest[0] if rest and rest[0] else by  # Spec-Bench's tasks (mt_bench pooled) when there are some
        cells = [_fmt(by_task.get(c, {}).get("specbench_speedup"), "{:.2f}x") for c in tasks]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {_fmt(overall.get('specbench_speedup'), '{:.2f}x')} | "
                     f"{_fmt(overall.get('mean_accepted_tokens'), '{:.2f}')} |")
    lines += ["", "| Policy | category | questions | turns | dropped | τ | MAT | tokens/s | AR tokens/s | speedup | "
              "Spec-Bench speedup | lossless |", "|---|---|" + "---:|" * 9 + "---|"]
    for label, by, overall, *_ in entries:
        for k, (cat, f) in enumerate([("overall", overall)] + [(c, by[c]) for c in cats if c in by]):
            loss = {True: "yes", False: "**NO**", None: "–"}[f.get("lossless")]
            lines.append(f"| {label if k == 0 else ''} | {cat} | {f['n_questions']} | {f['n_prompts']} | "
                         f"{f['n_dropped']} | {_fmt(f.get('tau'), '{:.2f}')} | "
                         f"{_fmt(f.get('mean_accepted_tokens'), '{:.2f}')} | {_fmt(f.get('tokens_per_s'), '{:.1f}')} | "
                         f"{_fmt(f.get('ar_tokens_per_s'), '{:.1f}')} | {_fmt(f.get('speedup'), '{:.2f}x')} | "
                         f"{_fmt(f.get('specbench_speedup'), '{:.2f}x')} | {loss} |")
    lines += ["", "tokens/s and speedup are totals (tokens over seconds, each turn's seconds the median over the "
              "rounds); τ = tokens per target forward, prefill included."]
    return "\n".join(lines) + "\n"


def runs_by_category_markdown(rows: list[dict]) -> str:
    """One row per head-to-head contender, one column per category: its speedup over AR (empty unless there
    are two categories or more)."""
    cats = list(dict.fromkeys(c for r in rows for c in (r.get("by_category") or {})))
    if len(cats) < 2:
        return ""
    lines = ["| contender | " + " | ".join(f"{c} ({rows[0]['by_category'][c]['n_prompts']})" for c in cats) + " |",
             "|---|" + "---:|" * len(cats)]
    for r in rows:
        by = r.get("by_category") or {}
        lines.append(f"| {r['contender']} | " + " | ".join(_fmt(by.get(c, {}).get("speedup"), "{:.2f}x") for c in cats)
                     + " |")
    return "\n".join(lines) + "\n"


def write_categories(result: dict, out_dir: str | Path) -> str | None:
    """An evaluation's per-category page, categories.md in ``out_dir`` (:func:`category_markdown` of its
    ``by_category``, ``all_categories`` and ``by_task``), its path recorded in the result and its results.json;
    None (nothing written) with fewer than two categories."""
    from ldlp.bench.comparisons.evaluate import write_results

    table = category_markdown([(result["model_id"], result["by_category"], result["all_categories"], result["by_task"])])
    if not table:
        return None
    atomic_write_text(Path(out_dir) / "categories.md", table)
    result["categories_md"] = str(Path(out_dir) / "categories.md")
    write_results(result, out_dir)
    return result["categories_md"]
