"""The load sweep's page and plots (``batch_bench.md``, ``batch_bench.png``, ``batch_bench_ratio.png``) and the
files of its results folder (:func:`write`), written from the rows of ``ldlp.bench.comparisons.load_aggregate`` (the
peer section from ``ldlp.bench.comparisons.peer_rows``, the step-cost sections by ``ldlp.report.step_costs``); and the
cost check's table (:func:`check_markdown`). Nothing here measures: every number is a row's.

    python scripts/bench_batch.py render_only=true out_dir=DIR   (the page and plots again, from DIR's JSON)
"""

from __future__ import annotations

from pathlib import Path

from eagle_backbone.io import atomic_write_json, atomic_write_text
from ldlp.bench.comparisons.load_aggregate import (
    BASELINES,
    ORACLES,
    category_table,
    findings,
    greedy_identity,
    latency_rows,
    policy_shares,
    ratio_rows,
    read_result,
    rows_at,
    run_status,
    runs_record,
    saved_rows,
    step_rows,
    temperatures_of,
    throughput_table,
    verdicts,
)
from ldlp.bench.comparisons.peer_rows import peer_table, versus_static
from ldlp.report import step_costs as step_cost_page
from ldlp.report.figures import pyplot, save_figure
from ldlp.report.memory import memory_line, plot_memory
from ldlp.report.serving import learner_table

BASELINE_TITLES = {"ar": "batched AR", "best_static": "best static γ at (C, T)",
                   "batch1_static": "batch-1 best static γ", "oracle": "oracle"}
OUTPUT_FILES = ("batch_bench.json", "batch_bench_runs.json", "batch_bench.md", "batch_bench.png",
                "batch_bench_ratio.png", "step_costs.json", "step_costs.png", "step_costs_by_gamma.png", "memory.png")


def _fmt(x, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def ratio_cell(v: dict | None) -> str:
    """A paired ratio as "1.052 (0.981–1.123)", with * when its interval does not resolve 5% (half-width
    above 0.05), or the ratio alone and its pair count when there are too few pairs for an interval."""
    if not v:
        return "–"
    if v.get("ci95") is None:
        return f"{v['ratio']:.3f} ({v['pairs']} pair)"
    lo, hi = v["ci95"]
    return f"{v['ratio']:.3f} ({lo:.3f}–{hi:.3f})" + ("" if v["resolves_5pct"] else "*")


def verdict_text(tally: dict) -> str:
    """A :func:`~ldlp.bench.comparisons.load_aggregate.verdict_tally` in words: "2 faster, 1 tied, 1 without interval;
    2/3 resolve 5%"."""
    text = ", ".join(f"{k} {v}" if k == "without interval" else f"{v} {k}" for k, v in tally["counts"].items() if v)
    n = tally["with_interval"]
    return (text or "none") + (f"; {tally['resolve_5pct']}/{n} resolve 5%" if n else "")


def status_line(result: dict) -> str:
    """The page header's first line: whether the run finished every round, or how far a stopped one got."""
    s = run_status(result)
    done, total = s["rounds_done"], s["rounds"]
    of = f" of {total}" if total is not None else ""
    if s["complete"]:
        return f"Status: complete ({done:g}{of} rounds)."
    return (f"Status: **incomplete**: {done:.2f}{of} rounds done (a checkpoint of a run that stopped or is still "
            "running; rows cover only the (T, C) cells measured so far).")


def _throughput_lines(rows: list[dict], metric: str) -> list[str]:
    t = throughput_table(rows, metric)
    lines = ["| contender | " + " | ".join(f"C={C}" for C in t["concurrency"]) + " |",
             "|---|" + "---:|" * len(t["concurrency"])]
    for line in t["rows"]:
        cells = []
        for c in line["cells"].values():
            if c is None:
                cells.append("–")
                continue
            cell = f"{c['value']:.1f}" + (f" (×{c['vs_ar']:.2f})" if c["vs_ar"] is not None else "")
            cells.append(f"**{cell}**" if c["best"] else cell)
        lines.append(f"| {line['contender']} | " + " | ".join(cells) + " |")
    return lines


def _findings_lines(rows: list[dict], metric: str, unit: str) -> list[str]:
    f = findings(rows, metric)
    lines = []
    if "ar_c16_over_c1" in f:
        lines.append(f"Batched AR at C=16 gives {f['ar_c16_over_c1']:.2f}× the {unit} of C=1.")
    best = ", ".join(f"C={C}: γ={b['gamma']} ({100 * b['gain_over_ar']:+.0f}%)" for C, b in f["best_static"].items()
                     if b["gain_over_ar"] is not None)
    if best:
        lines.append(f"Best static γ per C and its gain over batched AR: {best}.")
    for lab, per_c in f.get("oracle_headroom", {}).items():
        cells = []
        for C, h in sorted(per_c.items()):
            paired = h.get("paired")
            cells.append(f"C={C}: {100 * h['gain_over_best_static']:+.0f}% over γ={h['best_static_gamma']}"
                         + (f" (paired {ratio_cell(paired)})" if paired else ""))
        kind = ORACLES[next(iter(per_c.values()))["policy"]]
        lines.append(f"Headroom: the {kind} ({lab}) over the best static γ per C, in {unit}: {'; '.join(cells)}.")
    if f.get("headroom_share"):
        lines.append("Share of that headroom each adaptive contender captures, (contender − best static γ) / "
                     "(batched oracle − best static γ), per C where the oracle gains: " + "; ".join(
                         f"{lab} " + ", ".join(f"C={C}: {100 * v:+.0f}%" for C, v in sorted(per_c.items()))
                         for lab, per_c in f["headroom_share"].items()) + ".")
    return lines


def _baseline_lines(rows: list[dict]) -> list[str]:
    """The baselines per C and every adaptive contender's paired ratios to them (``rows``: one temperature's)."""
    f = findings(rows)
    adaptive = ratio_rows(rows)
    if not f.get("baselines"):
        return []
    g = lambda b: f" γ={b['gamma']}" if b.get("gamma") is not None else ""  # noqa: E731
    lines = ["", "Baselines per C (tokens/s; the static γ each picks):", "",
             "| C | " + " | ".join(BASELINE_TITLES[k] for k in BASELINES) + " |", "|---:|" + "---:|" * len(BASELINES)]
    for C, v in f["baselines"].items():
        lines.append(f"| {C} | " + " | ".join(
            f"{v[k]['tokens_per_s']:.1f}" + (f" (γ={v[k]['gamma']})" if v[k].get("gamma") not in (None, 0) else "")
            if k in v else "–" for k in BASELINES) + " |")
    if not adaptive:
        return lines
    pairs = sorted({v["pairs"] for r in adaptive for v in r["vs"].values()})
    lines += ["", (f"Paired ratios of tokens/s (contender / baseline; > 1: faster) over the (round, block) workloads "
                   f"each ran in turns ({', '.join(map(str, pairs))} pairs), with the paired bootstrap 95% interval; "
                   "*: the interval's half-width exceeds 0.05, so it does not resolve a 5% difference. The best "
                   "static γ is chosen in hindsight on these same runs (the strictest baseline)."), "",
              "| contender | C | tokens/s | τ | vs " + " | vs ".join(BASELINE_TITLES[k] for k in BASELINES) + " |",
              "|---|---:|---:|---:|" + "---:|" * len(BASELINES)]
    for r in adaptive:
        cells = []
        for k in BASELINES:
            v = r["vs"].get(k)
            cells.append(ratio_cell(v) + (g(v) if v and k in ("best_static", "batch1_static") else ""))
        lines.append(f"| {r['contender']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['tau']:.2f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Against the best static γ at each C (95% interval): " + "; ".join(
        f"{lab}: " + verdict_text(t) for lab, t in verdicts(rows).items()) + "."]
    return lines


def _step_lines(rows: list[dict]) -> list[str]:
    """Per contender and C: tokens/s, τ, target-scored tokens per engine step (all rows, and per running row)
    and running rows per step from the timed runs; verify and draft milliseconds per step from the profiled
    pass (``rows``: one temperature's)."""
    have = step_rows(rows)
    if not have:
        return []
    prof = next((r["profile"] for r in have if r.get("profile")), None)
    lines = ["", ("Per engine step: target-scored tokens (each running sequence's drafts, or scored tree nodes, "
                  "plus its last token) per step over all rows and per running row, and running rows per step, "
                  "from the timed runs (first round); verify and draft milliseconds per step from "
                  + (f"an untimed profiled pass on one block ({prof['n_prompts']} prompts) after the timed rounds "
                     "(verify: the target's forward, joined prompts' prefill rows included, acceptance and "
                     "bookkeeping up to the step's read)." if prof else "a profiled pass (profile_steps=true; not run).")),
             "", "| contender | C | tokens/s | τ | scored / step | scored / row-step | rows / step | verify ms / step "
                 "| draft ms / step |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in have:
        lines.append(f"| {r['contender']} | {r['concurrency']} | {_fmt(r.get('tokens_per_s'), '.1f')} | "
                     f"{_fmt(r.get('tau'))} | {_fmt(r.get('scored_per_step'), '.1f')} | "
                     f"{_fmt(r.get('scored_per_row_step'))} | {_fmt(r.get('rows_per_step'), '.1f')} | "
                     f"{_fmt(r.get('verify_ms_per_step'))} | {_fmt(r.get('draft_ms_per_step'))} |")
    return lines


def _peer_lines(result: dict, rows: list[dict]) -> list[str]:
    """The peer engine's section (:func:`~ldlp.bench.comparisons.peer_rows.peer_table`; [] without peer rows)."""
    table = peer_table(result, rows)
    if not table:
        return []

    def fmt(r, what=""):
        if r is None:
            return "–"
        note = (what.strip() + ", ") if what else ""
        return f"{r['tokens_per_s']:.1f} ({note}τ {r['tau']:.2f})"

    def cell(v):
        if not v:
            return "–"
        return f"{v['ratio']:.2f}" if v.get("ci95") is None else f"{v['ratio']:.2f} ({v['ci95'][0]:.2f}–{v['ci95'][1]:.2f})"

    lines = ["", ("Peer engine (vLLM, same prompts, budget, stops and rounds, run in turns): tokens/s and τ; the "
                  "ratios are this engine's tokens/s over vLLM's, paired over the (round, block) workloads both "
                  "ran, with the bootstrap 95% interval (> 1: this engine is faster). Lossless: every vLLM output is the "
                  "target's own greedy output; where not, the differing sequences (first difference per contender, "
                  "C and prompt), the near-ties among them, and whether vLLM's EAGLE rows leave where vLLM's AR "
                  "does (vLLM's kernels may round a near-tie the other way in bfloat16)."), "",
             "| C | vLLM AR | vLLM EAGLE, best k | this engine, AR | this engine, best static γ | "
             "ours / vLLM, AR | ours / vLLM, speculative | lossless (vLLM rows) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in table:
        ok = "–" if p["lossless"] is None else ("yes" if p["lossless"] else "**no**")
        d = p.get("differences")
        if d and not p["lossless"]:  # where the peer's outputs leave the target's: near-ties, and its own AR's?
            ok += (f": {d['differing']} differ, {d['near_ties']} near-ties"
                   + ("" if d["as_ar"] is None else ", as vLLM AR's" if d["as_ar"] else ", **not as vLLM AR's**"))
        k = f" {p['peer_best']['contender'].removeprefix('vllm ')}" if p["peer_best"] else ""  # e.g. "eagle3 k=3"
        g = f" γ={p['best_static']['gamma']}" if p["best_static"] else ""
        lines.append(f"| {p['concurrency']} | {fmt(p['peer_ar'])} | {fmt(p['peer_best'], k)} | {fmt(p['ar'])} | "
                     f"{fmt(p['best_static'], g)} | {cell(p['ratio_ar'])} | {cell(p['ratio_speculative'])} | {ok} |")
    return lines


def _schedule_lines(result: dict, rows: list[dict]) -> list[str]:
    """vLLM with a Dynamic SD schedule against vLLM's static k of its method (docs/vllm_schedule.md)."""
    labels = list(dict.fromkeys(r["contender"] for r in rows if r["policy"] == "vllm" and " schedule " in r["contender"]))
    lines = []
    for lab in labels:
        method = lab.split()[1]
        statics = list(dict.fromkeys(r["contender"] for r in rows if r["contender"].startswith(f"vllm {method} k=")))
        vs = versus_static(result, rows, lab, statics)
        if not vs or not statics:
            continue
        lines += ["", (f"{lab} (vLLM's Dynamic SD) against vLLM's static k: paired ratios of tokens/s (schedule / static) "
                       f"over the (round, block) workloads, wall clock; the single static best over the sweep: "
                       f"{vs['single']}."), "",
                  "| C | schedule tokens/s | best static k here | schedule / it | schedule / single best |",
                  "|---:|---:|---|---:|---:|"]
        for r in vs["rows"]:
            b = r["best"]
            lines.append(f"| {r['concurrency']} | {r['mine']['tokens_per_s']:.1f} | "
                         f"{b['contender'] if b else '–'} ({_fmt(b['tokens_per_s'] if b else None, '.1f')}) | "
                         f"{ratio_cell(r['ratio_best'])} | {ratio_cell(r['ratio_single'])} |")
    return lines


def _category_lines(rows: list[dict]) -> list[str]:
    """τ and mean request latency per prompt category, one row per (contender, C), when there are two or more."""
    t = category_table(rows)
    if t is None:
        return []
    lines = ["", ("Per prompt category (prompts in each): τ and mean request latency in ms. Every category's "
                  "sequences share the batch's steps, so tokens/s is the batch's, above."), "",
             "| contender | C | " + " | ".join(f"{c} ({n})" for c, n in t["categories"].items()) + " |",
             "|---|---:|" + "---:|" * len(t["categories"])]
    for r in t["rows"]:
        cells = [(f"{v['tau']:.2f} / {v['request_latency_ms_mean']:.0f}" if v else "–") for v in r["cells"].values()]
        lines.append(f"| {r['contender']} | {r['concurrency']} | " + " | ".join(cells) + " |")
    return lines


def _latency_lines(rows: list[dict]) -> list[str]:
    lines = ["", "Latencies (wall clock, median over rounds) of batched AR and of the best static γ (tokens/s):", "",
             ("| C | best static γ | AR token gap ms (mean/p90) | best-γ token gap ms (mean/p90) | "
              "AR request ms (mean/p90) | best-γ request ms (mean/p90) |"), "|---:|---:|---:|---:|---:|---:|"]
    for x in latency_rows(rows):
        ar, br = x["ar"], x["best"]
        lines.append(f"| {x['concurrency']} | {x['gamma']} | {ar['token_latency_ms_mean']:.1f} / {ar['token_latency_ms_p90']:.1f} | "
                     f"{br['token_latency_ms_mean']:.1f} / {br['token_latency_ms_p90']:.1f} | "
                     f"{ar['request_latency_ms_mean']:.0f} / {ar['request_latency_ms_p90']:.0f} | "
                     f"{br['request_latency_ms_mean']:.0f} / {br['request_latency_ms_p90']:.0f} |")
    return lines


def _identity_lines(result: dict, rows: list[dict]) -> list[str]:
    g = greedy_identity(rows, result.get("differences", []))
    if g is None:
        return []
    lines = ["", (f"Greedy identity with each prompt's own greedy output from the target (transformers' "
                  f"forward): {g['identical']}/{g['sequences']} sequences "
                  f"(worst round per row); rows not fully identical: {g['lossy_rows']}.")]
    if g["differing"]:
        lines += [(f"Differing sequences: {g['differing']}, of which near-ties (top-2 gap within 2 spacings of the "
                   f"dtype at the first difference): {g['near_ties']}. Largest gap: {g['largest_gap']:.4g}.")]
    return lines


def _temperature_section(result: dict, rows: list[dict]) -> list[str]:
    lines = [("Generated tokens per wall-clock second (median over rounds; each round's blocks summed); **bold**: "
              "the best static γ at that C; (×N): ratio to batched AR at the same C."), ""]
    lines += _throughput_lines(rows, "tokens_per_s") + [""] + _findings_lines(rows, "tokens_per_s", "tokens/s")
    lines += _baseline_lines(rows)
    lines += _step_lines(rows)
    lines += _peer_lines(result, rows)
    lines += _schedule_lines(result, rows)
    if any(r.get("tokens_per_cpu_s") for r in rows):
        lines += ["", ("The same runs in generated tokens per CPU-second of the benchmark process (one thread): other "
                       "jobs on a shared machine stretch wall time far more than they stretch this."), ""]
        lines += _throughput_lines(rows, "tokens_per_cpu_s") + [""] + _findings_lines(rows, "tokens_per_cpu_s",
                                                                                          "tokens per CPU-second")
    lines += _latency_lines(rows)
    lines += _identity_lines(result, rows)
    lines += _category_lines(rows)
    return lines


def markdown(result: dict, meta: dict | None = None) -> str:
    """The page: status and settings, skipped contenders and cost tables, a section per temperature, the
    policies' own time and the step-cost sections."""
    rows = result["rows"]
    ts = temperatures_of(rows)
    lines = ["# Batched speculative decoding: tokens/s against concurrency", "", status_line(result), ""]
    if meta:
        lines += [", ".join(f"{k}: {v}" for k, v in meta.items()), ""]
        lines += _skipped_records_lines(meta)
        lines += _drain_lines(meta)
    lines += [m, ""] if (m := memory_line(result.get("memory"))) else []  # a long run's memory: peak, growth
    for s in result.get("skipped", []):
        at = "" if s.get("temperature") is None else f" at T={s['temperature']:g}"
        lines += [f"Skipped {s['contender']}{at}: {s['why']}.", ""]
    for lab, t in (result.get("cost_tables") or {}).items():
        lines += [f"Cost table of {lab}: {t.get('path')} (key: {t.get('key')}).", ""]
    if len(ts) == 1:
        lines += _temperature_section(result, rows)
    for t in ts if len(ts) > 1 else []:
        lines += ["", f"## Temperature {t:g}" + (" (greedy)" if t == 0 else ""), ""]
        lines += _temperature_section(result, rows_at(rows, t))
    shares = policy_shares(rows)
    if shares:
        lines += ["", "## The policies' own time", "",
                  "Seconds inside the policy's own calls (plan, stop codes after each draft depth, observation; timed "
                  "by the engine around each call) over the run's wall seconds, worst (C, T) per contender:", ""]
        for lab, worst in shares.items():
            lines.append(f"- {lab}: {100 * worst['policy_share']:.2f}% (C={worst['concurrency']}, "
                         f"T={worst['temperature']:g})")
    lines += _learner_lines(result)
    lines += step_cost_page.markdown_lines(result)
    lines += step_cost_page.decomposition_lines(rows)
    return "\n".join(lines) + "\n"


def _skipped_records_lines(meta: dict) -> list[str]:
    """The malformed records of the prompt file that ``data.on_error=skip`` dropped, stated on the page."""
    k = int(meta.get("n_skipped_records") or 0)
    return [f"**{k} malformed record{'s' if k != 1 else ''} of the prompt file skipped** (data.on_error=skip; the "
            "log names the first).", ""] if k else []


DRAIN_WAVES = 8  # a block of fewer than this many waves of C prompts is flagged (results/embedded/load_sweep_blocks)


def _drain_lines(meta: dict) -> list[str]:
    """A warning where a block holds fewer than :data:`DRAIN_WAVES` waves of C prompts: its tail is a batch draining
    (the sequences that finish early leave near-empty steps), which a server whose freed slots refill does not see.
    Measured: the batched oracle at 0.96 of the best static γ with 2 waves at C = 32, 1.00 with 8."""
    prompts, blocks = meta.get("prompts"), meta.get("blocks")
    if not isinstance(prompts, int) or not isinstance(blocks, dict):
        return []
    thin = [(int(C), prompts // max(1, int(k))) for C, k in blocks.items()
            if prompts // max(1, int(k)) < DRAIN_WAVES * int(C)]
    if not thin:
        return []
    cells = ", ".join(f"C={C}: {n} prompts a block" for C, n in sorted(thin))
    return [f"Draining blocks: {cells}, fewer than {DRAIN_WAVES} waves of C, so the tail of each block runs in "
            "near-empty steps; a policy that lets some sequences run ahead (the batched oracle) pays for it there. "
            f"Hold {DRAIN_WAVES} or more times C prompts per block to measure serving (docs/batched.md, \"Why the "
            "batched oracle lost\").", ""]


def _learner_lines(result: dict) -> list[str]:
    """The goodput learners (ldlp/policies/goodput.py), one per cost-driven contender and T, kept across its runs:
    the best arm they measured per load bucket and the time their exploration cost."""
    learners = result.get("learners") or {}
    if not learners:
        return []
    lines = ["", "## Goodput feedback", "",
             "Each cost-driven contender's learner (one per T, kept across its runs as its step-cost model is): per "
             "load bucket (running rows) the arm of the best measured tokens/s (`plan`: the policy's own choice), and "
             "the share of the measured time lost to steps off it (exploration).", ""]
    return lines + learner_table(learners, schedule=False)


def check_markdown(rows: list[dict]) -> str:
    """The cost check's table (:func:`eagle_backbone.cost.check_costs`'s rows): measured against predicted step ms."""
    lines = ["| slots | γ | measured ms | predicted ms | error | tokens a row | tokens/ms measured | tokens/ms predicted |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['slots']} | {r['gamma']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
                     f"{100 * (r['predicted_ms'] / r['measured_ms'] - 1):+.0f}% | {r['tokens_per_row']:.2f} | "
                     f"{r['measured_tokens_per_ms']:.2f} | {r['predicted_tokens_per_ms']:.2f} |")
    return "\n".join(lines) + "\n"


# -- plots ---------------------------------------------------------------------------------------------------


def _log2_axis(ax, matplotlib, Cs):
    ax.set_xscale("log", base=2)
    ax.set_xticks(Cs)
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrency C (sequences in flight)")
    ax.grid(alpha=0.3)


def plot_tokens_per_s(result: dict, path: str | Path) -> Path:
    """Tokens/s against C, one line per contender, one panel per temperature (side by side, one y scale
    each), the best static γ at each C marked with a red star."""
    matplotlib, plt = pyplot()
    ts = temperatures_of(result["rows"])
    fig, axes = plt.subplots(1, len(ts), figsize=(7.5 if len(ts) == 1 else 5.6 * len(ts), 4.8), squeeze=False)
    for ax, t in zip(axes[0], ts):
        rows = rows_at(result["rows"], t)
        for lab in dict.fromkeys(r["contender"] for r in rows):
            xs = sorted((r["concurrency"], r["tokens_per_s"]) for r in rows if r["contender"] == lab)
            style = {"lw": 2.2, "color": "black"} if lab == "ar" else {"lw": 1.2, "alpha": 0.85}
            ax.plot([x for x, _ in xs], [y for _, y in xs], marker="o", ms=3, label=lab, **style)
        for C, b in findings(rows)["best_static"].items():
            ax.scatter([C], [b["tokens_per_s"]], marker="*", s=160, color="red", zorder=5)
            ax.annotate(f"γ={b['gamma']}", (C, b["tokens_per_s"]), textcoords="offset points", xytext=(4, 6), fontsize=8)
        _log2_axis(ax, matplotlib, sorted({r["concurrency"] for r in rows}))
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"T={t:g}" + (" (greedy)" if t == 0 else "") if len(ts) > 1 else
                     "Batched speculative decoding (red star: best static γ at each C)", fontsize=10)
        ax.legend(fontsize=7, ncol=2)
    if len(ts) > 1:
        fig.suptitle("Batched speculative decoding against concurrency (red star: best static γ at each C)", fontsize=11)
    return save_figure(fig, path)


def plot_ratios(result: dict, path: str | Path, baseline: str = "best_static") -> Path | None:
    """Each adaptive contender's paired ratio of tokens/s to ``baseline`` (default the best static γ at that
    (C, T)) against C, with its bootstrap 95% interval, one panel per temperature; None when no row has one."""
    rows = [r for r in result["rows"] if (r.get("vs") or {}).get(baseline)]
    if not rows:
        return None
    matplotlib, plt = pyplot()
    ts = [t for t in temperatures_of(result["rows"]) if any(r["temperature"] == t for r in rows)]
    fig, axes = plt.subplots(1, len(ts), figsize=(5.6 * len(ts), 4.4), squeeze=False, sharey=True)
    labels = list(dict.fromkeys(r["contender"] for r in rows))
    for ax, t in zip(axes[0], ts):
        for k, lab in enumerate(labels):
            pts = sorted((r["concurrency"], r["vs"][baseline]) for r in rows if r["temperature"] == t and r["contender"] == lab)
            if not pts:
                continue
            shift = 2 ** (0.04 * (k - (len(labels) - 1) / 2))  # side by side, so the intervals do not overlap
            x = [C * shift for C, _ in pts]
            y = [v["ratio"] for _, v in pts]
            err = [[v["ratio"] - v["ci95"][0] if v["ci95"] else 0 for _, v in pts],
                   [v["ci95"][1] - v["ratio"] if v["ci95"] else 0 for _, v in pts]]
            ax.errorbar(x, y, yerr=err, marker="o", ms=3, capsize=3, lw=1.2, label=lab)
        ax.axhline(1.0, color="black", lw=1)
        ax.axhspan(0.95, 1.05, color="grey", alpha=0.12, lw=0)
        _log2_axis(ax, matplotlib, sorted({r["concurrency"] for r in rows}))
        ax.set_title(f"T={t:g}" + (" (greedy)" if t == 0 else ""), fontsize=10)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(f"tokens/s / {BASELINE_TITLES[baseline]} (paired, 95% interval)")
    fig.suptitle(f"Adaptive policies against the {BASELINE_TITLES[baseline]} (grey: ±5%)", fontsize=11)
    return save_figure(fig, path)


# -- the results folder --------------------------------------------------------------------------------------


def write(result: dict, out_dir: str | Path, meta: dict | None = None, with_plot: bool = True,
          with_json: bool = True) -> Path:
    """batch_bench.json (:func:`~ldlp.bench.comparisons.load_aggregate.saved_rows`), batch_bench_runs.json
    (:func:`~ldlp.bench.comparisons.load_aggregate.runs_record`), batch_bench.md (its header says complete or not),
    step_costs.json (the costs measured in hindsight, where the run fitted them), and with ``with_plot``
    batch_bench.png, batch_bench_ratio.png (when a row has a ratio to the best static γ) and step_costs.png.
    Every file of :data:`OUTPUT_FILES` is rewritten or removed, so that a reused folder never keeps an older
    run's plot next to this run's tables; ``with_json=False`` (rendering a folder's page again from its JSON)
    leaves the JSON files as they are. Returns ``out_dir`` (:func:`written` lists what is there)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kept = [out / n for n in OUTPUT_FILES if n.endswith(".json") and not with_json]
    done = []
    if with_json:
        done.append(atomic_write_json(out / "batch_bench.json", saved_rows(result), indent=2))
        done.append(atomic_write_json(out / "batch_bench_runs.json", runs_record(result, meta), indent=2, default=str))
        if result.get("hindsight"):  # the costs measured in hindsight: rerun a policy with policy.cost_model=this file
            done.append(atomic_write_json(out / "step_costs.json", result["hindsight"], indent=2))
    done.append(atomic_write_text(out / "batch_bench.md", markdown(result, meta)))
    if with_plot and result["rows"]:
        done.append(plot_tokens_per_s(result, out / "batch_bench.png"))
        done.append(plot_ratios(result, out / "batch_bench_ratio.png"))
        done.append(step_cost_page.plot(result, out / "step_costs.png"))
        done.append(step_cost_page.plot_by_gamma(result, out / "step_costs_by_gamma.png"))
        done.append(plot_memory(result.get("memory"), out / "memory.png"))
    for name in OUTPUT_FILES:  # an older run's file this write did not replace
        if out / name not in done + kept:
            (out / name).unlink(missing_ok=True)
    return out


def written(out_dir: str | Path) -> list[str]:
    """The files of :data:`OUTPUT_FILES` that the last :func:`write` to ``out_dir`` left (it removes the rest)."""
    return [n for n in OUTPUT_FILES if (Path(out_dir) / n).is_file()]


def render(folder: str | Path) -> Path:
    """A results folder's page and plots written again from its JSON
    (:func:`~ldlp.bench.comparisons.load_aggregate.read_result`), the JSON left as it is: after a change to how they are
    written."""
    result, meta = read_result(folder)
    return write(result, folder, meta, with_json=False)
