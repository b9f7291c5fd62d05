"""Per-category figures of an evaluation and the Spec-Bench-style table.

Spec-Bench reports each category (multi-turn conversation, translation, summarization, question
answering, mathematical reasoning, retrieval-augmented generation; MT-bench's eight) apart. Its
``evaluation/speed.py`` computes, per category and over all questions ("overall"):

* tokens/s: the mean over questions of each question's ``sum(new_tokens) / sum(wall_time)``, for the
  method and for the baseline; speedup: the ratio of those two means;
* mean accepted tokens: the mean of the ``accept_lengths`` of every verification step.

:func:`summarize_questions` gives those, and next to them this project's own figures (total tokens over
total seconds, its speedup, τ = tokens per target forward), from the per-question records of
:func:`ldlp.bench.comparisons.conversation.question_rows` (seconds per turn: medians over the evaluation's rounds).
Every count (questions, turns, new tokens, target forwards, seconds, turns dropped) of the categories
sums to the overall figure.
"""

from __future__ import annotations

def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def summarize_questions(rows: list[dict], n_dropped_at_load: int = 0) -> dict:
    """The figures of a group of questions: totals (tokens over seconds, the seconds being the per-turn
    medians), τ, Spec-Bench's mean accepted tokens and its tokens/s (the mean over questions of each
    question's tokens over seconds) and speedup (the ratio of those means)."""
    nt = sum(sum(r["new_tokens"]) for r in rows)
    ar_nt = sum(sum(r["ar_new_tokens"]) for r in rows)
    ws = sum(sum(r["wall_time"]) for r in rows)
    ar_ws = sum(sum(r["ar_wall_time"]) for r in rows)
    tf = sum(sum(r["target_forwards"]) for r in rows)
    speeds = [sum(r["new_tokens"]) / sum(r["wall_time"]) for r in rows if sum(r["wall_time"]) > 0]
    ar_speeds = [sum(r["ar_new_tokens"]) / sum(r["ar_wall_time"]) for r in rows if sum(r["ar_wall_time"]) > 0]
    tps, ar_tps = (nt / ws if ws else None), (ar_nt / ar_ws if ar_ws else None)
    mean_tps, ar_mean_tps = _mean(speeds), _mean(ar_speeds)
    flags = [r["lossless"] for r in rows]
    return {"n_questions": len(rows), "n_prompts": sum(len(r["new_tokens"]) for r in rows),
            "n_dropped": sum(r["n_dropped"] for r in rows) + n_dropped_at_load,
            "new_tokens": nt, "ar_new_tokens": ar_nt, "wall_s": ws, "ar_wall_s": ar_ws, "target_forwards": tf,
            "tokens_per_s": tps, "ar_tokens_per_s": ar_tps,
            "speedup": tps / ar_tps if tps is not None and ar_tps else None,
            "tau": nt / tf if tf else None,
            "mean_accepted_tokens": _mean(a for r in rows for a in r["accept_lengths"]),
            "mean_tokens_per_s": mean_tps, "ar_mean_tokens_per_s": ar_mean_tps,
            "specbench_speedup": mean_tps / ar_mean_tps if mean_tps is not None and ar_mean_tps else None,
            "lossless": None if None in flags else all(flags)}


UNCATEGORISED = "(none)"
# Spec-Bench's "multi-turn conversation" task (its speed.py's "mt_bench"): MT-bench's eight categories pooled
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def category_rows(rows: list[dict], dropped_at_load: dict | None = None) -> tuple[dict, dict]:
    """(``{category: figures}`` in the order of first appearance, the same figures over every question).
    Questions without a category are grouped under ``(none)``; the first mapping is empty when no question
    has a category. ``dropped_at_load``: turns dropped before decoding, per category (question dropped
    whole for a too-long first prompt)."""
    dropped_at_load = dict(dropped_at_load or {})
    cats = list(dict.fromkeys([r["category"] for r in rows] + list(dropped_at_load)))
    overall = summarize_questions(rows, sum(dropped_at_load.values()))
    if all(c is None for c in cats):
        return {}, overall
    by = {}
    for c in cats:
        by[UNCATEGORISED if c is None else str(c)] = summarize_questions([r for r in rows if r["category"] == c],
                                                                         dropped_at_load.get(c, 0))
    return by, overall


def specbench_tasks(rows: list[dict], dropped_at_load: dict | None = None) -> dict:
    """Spec-Bench's tasks when the questions mix MT-bench's categories with others (a Spec-Bench
    ``question.jsonl``): ``mt_bench`` (MT-bench's eight categories pooled, as its speed.py does) and each other
    category; empty otherwise (the categories are the tasks)."""
    dropped_at_load = dict(dropped_at_load or {})
    cats = list(dict.fromkeys([r["category"] for r in rows] + list(dropped_at_load)))
    mt = [c for c in cats if c in MT_BENCH_CATEGORIES]
    if not mt or len(mt) == len(cats):
        return {}
    task = lambda c: "mt_bench" if c in MT_BENCH_CATEGORIES else c  # noqa: E731
    tasks = list(dict.fromkeys(task(c) for c in cats))
    return {(UNCATEGORISED if t is None else str(t)): summarize_questions(
                [r for r in rows if task(r["category"]) == t],
                sum(n for c, n in dropped_at_load.items() if task(c) == t)) for t in tasks}


TIMING_KEYS = ("wall_s", "ar_wall_s", "tokens_per_s", "ar_tokens_per_s", "speedup", "mean_tokens_per_s",
               "ar_mean_tokens_per_s", "specbench_speedup")


def merge_runs(runs: list[dict]) -> tuple[dict, dict, dict]:
    """(``by_category``, ``all_categories``, ``by_task``) of several ``results.json`` of one configuration: counters of
    the first run, timings the medians over the runs (as the summary's rows)."""
    import statistics

    def merged(figures: list[dict]) -> dict:
        out = dict(figures[0])
        for k in TIMING_KEYS:
            values = [f[k] for f in figures if f.get(k) is not None]
            out[k] = statistics.median(values) if values else None
        return out

    with_cats = [r for r in runs if r.get("all_categories")]
    if not with_cats:
        return {}, {}, {}

    def grouped(key):
        return {c: merged([r[key][c] for r in with_cats if c in (r.get(key) or {})])
                for c in (with_cats[0].get(key) or {})}

    return grouped("by_category"), merged([r["all_categories"] for r in with_cats]), grouped("by_task")


def runs_by_category(categories: list, secs, tokens) -> list[dict]:
    """Per runner of a head to head (``secs[runner][round][prompt]``, ``tokens[runner][prompt]``, the AR
    baseline last), per category of the prompts: new tokens, seconds (summed over the category's prompts,
    averaged over rounds), tokens/s and speedup over AR. Empty dicts when no prompt has a category."""
    import numpy as np

    secs, tokens = np.asarray(secs, dtype=float), np.asarray(tokens)
    if all(c is None for c in categories):
        return [{} for _ in range(len(secs))]
    cats = list(dict.fromkeys(UNCATEGORISED if c is None else str(c) for c in categories))
    labels = np.array([UNCATEGORISED if c is None else str(c) for c in categories])
    out = []
    for i in range(len(secs)):
        by = {}
        for c in cats:
            mask = labels == c
            s, ar_s = float(secs[i][:, mask].sum(1).mean()), float(secs[-1][:, mask].sum(1).mean())
            t, ar_t = int(tokens[i][mask].sum()), int(tokens[-1][mask].sum())
            tps, ar_tps = (t / s if s else None), (ar_t / ar_s if ar_s else None)
            by[c] = {"n_prompts": int(mask.sum()), "new_tokens": t, "seconds": s, "tokens_per_s": tps,
                     "speedup": tps / ar_tps if tps is not None and ar_tps else None}
        out.append(by)
    return out
