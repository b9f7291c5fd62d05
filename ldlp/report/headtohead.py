"""The head-to-head pages: one run (:func:`ldlp.bench.comparisons.headtohead.head_to_head`), several pooled
(:func:`ldlp.bench.comparisons.pool.pool`), and load-sweep folders pooled against one contender
(:func:`ldlp.bench.comparisons.pool.pooled_batch_ratios`)."""

from __future__ import annotations

import os
from pathlib import Path

from eagle_backbone.io import atomic_write_text
from ldlp.report.categories import runs_by_category_markdown
from ldlp.report.notes import dropped_note, skipped_note, verdict_line, with_mismatch_lines


def head_to_head_markdown(result: dict) -> str:
    ref = result["reference"]
    lines = [f"### Head to head ({result['model']})", "",
             f"{len(result['rows']) - 1} contenders and the AR baseline take turns on every prompt (rotating order) "
             f"for {result['rounds']} rounds in one process: {result['n_prompts']} prompts of {result['dataset']}"
             f"{dropped_note(result)}{skipped_note(result)}, "
             f"{result['max_new_tokens']} new tokens at most, greedy. `vs {ref}` is the ratio of seconds on the same "
             "(round, prompt) pairs (> 1: faster than the best static contender), with a bootstrap 95% interval "
             "that resamples prompts (each with all its rounds); tokens/s are totals over all pairs.", "",
             "`policy time`: the policy's own calls (its plan, stop and observe) as a share of its seconds.", "",
             f"| contender | setting | τ | wasted | tokens/s | speedup vs AR | vs {ref} | 95% interval | rounds faster "
             "| policy time |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        setting = ", ".join(f"{k}={v}" for k, v in (r.get("setting") or {}).items() if k != "path") or "–"
        vs = f"{r['vs_best_static']:.3f}" if "vs_best_static" in r else ("1 (reference)" if r["contender"] == ref
                                                                          else "–")
        ci = f"{r['ci95'][0]:.3f} – {r['ci95'][1]:.3f}" if "ci95" in r else "–"
        faster = f"{r['rounds_faster']}/{result['rounds']}" if "rounds_faster" in r else "–"
        wasted = r["wasted_tokens"] if r["contender"] != "AR" else "–"
        own = f"{100 * r['policy_share']:.1f}%" if r.get("policy_share") is not None else "–"
        lines.append(f"| {r['contender']} | {setting} | {r['tau']:.2f} | {wasted} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {vs} | {ci} | {faster} | {own} |")
    lines.append("")
    if "best_adaptive" in result:
        lines.append(verdict_line(result, ref, "best adaptive"))
    if "headroom_captured" in result:
        lines.append(f"- headroom captured: **{100 * result['headroom_captured']:.0f}%** of (oracle − best static) "
                     "in tokens/s, all timed in turns")
    for r in result["rows"]:
        t = r.get("twin")
        if t:
            lines.append(f"- {t['of']}'s own time: its γ choices, scripted, took turns beside it; the policy took "
                         f"{t['seconds_ratio']:.3f}× the twin's seconds (95% interval {t['ci95'][0]:.3f} – "
                         f"{t['ci95'][1]:.3f}); {100 * t['same_choices']:.0f}% of the prompts saw the same choices "
                         "in the first timed round")
    c = result.get("costs")
    if c:
        lines.append(f"- time fitted to these generations: {c['step_ms']:.2f} ms per target pass + {c['draft_ms']:.2f} ms "
                     f"per drafted token + {c['accepted_ms']:.2f} ms per accepted token")
    if result["lossless"] is not None:
        lines.append("- every greedy output (AR's included) equals the target's own greedy decoding through transformers"
                     if result["lossless"] else "- **some greedy outputs differ from the target's own greedy decoding**")
    cats = runs_by_category_markdown(result["rows"])
    if cats:
        lines += ["", "Speedup over AR per category (prompts in each), from the same turns:", "", cats.rstrip("\n")]
    # below its title, the files made for another setup that accept_mismatch=true let drive the run
    return with_mismatch_lines("\n".join(lines) + "\n", result)


def pooled_markdown(p: dict, links: list[str] | None = None) -> str:
    ref, n = p["reference"], len(p["runs"])
    runs = [f"[{r}]({link})" for r, link in zip(p["runs"], links)] if links else p["runs"]
    lines = [f"{n} head-to-head runs ({', '.join(runs)}), {p['pairs']} timed (round, prompt) pairs of the reference "
             f"in all. Ratios are seconds of **{ref}** (the static contender fastest over all runs) over the "
             "contender's, on the same pairs: > 1 is faster. A contender is pooled over the runs it is in (– where "
             "it did not run); the 95% interval of its pooled ratio resamples those runs, then prompts within each.",
             "",
             "| contender | " + " | ".join(f"{r}" for r in p["runs"]) + " | median | pooled | 95% interval | runs faster |",
             "|---|" + "---:|" * (n + 4)]
    for r in p["rows"]:
        cells = " | ".join("–" if v is None else f"{v:.3f}" for v in r["per_run"])
        ci = f"{r['ci95'][0]:.3f} – {r['ci95'][1]:.3f}" if "ci95" in r else "–"
        n_in = sum(v is not None for v in r["per_run"])
        faster = f"{r['runs_faster']}/{n_in}" if "runs_faster" in r else "reference"
        lines.append(f"| {r['contender']} | {cells} | {r['median']:.3f} | {r['pooled']:.3f} | {ci} | {faster} |")
    lines.append("")
    lines.append(f"- {ref} over AR, per run: " + ", ".join(f"{s:.2f}x" for s in p["ar_speedup_of_reference"]))
    if "best_adaptive" in p:
        lines.append(verdict_line(p, ref, "best adaptive, pooled"))
    if "headroom_captured" in p:
        lines.append(f"- headroom captured: **{100 * p['headroom_captured']:.0f}%** of (oracle − {ref}), both pooled "
                     "(over the runs each is in)")
    if any(p["costs"]):
        lines.append("- fitted per target pass / per drafted token, per run: " + ", ".join(
            f"{c['step_ms']:.1f} / {c['draft_ms']:.2f} ms" if c else "–" for c in p["costs"]))
    return "\n".join(lines) + "\n"


def pooled_batch_markdown(rows: dict[tuple[int, str], list[tuple[float, float]]], reference: str) -> str:
    """The table of :func:`pooled_batch_ratios`: per C and contender, the median and geometric mean of the CPU
    ratios, the pairs above 1, and the median wall-clock ratio."""
    import statistics

    lines = [f"tokens per CPU-second over {reference!r}, paired by (folder, round, block)",
             "| C | contender | median | geometric mean | pairs above 1 | wall median |", "|---:|---|---:|---:|---:|---:|"]
    for (C, label), pairs in sorted(rows.items()):
        cpu, wall = [p[0] for p in pairs], [p[1] for p in pairs]
        lines.append(f"| {C} | {label} | {statistics.median(cpu):.3f} | {statistics.geometric_mean(cpu):.3f} | "
                     f"{sum(x > 1 for x in cpu)}/{len(cpu)} | {statistics.median(wall):.3f} |")
    return "\n".join(lines) + "\n"


def write_pooled(out_dir: str | Path, pooled: dict) -> Path:
    """pooled.md in ``out_dir``: :func:`pooled_markdown` of :func:`ldlp.bench.comparisons.pool.pool_folders`'s result,
    each run linked to its head_to_head.md."""
    out = Path(out_dir)
    links = [os.path.relpath(Path(f).parent / "head_to_head.md", out) for f in pooled["files"]]
    atomic_write_text(out / "pooled.md", pooled_markdown(pooled, links))
    return out / "pooled.md"
