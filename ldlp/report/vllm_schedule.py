"""The page of a tuned vLLM Dynamic SD schedule (``vllm_schedule.md``, ``scripts/tune_vllm_schedule.py``), written from
the tuning record of :func:`ldlp.bench.peers.vllm_tune.tune` and, where given, the held-out comparison of
:func:`ldlp.bench.peers.vllm_tune.heldout_comparison`. Nothing here measures: every number is the record's."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from eagle_backbone.io import atomic_write_text
from ldlp.bench.peers.vllm_schedule import schedule_tag


def ratio_text(v: dict | None) -> str:
    """A paired ratio as "1.052 (0.981–1.123)", or with its pair count when it has no interval."""
    if not v:
        return "–"
    if v.get("ci95") is None:
        return f"{v['ratio']:.3f} ({v['pairs']} pair)"
    lo, hi = v["ci95"]
    return f"{v['ratio']:.3f} ({lo:.3f}–{hi:.3f})"


def _f(x, spec=".1f") -> str:
    return "–" if x is None else format(x, spec)


def _why_lines(rec: dict) -> list[str]:
    ks = rec["ks"]
    lines = ["| range (batch sizes) | K | at batch size | expected tokens/s per K | runner-up | gain over it |",
             "|---|---:|---:|---|---:|---:|"]
    for w in rec["why"]:
        a, b, k = w["range"]
        for i, e in enumerate(w["ends"]):
            rates = {int(K): v for K, v in e["rates"].items()}
            cells = ", ".join((f"**{K}: {rates[K]:.0f}**" if K == k else f"{K}: {rates[K]:.0f}") for K in ks)
            note = "" if e["best_k"] == k else f" (best alone: K={e['best_k']}; within the margin)"
            rng = f"{a}–{b}" if i == 0 else ""
            gain = "–" if e["gain"] is None else f"{100 * e['gain']:+.1f}%"
            runner = "–" if e["runner_up"] is None else str(e["runner_up"])
            lines.append(f"| {rng} | {k if i == 0 else ''} | {e['batch']} | {cells}{note} | {runner} | {gain} |")
    return lines


def _acceptance_lines(rec: dict) -> list[str]:
    acc = rec["acceptance"]
    tps = {int(k): v for k, v in (rec.get("tokens_per_step") or {}).items()}
    lines = ["| position i | drafts reaching it | accepted | p_i = P(accepted length > i) | tokens per step at K = i + 1: "
             "steady state | for these output lengths |", "|---:|---:|---:|---:|---:|---:|"]
    tot = 1.0
    for i, (d, a, p) in enumerate(zip(acc["drafts"], acc["accepted"], acc["p"])):
        tot += p
        lines.append(f"| {i} | {d} | {a} | {p:.3f} | {tot:.3f} | {_f(tps.get(i + 1), '.3f')} |")
    n = rec.get("output_lengths") or []
    if n:
        lines += ["", f"Output lengths of the {len(n)} prompts: {min(n)}–{max(n)} tokens (mean {sum(n) / len(n):.1f}); "
                      "a request's last step stops at its budget, wasting the drafts past it, so the tuner prices K by "
                      "the tokens per step for these lengths (an exact recursion on the tokens left)."]
    return lines


def _step_lines(rec: dict) -> list[str]:
    m = rec["step_model"]
    coef = ", ".join(f"{k} {v:.3f}" for k, v in m["coef"].items())
    how = ("the fit scaled by the measured/fit ratio of the grid's cells (anchor: a grid C with 20+ steps), "
           "interpolated in log B between them" if rec.get("anchor") else
           "the fit alone, one model over every batch size and K (a cell's median moves by several percent between "
           "runs on a shared machine; the fit averages that)")
    lines = [f"ms = fixed + per_row · B + per_draft_forward · K + per_draft_token · B · K, fitted by non-negative least "
             f"squares to vLLM's traced steps that admit no prompt ({rec['step_time']} time, ms): {coef}. Per (B, K) "
             f"cell of steady steps (verifying K per request): the median step and the fit. The model is {how}.", "",
             "| B | K | steps | median ms | fit ms | measured / fit |" + (" anchor |" if rec.get("anchor") else ""),
             "|---:|---:|---:|---:|---:|---:|" + (":---:|" if rec.get("anchor") else "")]
    for c in sorted(m["cells"], key=lambda c: (c["k"], c["batch"])):
        ratio = f"{c['median_ms'] / c['fit_ms']:.2f}" if c["fit_ms"] else "–"
        lines.append(f"| {c['batch']} | {c['k']} | {c['steps']} | {c['median_ms']:.2f} | {c['fit_ms']:.2f} | {ratio} |"
                     + (f" {'yes' if c.get('anchor') else ''} |" if rec.get("anchor") else ""))
    return lines


def _grid_lines(rec: dict) -> list[str]:
    Cs = rec["concurrency"]
    grid = {(g["k"], g["concurrency"]): g for g in rec["grid"]}
    chosen = {row["batch"]: row["k"] for row in rec["choice"]["per_batch"]}
    best_measured = {C: max(rec["ks"], key=lambda K: grid[(K, C)]["tokens_per_cpu_s"] or 0) for C in Cs}
    lines = ["Tokens/s per K (rows) and C (columns): measured per wall-clock second / per CPU-second of vLLM's "
             "process (all calls of C prompts: prefill and the tail included; a shared machine stretches the wall "
             "clock, not the CPU time) / expected (steady state at batch size C, from the step model and the "
             "acceptance: no prefill, no tail, no work outside the engine's steps). **Bold**: the K the schedule "
             "gives batch size C; ↑: the fastest K at C per CPU-second.", "",
             "| K | " + " | ".join(f"C={C}" for C in Cs) + " |", "|---:|" + "---:|" * len(Cs)]
    for K in rec["ks"]:
        cells = []
        for C in Cs:
            g = grid.get((K, C))
            if g is None:
                cells.append("–")
                continue
            c = (f"{_f(g['tokens_per_s'], '.0f')} / {_f(g['tokens_per_cpu_s'], '.0f')} / "
                 f"{_f(g['expected_tokens_per_s'], '.0f')}" + (" ↑" if best_measured[C] == K else ""))
            cells.append(f"**{c}**" if chosen.get(C) == K else c)
        lines.append(f"| {K} | " + " | ".join(cells) + " |")
    if any(g.get("calibration") for g in rec["grid"]):
        lines += ["", "The choice's calibration: measured / expected at each (K, C) (the expected above is the model's):", "",
                  "| K | " + " | ".join(f"C={C}" for C in Cs) + " |", "|---:|" + "---:|" * len(Cs)]
        for K in rec["ks"]:
            lines.append(f"| {K} | " + " | ".join(_f(grid[(K, C)].get("calibration"), ".3f") if (K, C) in grid else "–"
                                                  for C in Cs) + " |")
    lines += ["", ("τ (tokens per request forward, the prefill's included) measured / expected from the acceptance by "
                   "position and the prompts' output lengths (a check of the acceptance model):"), "",
              "| K | " + " | ".join(f"C={C}" for C in Cs) + " |", "|---:|" + "---:|" * len(Cs)]
    for K in rec["ks"]:
        lines.append(f"| {K} | " + " | ".join(
            f"{_f(grid[(K, C)]['tau'], '.2f')} / {_f(grid[(K, C)].get('expected_tau'), '.2f')}" if (K, C) in grid else "–"
            for C in Cs) + " |")
    return lines


def _comparison_lines(vs: dict, what: str, unit: str) -> list[str]:
    single = vs["single"]
    lines = [f"| C | pairs | {what} tokens/s | best {unit} in hindsight | {what} / it (wall) | (CPU s) | "
             f"single best {unit} over the sweep: {single} | {what} / it (wall) | (CPU s) |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in vs["rows"]:
        b, one = r["best"], r["single"]
        lines.append(f"| {r['concurrency']} | {(r['ratio_best'] or {}).get('pairs', '–')} | {_f(r['mine']['tokens_per_s'])} | "
                     f"{b['contender'] if b else '–'} ({_f(b['tokens_per_s']) if b else '–'}) | "
                     f"{ratio_text(r['ratio_best'])} | {ratio_text(r['ratio_best_cpu'])} | "
                     f"{_f(one['tokens_per_s']) if one else '–'}{'' if r['single_is_best'] else ' (not the best here)'} | "
                     f"{ratio_text(r['ratio_single'])} | {ratio_text(r['ratio_single_cpu'])} |")
    return lines


def _goal_lines(g: dict | None, gc: dict | None) -> list[str]:
    if not g:
        return []

    def yes(x):
        return "met" if x else "**not met**"

    worst = min(g["best_in_hindsight"].items(), key=lambda kv: kv[1] if kv[1] is not None else 0)
    wrong = g["single_wrong_at"]
    gains = ", ".join(f"C={C}: {g['vs_single'][C]:.3f}" for C in wrong) or "none (it is the best everywhere)"
    below = min(g["vs_single"].values(), key=lambda v: v if v is not None else 0)
    cpu = (f" (CPU seconds: {yes(gc['floor_met'])}, {yes(gc['gain_met'])}, {yes(gc['never_below_met'])})"
           if gc else "")
    return [f"- ≥ 0.98× the best static in hindsight at every C: {yes(g['floor_met'])} (lowest {worst[1]:.3f} at "
            f"C={worst[0]}).",
            f"- ≥ +5% over the single best static ({g['single']}) where it is not the best: {yes(g['gain_met'])} ({gains}).",
            f"- never below that single static by more than 2%: {yes(g['never_below_met'])} (lowest {below:.3f}).",
            f"- by wall-clock paired ratios (point estimates){cpu}."]


def heldout_lines(h: dict, tuned_on: str) -> list[str]:
    m = h.get("meta") or {}
    lines = ["", f"### {h['folder']}", "",
             f"Tuned on **{tuned_on}**; evaluated on **{m.get('data', '?')}** ({m.get('prompts', '?')} prompts, "
             f"max_new_tokens {m.get('max_new_tokens', '?')}, {m.get('rounds', '?')} rounds, blocks per C "
             f"{m.get('blocks', '?')}), in `{h['folder']}` (its page: batch_bench.md). Every contender ran each "
             "(round, block) workload in turn; the ratios are paired over those workloads, with bootstrap 95% "
             "intervals, by wall clock and by the process's CPU seconds (steadier on a shared machine)."
             + ("" if h.get("complete") else " **The sweep is incomplete.**"), ""]
    for v in h["vllm"]:
        vs = v["comparison"]
        lines += [f"**vLLM: {vs['label']}** against vLLM's static k ({', '.join(vs['statics'])}):", ""]
        lines += _comparison_lines(vs, "schedule", "static k") + [""] + _goal_lines(v["goals"], v["goals_cpu"]) + [""]
    if h.get("engine"):
        e = h["engine"]
        vs = e["comparison"]
        lines += [f"**This engine: {vs['label']}** against its own static γ ({', '.join(vs['statics'])}), in the "
                  "same sweep:", ""]
        lines += _comparison_lines(vs, vs["label"], "static γ") + [""] + _goal_lines(e["goals"], e["goals_cpu"]) + [""]
    ok = ", ".join(f"{k}: {'yes' if v else '**no**'}" for k, v in h["lossless"].items())
    lines += [f"Greedy identity with the target's own greedy decoding (every sequence, every round): {ok}; every "
              f"row of the sweep: {'yes' if h['lossless_all'] else '**no**'}."]
    return lines


def learned_lines(rec: dict, learned: dict) -> list[str]:
    """This page's schedule beside each goodput learner's (a serving run's, :func:`ldlp.bench.peers.vllm_schedule.
    learned_schedules`): the K each gives at every batch size."""
    from ldlp.bench.peers.vllm_schedule import dense_lookup

    if not learned:
        return []
    top = int(rec["max_batch"])
    sizes = [b for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if b <= top]
    mine = dense_lookup(rec["schedule"], top, int(rec["k_max"]))
    lines = ["", "## Beside the goodput learners' schedules", "",
             "The K at each batch size: this page's tuned schedule, and the best static γ per load bucket each goodput "
             f"learner measured while serving (`{next(iter(learned.values()))['source']}`; its "
             "`learned_schedule_*.json` run with `engine=vllm spec.schedule=FILE`). The learners measured this "
             "engine's steps, not vLLM's: where they agree, the two ways of choosing agree.", "",
             "| schedule | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---:|" * len(sizes),
             f"| tuned here (`{schedule_tag(rec['schedule'])}`) | " + " | ".join(str(mine[b - 1]) for b in sizes) + " |"]
    for label, sched in learned.items():
        k = max(x for _, _, x in sched["ranges"])
        dense = dense_lookup(sched["ranges"], top, k)
        lines.append(f"| learned: {label} (`{schedule_tag(sched['ranges'])}`) | "
                     + " | ".join(str(dense[b - 1]) for b in sizes) + " |")
    return lines


def markdown(rec: dict, heldout: list[dict] | dict | None = None, learned: dict | None = None) -> str:
    meta = rec.get("meta", {})
    snip = rec.get("snippet")
    lines = ["# vLLM Dynamic SD schedule, tuned on this machine", "",
             ", ".join(f"{k}: {v}" for k, v in meta.items()), ""]
    if rec.get("refit"):
        lines += [f"The schedule was chosen again from this run's traced steps and counters (`refit=true`: "
                  f"{rec['refit']}); nothing was measured again.", ""]
    lines += [
             f"Tuning: {rec['tuning_s']:.0f} s in all ({rec['workers_start_s']:.0f} s starting {len(rec['ks'])} vLLM "
             f"workers, {rec['grid_s']:.0f} s of grid: K ∈ {rec['ks']}, C ∈ {rec['concurrency']}, {rec['rounds']} "
             f"rounds, {rec['prompts_per_cell']} prompts per C at least, max_new_tokens {rec['max_new_tokens']}). "
             f"Schedule for batch sizes 1–{rec['max_batch']}, margin {rec['margin']:g}.", "",
             "## The schedule", "", "Paste into `speculative_config` (with your drafter as `model`; `schedule.json` "
             "and `schedule.yaml` beside this page hold the same):", "", "```yaml",
             yaml.safe_dump(snip, default_flow_style=None, sort_keys=False).rstrip(), "```", "",
             f"`{json.dumps(snip)}`", "",
             "## Why each range got its K", "",
             "At batch size B, K gives the expected tokens/s B · tokens(K) / step ms(B, K) (tokens per request and "
             "step: the acceptance below; step ms: the step model)"
             + (", scaled at each grid C to the throughput measured there (whole calls of C requests, per "
                f"{'CPU-' if rec['step_time'] == 'cpu' else 'wall-clock '}second) and between grid C by the scale "
                "interpolated in log B" if rec.get("calibrate") else "")
             + f". Every batch size takes a K within the margin "
             f"({100 * rec['margin']:g}%) of its best, with the fewest ranges, then the most expected tokens/s in all. "
             "At each range's first and last batch size:", ""]
    lines += _why_lines(rec)
    lines += ["", "## Acceptance by position (vLLM's own counters)", "",
              "From `vllm:spec_decode_num_accepted_tokens_per_pos` over every grid call (position i: drafts whose "
              "first i + 1 tokens were accepted), pooled over the K that reach it:", ""]
    lines += _acceptance_lines(rec)
    lines += ["", "## vLLM's step time", ""] + _step_lines(rec)
    lines += ["", "## Expected and measured tokens/s", ""] + _grid_lines(rec)
    lo = rec["lossless"]
    ref = ("" if lo["identical_to_greedy"] is None
           else f"; identical to the target's greedy decoding: {lo['identical_to_greedy']}/{lo['sequences']}")
    lines += ["", f"Outputs: {lo['sequences']} sequences; every K gave the same tokens for each prompt: "
                  f"{'yes' if lo['identical_across_k'] else '**no**'}{ref}."]
    heldout = [heldout] if isinstance(heldout, dict) else (heldout or [])
    if heldout:
        lines += ["", "## Held-out evaluation", "",
                  f"The schedule of this page: `{schedule_tag(rec['schedule'])}`. Each load sweep below ran its "
                  "contenders on prompts the tuner never saw; a schedule is named by its ranges."]
    for h in heldout:
        lines += heldout_lines(h, meta.get("data", "?"))
    lines += learned_lines(rec, learned or {})
    return "\n".join(lines) + "\n"


def write(rec: dict, out: str | Path, heldout: list[dict] | dict | None = None, learned: dict | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(out / "vllm_schedule.md", markdown(rec, heldout, learned))
