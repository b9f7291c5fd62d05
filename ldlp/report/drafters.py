"""The drafters' page (:func:`ldlp.bench.peers.drafters.bench_drafters`)."""

from __future__ import annotations

from ldlp.report.notes import dropped_note, skipped_note


def _ci(x: dict) -> str:
    if not x.get("ci95"):  # one prompt: no interval
        return f"{x['ratio']:.3f}"
    return f"{x['ratio']:.3f} ({x['ci95'][0]:.3f}–{x['ci95'][1]:.3f})"


def _prompt_notes(result: dict) -> str:
    """The prompts dropped for length and the malformed records skipped (``data.on_error=skip``), after the prompt
    count as the head to head states them; nothing for a result of before they were recorded."""
    if "n_dropped" not in result:
        return ""
    return dropped_note(result) + skipped_note(result)


def _set_notes(cell: dict) -> str:
    """:func:`_prompt_notes` of one prompt set's cell (its loader's info, with the count it kept)."""
    return _prompt_notes({**(cell.get("prompt_set") or {}), "n_prompts": cell["n_prompts"]})


def tau_table(summary: list[dict], ref: str) -> list[str]:
    """The τ table: one row per (prompt set, T, drafter) of :func:`ldlp.bench.peers.drafters.summary_rows`, beside the
    reference ``ref``'s τ on the same prompts and the paired ratio (the page's, and the model card's EAGLE-3 entry's)."""
    lines = [f"| prompt set | T | prompts | drafter | τ | {ref} τ | ratio (95% interval) | lossless |",
             "|---|---:|---:|---|---:|---:|---|---|"]
    for r in summary:
        lossless = "" if r["lossless"] is None else ("yes" if r["lossless"] else "**no**")
        lines.append(f"| {r['set']} | {r['temperature']:g} | {r['n_prompts']} | {r['drafter']} | {r['tau']:.2f} | "
                     f"{r['reference_tau']:.2f} | {_ci(r)} | {lossless} |")
    return lines


def drafters_markdown(result: dict) -> str:
    ref = result["reference"]
    kinds = ", ".join(f"`{k}` ({v.get('drafter_kind')})" for k, v in result["drafters"].items())
    sets = ", ".join(f"{name} ({c['n_prompts']} prompts of {c['dataset']}{_set_notes(c)})"
                     for name, c in result["sets"].items())
    lines = [f"### Drafters head to head ({result['model']}, {result['dtype']})", "",
             f"Drafters {kinds} on one target; prompt sets {sets}; {result['max_new_tokens']} new tokens at most. "
             f"Ratios are against `{ref}` on the same prompts, with a bootstrap 95% interval over prompts.", ""]
    lines += [f"- prompt set {name} skipped: {why}" for name, why in result.get("skipped", {}).items()]
    if result.get("skipped"):
        lines.append("")
    lines += [f"#### τ at static γ = {result['tau_gamma']}, every prompt set", "", *tau_table(result["summary"], ref), ""]
    if result.get("speed_summary"):
        lines += ["#### tokens/s of each drafter's best static γ, every prompt set (timed in turns)", "",
                  f"| prompt set | T | prompts × rounds | drafter | γ | tokens/s (× AR) | {ref} γ | {ref} tokens/s (× AR) | "
                  "ratio (95% interval) | rounds faster |", "|---|---:|---:|---|---:|---:|---:|---:|---|---:|"]
        lines += [f"| {r['set']} | {r['temperature']:g} | {r['n_prompts']} × {r['rounds']} | {r['drafter']} | {r['gamma']} | "
                  f"{r['tokens_per_s']:.1f} ({r['speedup_vs_ar']:.2f}) | {r['reference_gamma']} | "
                  f"{r['reference_tokens_per_s']:.1f} ({r['reference_speedup_vs_ar']:.2f}) | {_ci(r)} | "
                  f"{r['rounds_faster']}/{r['rounds']} |" for r in result["speed_summary"]]
        lines.append("")
    if result.get("depth_summary"):
        g = result["tau_gamma"]
        lines += [f"#### acceptance by draft depth at γ = {g}, every prompt set", "",
                  "Of the steps whose chain reached depth k (every draft before it kept), the share that kept the k-th "
                  "draft too (first round, every prompt).", "",
                  "| prompt set | T | drafter | " + " | ".join(f"k = {k}" for k in range(1, g + 1)) + " |",
                  "|---|---:|---|" + "---:|" * g]
        lines += [f"| {r['set']} | {r['temperature']:g} | {r['drafter']} | "
                  + " | ".join("–" if x is None else f"{x:.3f}" for x in r["rates"]) + " |"
                  for r in result["depth_summary"]]
        lines.append("")
    if result.get("pairs"):
        lines += [f"#### τ of one drafter over another at γ = {result['tau_gamma']}", "",
                  "| prompt set | T | drafter | over | τ | τ | ratio (95% interval) |", "|---|---:|---|---|---:|---:|---|"]
        lines += [f"| {r['set']} | {r['temperature']:g} | {r['drafter']} | {r['over']} | {r['tau']:.2f} | "
                  f"{r['over_tau']:.2f} | {_ci(r)} |" for r in result["pairs"]]
        lines.append("")
    for name, cell in result["sets"].items():
        lines += [f"### {name}: {cell['n_prompts']} prompts of {cell['dataset']}{_set_notes(cell)}",
                  ""]
        lines += _set_markdown(cell["by_temperature"], ref)
    return "\n".join(lines)


def _set_markdown(by_temperature: dict, ref: str) -> list[str]:
    lines = []
    for T, cell in by_temperature.items():
        greedy = float(T) == 0.0
        timed = "best_static" in cell  # T = 0, and T > 0 with sampled_timed: every γ and AR, timed
        lines += [f"#### T = {T}" + (f" (lossless: {cell['lossless']})" if greedy else ""), "",
                  f"{cell['rounds']} round(s), contenders in turns on every prompt (rotating order).", "",
                  "| contender | τ | tokens/s |" + (" speedup vs AR |" if timed else ""),
                  "|---|---:|---:|" + ("---:|" if timed else "")]
        for row in cell["rows"]:
            lines.append(f"| {row['contender']} | {row['tau']:.2f} | {row['tokens_per_s']:.1f} |"
                         + (f" {row['speedup_vs_ar']:.2f} |" if timed else ""))
        lines.append("")
        for name, x in cell["tau_vs_reference"].items():
            lines.append(f"- τ at γ={x['gamma']}: {name} {x['tau']:.2f} vs {ref} {x['reference_tau']:.2f}: "
                         f"ratio {_ci(x)}")
        if timed:
            for name, b in cell["best_static"].items():
                lines.append(f"- best static γ of {name}: γ={b['gamma']}, {b['tokens_per_s']:.1f} tokens/s "
                             f"({b['speedup_vs_ar']:.2f}× AR, τ {b['tau']:.2f})")
            for name, x in cell["best_static_vs_reference"].items():
                lines.append(f"- tokens/s, best static γ, {name} (γ={x['gamma']}) vs {ref} (γ={x['reference_gamma']}): "
                             f"{_ci(x)}; faster in {x['rounds_faster']}/{cell['rounds']} rounds")
            for name, per in cell.get("same_gamma_vs_reference", {}).items():
                lines.append(f"- tokens/s at the same γ, {name} vs {ref}: "
                             + ", ".join(f"γ={g}: {_ci(x)}" for g, x in per.items()))
            for name, lin in cell.get("costs", {}).items():
                if lin and lin.get("c") is not None:  # one γ alone fits no step cost (step_ms 0): no c
                    lines.append(f"- fitted costs of {name}: {lin['step_ms']:.2f} ms a target pass (a step's fixed cost), "
                                 f"{lin['draft_ms']:.2f} ms a drafted token: c = {lin['c']:.3f}")
        lines.append("")
    return lines
