"""The engine's measurement pages: today's engine against an older commit's (:mod:`ldlp.bench.measurements.at_ref`) and
the attention routes, kernels and scaling at real prompt lengths (:mod:`ldlp.bench.measurements.attention`)."""

from __future__ import annotations

from ldlp.bench.measurements.attention import ROUTES


def at_ref_markdown(rows: list[dict], meta: dict) -> str:
    """The page of :func:`ldlp.bench.measurements.at_ref.compare`'s rows."""
    lines = [f"# This engine against the engine at {meta['ref']}", "",
             f"model: {meta['model']}, dtype: {meta['dtype']}, threads: {meta['threads']}, cpu: {meta['cpu']}, "
             f"{meta['max_new_tokens']} new tokens a prompt, {meta['rounds']} rounds in turns", "",
             f"Command: `{meta['command']}`", "",
             "Generated tokens per process CPU-second (median over rounds) and the paired ratio, today over the ref, "
             "with its bootstrap 95% interval over the rounds (> 1: today is faster).", "",
             "| prompt set | C | γ | today | ref | today / ref | 95% interval | greedy outputs agree |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        ci = "–" if r["ci95"] is None else f"{r['ci95'][0]:.2f}–{r['ci95'][1]:.2f}"
        lines.append(f"| {r['set']} | {r['concurrency']} | {r['gamma']} | {r['today_tokens_per_cpu_s']:.1f} | "
                     f"{r['ref_tokens_per_cpu_s']:.1f} | {r['ratio']:.2f} | {ci} | {'yes' if r['outputs_agree'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def attention_markdown(result: dict) -> str:
    """The page: the routes per dtype and set, then the engine's scaling per set."""
    m = result["meta"]
    lines = ["# The engine at real prompt lengths", "",
             f"model: {m['model']}, threads: {m['threads']}, cpu: {m['machine'].get('cpu')} "
             f"(bf16 matmuls in hardware: {m['machine'].get('cpu_bf16')}), torch {m['machine'].get('torch')}", "",
             f"Command: `{m['command']}`", "",
             "## Attention routes of one decoding step (all layers, one new token a row)", "",
             "Median process-CPU ms, interleaved; `gather`/`copy` are the retired route (every row's K/V prefix "
             "copied, attention over the longest context); `per_row` and `dense` are the engine's (views of the "
             "cache); `per_row_qkT` is `per_row` with its scores as q @ kᵀ over the cache's transposed view, the "
             "engine's form before its bfloat16 one (the same code in float32). MB: the K/V the retired route "
             "copies a step.", ""]
    routes = [r for r in ROUTES if any(r in row["ms"] for x in result["routes"] for row in x["rows"])]
    lines += ["| dtype | prompt set | R | mean / max context | " + " | ".join(routes) + " | MB copied | retired / per_row |",
              "|---|---|---:|---|" + "---:|" * (len(routes) + 2)]
    for x in result["routes"]:
        for row in x["rows"]:
            ms = row["ms"]
            cells = " | ".join(f"{ms[r]:.2f}" if r in ms else "–" for r in routes)
            retired = min(ms["gather"], ms["copy"]) if row["slots"] > 1 else ms["copy"]
            lines.append(f"| {x['dtype']} | {x['set']} | {row['slots']} | {row['mean_context']:.0f} / {row['max_context']} "
                         f"| {cells} | {row['copied_mb']:.0f} | {retired / ms['per_row']:.2f}× |")
    errs = {e for x in result["routes"] for row in x["rows"] for e in row["errors"].values()}
    if errs:
        lines += ["", "Routes that did not run: " + "; ".join(sorted(errs))]
    lines += ["", "## Linear kernels (one layer's projections at M tokens)", "",
              "Median process-CPU ms; same bits alone: a row scored alone (M = 1) gets the bits it gets inside M rows.", "",
              "`engine (fused)`: the engine's calls, q/k/v fused into one matmul and gate/up into another, each routed "
              "on the route `Projection` takes (one kernel at every M, padded to its invariant rows); fused = same bits: its outputs equal one call a projection's.", "",
              "| dtype | M | F.linear | oneDNN | oneDNN packed | engine (fused) | F.linear / oneDNN | F.linear / packed "
              "| F.linear / engine | same bits alone (F.linear, oneDNN, packed) | fused = same bits |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for x in result.get("linear", []):
        for r in x["rows"]:
            ms, same, base = r["ms"], r["same_bits_alone"], r["ms"]["F.linear"]
            cells = [ms.get(k) for k in ("onednn", "onednn_packed", "engine_fused")]
            times = " | ".join("–" if c is None else f"{c:.3f}" for c in cells)
            speed = " | ".join("–" if c is None else f"{base / c:.2f}×" for c in cells)
            lines.append(f"| {x['dtype']} | {r['tokens']} | {base:.3f} | {times} | {speed} | "
                         f"{same.get('F.linear')}, {same.get('onednn', '–')}, {same.get('onednn_packed', '–')} | "
                         f"{r.get('fused_same_bits', '–')} |")
    if result.get("elementwise"):
        lines += ["", "## Elementwise ops (one layer's norms, rotary and SiLU-and-multiply at M tokens)", "",
                  "Median process-CPU ms; `engine`: torch's fused rms_norm and q, k turned in one pass; `compiled`: "
                  "the eager functions through torch.compile(dynamic=True); same bits: equal to eager's.", "",
                  "| dtype | M | eager | engine | compiled | eager / engine | eager / compiled | same bits (engine, compiled) |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for x in result["elementwise"]:
            for r in x["rows"]:
                ms, same = r["ms"], r["same_bits"]
                comp = ms.get("compiled")
                comp_ms, comp_x = ("–", "–") if comp is None else (f"{comp:.3f}", f"{ms['eager'] / comp:.2f}×")
                lines.append(f"| {x['dtype']} | {r['tokens']} | {ms['eager']:.3f} | {ms['engine']:.3f} | {comp_ms} | "
                             f"{ms['eager'] / ms['engine']:.2f}× | {comp_x} | "
                             f"{same.get('engine')}, {same.get('compiled', '–')} |")
        secs = [f"{x['dtype']} {x['compile_s']:.0f} s" for x in result["elementwise"] if x.get("compile_s") is not None]
        if secs:
            lines += ["", "torch.compile's first call (the compile): " + ", ".join(secs) + "."]
    lines += ["", f"## Batched AR against C ({m['dtype']}, {m['max_new_tokens']} new tokens a prompt)", "",
              "Generated tokens per process CPU-second (one thread: the compute spent), with the prefill's share "
              "of the engine's time (prefill in its own forward here) and the tokens per CPU-second of decoding "
              "alone. Scaling: over C = 1.", "",
              "| prompt set | mean prompt tokens | C | tokens / CPU-s | scaling | prefill share | decode tokens / CPU-s | decode scaling |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result["scaling"]:
        base = s["rows"][0]
        for r in s["rows"]:
            lines.append(f"| {s['set']} | {s['mean_prompt_tokens']:.0f} | {r['concurrency']} | {r['tokens_per_cpu_s']:.1f} "
                         f"| {r['tokens_per_cpu_s'] / base['tokens_per_cpu_s']:.2f}× | {r['prefill_share']:.0%} "
                         f"| {r['decode_tokens_per_cpu_s']:.1f} "
                         f"| {r['decode_tokens_per_cpu_s'] / base['decode_tokens_per_cpu_s']:.2f}× |")
    return "\n".join(lines) + "\n"


def cpu_line(machine: dict) -> str:
    """The CPU a run ran on, its bfloat16 matmuls and torch's version, in a few words."""
    bf16 = {True: "bf16 matmuls in hardware", False: "bf16 matmuls emulated", None: "bf16 support unknown"}
    return f"{machine['cpu']} ({bf16[machine.get('cpu_bf16')]}, torch {machine['torch']})"


def retired_loop_markdown(rows: list[dict], meta: dict, command: str) -> str:
    """The page of scripts/bench_retired_loop.py: the engine against the retired batch-1 loop, per static γ and
    clock, and the outputs that leave the target's greedy decoding."""
    md = [f"# Batch 1: the engine against the retired batch-1 loop (git {meta['ref']})", "",
          f"{meta['model']} ({meta['dtype']}), {meta['prompts']} prompts x {meta['max_new_tokens']} new tokens, "
          f"greedy, {meta['rounds']} interleaved rounds, {meta['threads']} thread(s), on "
          f"{cpu_line(meta['machine'])}. Ratio: engine tokens/s over the "
          "retired loop's, with a paired bootstrap 95% interval over (round, prompt); by wall clock and by the "
          "process's CPU seconds (which other jobs on a shared machine do not inflate). Greedy tokens are compared with each other and with the target's own greedy "
          "decoding through transformers (`TargetModel.reference_greedy`).", "",
          "| static γ | clock | engine tok/s | retired loop tok/s | ratio | 95% interval | same tokens | "
          "engine = target greedy | retired loop = target greedy |",
          "|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    md += [f"| {r['gamma']} | {k} | {r[k]['engine_tokens_per_s']:.1f} | {r[k]['retired_loop_tokens_per_s']:.1f} | "
           f"{r[k]['ratio']:.3f} | {r[k]['ci95'][0]:.3f}-{r[k]['ci95'][1]:.3f} | {r['same_tokens']}/{r['generations']} | "
           f"{r['engine_lossless']}/{r['generations']} | {r['retired_loop_lossless']}/{r['generations']} |"
           for r in rows for k in ("wall", "cpu")]
    diffs = [(r["gamma"], d) for r in rows for d in r["differences"]]
    if diffs:
        md += ["", "Outputs that leave the target's greedy decoding, each at its first differing token: the target's "
               "top-2 logit gap there (the reference prefix in one forward) against the dtype's spacing at the top "
               "logit; a near-tie is a gap within two spacings, where rounding alone can flip the argmax.", "",
               "| static γ | side | prompt | token | reference / got | top-2 gap | spacing | near-tie |",
               "|---:|---|---:|---:|---|---:|---:|---|"]
        def num(x):
            return "–" if x is None else f"{x:.5f}"

        md += [f"| {g} | {d['side']} | {d['prompt']} | {d['position']} | {d.get('ref_token')} / {d.get('got_token')} | "
               f"{num(d['gap'])} | {num(d['spacing'])} | {'yes' if d['near_tie'] else 'NO'} |" for g, d in diffs]
    md += ["", f"Command: `{command}` (at git {meta['commit']})"]
    return "\n".join(md) + "\n"


def target_costs_markdown(rows: list[dict], lengths: list[int]) -> str:
    """scripts/bench_target.py's table: per dtype and attention, the median ms of a forward at each T, the
    ratio of the longest to T = 1, and the batch-invariance check."""
    T_max = max(lengths)
    lines = ["| dtype | attention | " + " | ".join(f"T={T}" for T in lengths) + f" | T={T_max} / T=1 "
             "| verification logits bitwise equal to decoding's | argmax flips |",
             "|---|---|" + "---:|" * (len(lengths) + 3)]
    for r in rows:
        ms = r["ms"]
        lines.append(f"| {r['dtype']} | {r['attn_implementation']} | " + " | ".join(f"{ms[T]:.2f}" for T in lengths)
                     + f" | {ms[T_max] / ms[1]:.2f} | {r['bitwise_equal']}/{r['positions']} | {r['argmax_flips']} |")
    return "\n".join(lines)


def tree_ranks_markdown(result: dict) -> str:
    """scripts/bench_tree_ranks.py's table: per rank of the drafter's choice, how often the target kept it."""
    lines = ["| rank | tested | kept | rate |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['rank']} | {r['tested']} | {r['kept']} | {r['rate']:.3f} |" for r in result["by_rank"] if r["tested"]]
    return "\n".join(lines)
