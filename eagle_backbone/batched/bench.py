"""The concurrency sweep behind ``scripts/bench_batch.py``: tokens/s and latencies of batched AR, static γ
and adaptive policies at concurrency C, on a continuous-batching workload, with greedy losslessness.

For every round, every C and every contender (their order rotating between rounds and C, so that a
slow phase of a shared machine hits all alike) the whole prompt set runs through
:func:`~eagle_backbone.batched.workload.run_workload` with C streams in flight. At C=1 today's batch-1
loop (``SpeculativeDecoder`` / ``autoregressive_generate``) runs interleaved with them at the same γ, for
the "no slower at batch 1" comparison. Rows report medians over rounds.

Greedy losslessness is checked against each prompt's own batch-1 autoregressive output. In bfloat16 a
batched matrix product may round differently from a one-row one; every differing sequence is then
reported with the target's top-2 logit gap at the first differing position (on the reference prefix),
next to bfloat16's spacing at that logit's magnitude: a difference is a near-tie when the gap is within it.

This module takes built models, prompts and policy factories; loading them from configs is the script's.
matplotlib is imported only to draw the plot.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_backbone.batched.engine import BatchedSpeculativeEngine
from eagle_backbone.batched.workload import run_workload
from eagle_backbone.engine import SpeculativeDecoder, autoregressive_generate
from eagle_backbone.io import atomic_path, atomic_write_json, atomic_write_text
from eagle_backbone.runtime import set_threads
from eagle_backbone.sampling import SamplingConfig

ROW_KEYS = ("contender", "engine", "policy", "gamma", "concurrency", "temperature", "tokens_per_s", "tokens_per_cpu_s",
            "token_latency_ms_mean", "token_latency_ms_p90", "request_latency_ms_mean", "request_latency_ms_p90",
            "tau", "lossless", "identical", "n_prompts", "new_tokens", "rounds", "speedup_vs_ar", "by_category")


@dataclass
class Contender:
    label: str  # "ar", "static γ=3", "heuristic", ...
    policy: str  # "ar", "static" or the policy's name
    gamma: int | None  # static γ; None when adaptive (and 0 for AR)
    make: Callable | None  # zero-argument policy factory (one instance per slot); None: AR


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _batch1(target, candidates, c: Contender, prompts, max_new, sampling, seed):
    """Today's batch-1 loop over the prompts, one after the other; (outputs, tokens/s, latencies)."""
    outs, gaps, req = [], [], []
    t0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        s0 = time.perf_counter()
        if c.make is None:
            o = autoregressive_generate(target, p, max_new, sampling=sampling, seed=seed + i)
        else:
            o = SpeculativeDecoder(target, candidates, c.make()).generate(p, max_new, sampling=sampling, seed=seed + i)
        req.append(time.perf_counter() - s0)
        steps = max(1, o.stats.target_forwards)
        gaps.append((req[-1], len(o.tokens), steps))
        outs.append(o)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = sum(len(o.tokens) for o in outs)
    # batch-1 tokens arrive a step at a time; the mean gap between a sequence's tokens is its time / tokens
    mean_gap = 1e3 * sum(r for r, _, _ in gaps) / max(1, sum(k - 1 for _, k, _ in gaps))
    summary = {"tokens_per_s": n / wall, "tokens_per_cpu_s": n / cpu, "token_latency_ms_mean": mean_gap, "token_latency_ms_p90": None,
               "request_latency_ms_mean": 1e3 * statistics.fmean(req), "new_tokens": n,
               "request_latency_ms_p90": 1e3 * sorted(req)[int(0.9 * (len(req) - 1))],
               "tau": n / sum(o.stats.target_forwards for o in outs)}
    return [o.tokens for o in outs], summary


def near_tie(target, prompt, ref, got) -> dict:
    """The target's top-2 logit gap at the first position where ``got`` leaves ``ref`` (one forward of
    the reference prefix, as plain decoding computes it), and the dtype's spacing at the top logit."""
    i = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    if i >= len(ref) or i >= len(got):
        return {"position": i, "gap": None, "spacing": None, "near_tie": False, "note": "length differs only"}
    with torch.inference_mode():
        logits, _ = target(torch.tensor([prompt + ref[:i]], device=target.device))
    top = torch.topk(logits[0, -1].float(), 2)
    gap = float(top.values[0] - top.values[1])
    bits = torch.finfo(target.dtype).nmant  # 7 for bfloat16, 23 for float32
    spacing = 2.0 ** (math.floor(math.log2(max(abs(float(top.values[0])), 1e-30))) - bits)
    return {"position": i, "ref_token": ref[i], "got_token": got[i], "gap": gap, "spacing": spacing,
            "near_tie": gap <= 2 * spacing}


def sweep(target, drafter, kind: str | None, prompts: list[list[int]], contenders: list[Contender],
          concurrency: list[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
          rounds: int = 2, seed: int = 0, batch1=True, candidates=None, attn: str = "eager",
          checkpoint: Callable[[dict], None] | None = None, log: Callable[[str], None] = print,
          categories: list | None = None) -> dict:
    """Run the sweep; returns {"rows": [...], "differences": [...], "runs": [...]} (``checkpoint`` gets the
    partial result after every round). ``batch1``: True (AR and every static γ), False, or a list of γ
    (0 = AR) to time with today's batch-1 loop at C=1 as well. ``categories`` (one per prompt, None where a
    prompt has none) adds each batched run's per-category counters and request latency (``by_category``)."""
    if categories is not None and len(categories) != len(prompts):
        raise ValueError(f"{len(categories)} categories for {len(prompts)} prompts: give one per prompt")
    sampling = sampling or SamplingConfig()
    if not prompts:
        raise ValueError("no prompts to benchmark")
    if not contenders or contenders[0].policy != "ar":
        raise ValueError("the first contender must be batched AR (policy 'ar')")
    bad = [c for c in concurrency if not isinstance(c, int) or c < 1]
    if bad:
        raise ValueError(f"concurrency values must be integers >= 1, got {bad}")
    capacity = max(len(p) for p in prompts) + max_new_tokens + 2
    seeds = [seed + i for i in range(len(prompts))]
    ref = None
    if sampling.greedy:
        log(f"reference: batch-1 autoregressive outputs of {len(prompts)} prompts")
        ref = [autoregressive_generate(target, p, max_new_tokens).tokens for p in prompts]
    # warm up kernels and allocators once per contender
    for c in contenders:
        e = BatchedSpeculativeEngine(target, drafter, kind, slots=2, policy=c.make, sampling=sampling,
                                     capacity=capacity, attn=attn)
        run_workload(e, prompts[:2], 2, min(8, max_new_tokens), seeds[:2])
    runs = []
    diffs = {}
    b1 = [c for c in contenders if c.policy in ("ar", "static")] if batch1 and candidates is not None else []
    if isinstance(batch1, (list, tuple)):
        b1 = [c for c in b1 if c.gamma in set(batch1)]
    for r in range(rounds):
        for ci, C in enumerate(concurrency):
            jobs = [("batched", c) for c in contenders] + ([("batch1", c) for c in b1] if C == 1 else [])
            k = (r + ci) % len(jobs)
            for engine_kind, c in jobs[k:] + jobs[:k]:
                if engine_kind == "batched":
                    eng = BatchedSpeculativeEngine(target, drafter, kind, slots=C, policy=c.make, sampling=sampling,
                                                   capacity=capacity, attn=attn)
                    res = run_workload(eng, prompts, C, max_new_tokens, seeds)
                    outs, summ = [o.tokens for o in res.outputs], res.summary()
                    if categories is not None and any(c is not None for c in categories):
                        summ["by_category"] = res.by_category(categories)
                else:
                    outs, summ = _batch1(target, candidates, c, prompts, max_new_tokens, sampling, seed)
                same = None
                if ref is not None:
                    same = [o == t for o, t in zip(outs, ref)]
                    for i, ok in enumerate(same):
                        if not ok and (c.label, engine_kind, C, i) not in diffs:
                            diffs[(c.label, engine_kind, C, i)] = {
                                "contender": c.label, "engine": engine_kind, "concurrency": C, "prompt": i,
                                **near_tie(target, prompts[i], ref[i], outs[i])}
                runs.append({"round": r, "contender": c.label, "engine": engine_kind, "policy": c.policy,
                             "gamma": c.gamma, "concurrency": C, **summ,
                             "identical": None if same is None else sum(same)})
                log(f"round {r} C={C:>2} {c.label:<14} {engine_kind:<7} {summ['tokens_per_s']:7.1f} tok/s "
                    f"tau {summ['tau']:.2f}" + ("" if same is None else f" identical {sum(same)}/{len(same)}"))
            result = {"rows": aggregate_runs(runs, contenders, sampling, len(prompts)),
                      "differences": list(diffs.values()), "runs": runs, "rounds_done": r + (ci + 1) / len(concurrency)}
            if checkpoint:  # after every C: a stopped run still leaves its measured rows
                checkpoint(result)
    return result


def aggregate_runs(runs: list[dict], contenders: list[Contender], sampling: SamplingConfig, n_prompts: int) -> list[dict]:
    keys = []
    for x in runs:
        k = (x["contender"], x["engine"], x["concurrency"])
        if k not in keys:
            keys.append(k)
    rows = []
    for label, engine_kind, C in keys:
        xs = [x for x in runs if (x["contender"], x["engine"], x["concurrency"]) == (label, engine_kind, C)]
        ident = [x["identical"] for x in xs]
        row = {"contender": label if engine_kind == "batched" else f"{label} (batch-1 engine)", "engine": engine_kind,
               "policy": xs[0]["policy"], "gamma": xs[0]["gamma"], "concurrency": C,
               "temperature": sampling.temperature, "n_prompts": n_prompts, "rounds": len(xs),
               "tau": xs[0]["tau"], "new_tokens": xs[0]["new_tokens"],
               "identical": None if None in ident else min(ident),
               "lossless": None if None in ident else all(i == n_prompts for i in ident)}
        for m in ("tokens_per_s", "tokens_per_cpu_s", "token_latency_ms_mean", "token_latency_ms_p90", "request_latency_ms_mean",
                  "request_latency_ms_p90"):
            row[m] = _median([x.get(m) for x in xs])
        if xs[0].get("by_category"):  # counters are the first round's (deterministic), latency the rounds' median
            row["by_category"] = {cat: dict(v, request_latency_ms_mean=_median(
                [x["by_category"][cat]["request_latency_ms_mean"] for x in xs if "by_category" in x]))
                for cat, v in xs[0]["by_category"].items()}
        rows.append(row)
    for row in rows:
        ar = next((r for r in rows if r["policy"] == "ar" and r["engine"] == "batched"
                   and r["concurrency"] == row["concurrency"]), None)
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar["tokens_per_s"] if ar and ar["tokens_per_s"] else None
    return rows


def findings(rows: list[dict], metric: str = "tokens_per_s") -> dict:
    """The numbers the issue asks for: AR scaling, best static γ per C and its gain, batch-1 parity, on
    ``metric`` (tokens_per_s, or tokens_per_cpu_s: tokens per CPU-second of this process, which other
    jobs on a shared machine disturb far less than wall time)."""
    rows = [dict(r, tokens_per_s=r.get(metric)) for r in rows if r.get(metric) is not None]
    batched = [r for r in rows if r["engine"] == "batched"]
    Cs = sorted({r["concurrency"] for r in batched})
    ar = {r["concurrency"]: r["tokens_per_s"] for r in batched if r["policy"] == "ar"}
    out = {"ar_tokens_per_s": ar, "best_static": {}, "batch1_parity": {}}
    if 1 in ar and 16 in ar:
        out["ar_c16_over_c1"] = ar[16] / ar[1]
    for C in Cs:
        st = [r for r in batched if r["concurrency"] == C and r["policy"] == "static"]
        if st:
            b = max(st, key=lambda r: r["tokens_per_s"])
            out["best_static"][C] = {"gamma": b["gamma"], "tokens_per_s": b["tokens_per_s"],
                                     "gain_over_ar": b["tokens_per_s"] / ar[C] - 1 if C in ar else None}
    for r in rows:
        if r["engine"] == "batch1":
            new = next((x for x in batched if x["concurrency"] == 1 and x["policy"] == r["policy"]
                        and x["gamma"] == r["gamma"]), None)
            if new:
                out["batch1_parity"][new["contender"]] = {"batched_c1": new["tokens_per_s"], "batch1": r["tokens_per_s"],
                                                          "ratio": new["tokens_per_s"] / r["tokens_per_s"]}
    return out


def _throughput_table(rows: list[dict], metric: str) -> list[str]:
    """One line per contender, one column per C: ``metric`` and its ratio to batched AR; best static γ bold."""
    f = findings(rows, metric)
    batched = [dict(r, value=r.get(metric)) for r in rows if r["engine"] == "batched" and r.get(metric) is not None]
    Cs = sorted({r["concurrency"] for r in batched})
    ar = f["ar_tokens_per_s"]
    labels = list(dict.fromkeys(r["contender"] for r in batched))
    lines = ["| contender | " + " | ".join(f"C={C}" for C in Cs) + " |", "|---|" + "---:|" * len(Cs)]
    for lab in labels:
        cells = []
        for C in Cs:
            r = next((x for x in batched if x["contender"] == lab and x["concurrency"] == C), None)
            if r is None:
                cells.append("–")
                continue
            cell = f"{r['value']:.1f}" + (f" (×{r['value'] / ar[C]:.2f})" if ar.get(C) else "")
            best = f["best_static"].get(C, {})
            cells.append(f"**{cell}**" if r["policy"] == "static" and r["gamma"] == best.get("gamma") else cell)
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
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
    if f["batch1_parity"]:
        lines.append("Batched engine at C=1 / today's batch-1 loop (interleaved, same γ): " + ", ".join(
            f"{lab} {p['ratio']:.3f} ({p['batched_c1']:.1f} vs {p['batch1']:.1f})" for lab, p in f["batch1_parity"].items()) + ".")
    return lines


def _category_lines(rows: list[dict]) -> list[str]:
    """τ and mean request latency per prompt category, one row per (contender, C), when there are two or more."""
    rows = [r for r in rows if r.get("by_category")]
    cats = list(dict.fromkeys(c for r in rows for c in r["by_category"]))
    if len(cats) < 2:
        return []
    n = rows[0]["by_category"]
    lines = ["", ("Per prompt category (prompts in each): τ and mean request latency in ms. Every category's "
                  "sequences share the batch's steps, so tokens/s is the batch's, above."), "",
             "| contender | C | " + " | ".join(f"{c} ({n[c]['n_prompts']})" for c in cats) + " |",
             "|---|---:|" + "---:|" * len(cats)]
    for r in rows:
        cells = [(f"{v['tau']:.2f} / {v['request_latency_ms_mean']:.0f}" if (v := r["by_category"].get(c)) else "–")
                 for c in cats]
        lines.append(f"| {r['contender']} | {r['concurrency']} | " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict, meta: dict | None = None) -> str:
    rows = result["rows"]
    batched = [r for r in rows if r["engine"] == "batched"]
    Cs = sorted({r["concurrency"] for r in batched})
    f = findings(rows)
    lines = ["# Batched speculative decoding: tokens/s against concurrency", ""]
    if meta:
        lines += [", ".join(f"{k}: {v}" for k, v in meta.items()), ""]
    lines += [("Generated tokens per wall-clock second (median over rounds); **bold**: the best static γ at that C; "
               "(×N): ratio to batched AR at the same C."), ""]
    lines += _throughput_table(rows, "tokens_per_s") + [""] + _findings_lines(rows, "tokens_per_s", "tokens/s")
    if any(r.get("tokens_per_cpu_s") for r in rows):
        lines += ["", ("The same runs in generated tokens per CPU-second of the benchmark process (one thread): other "
                       "jobs on a shared machine stretch wall time far more than they stretch this."), ""]
        lines += _throughput_table(rows, "tokens_per_cpu_s") + [""] + _findings_lines(rows, "tokens_per_cpu_s",
                                                                                          "tokens per CPU-second")
    lines += ["", "Latencies (wall clock, median over rounds) of batched AR and of the best static γ (tokens/s):", "",
              ("| C | best static γ | AR token gap ms (mean/p90) | best-γ token gap ms (mean/p90) | "
               "AR request ms (mean/p90) | best-γ request ms (mean/p90) |"), "|---:|---:|---:|---:|---:|---:|"]
    for C in Cs:
        b = f["best_static"].get(C)
        ar = next((x for x in batched if x["concurrency"] == C and x["policy"] == "ar"), None)
        br = next((x for x in batched if x["concurrency"] == C and x["policy"] == "static"
                   and b and x["gamma"] == b["gamma"]), None)
        if b and ar and br:
            lines.append(f"| {C} | {b['gamma']} | {ar['token_latency_ms_mean']:.1f} / {ar['token_latency_ms_p90']:.1f} | "
                         f"{br['token_latency_ms_mean']:.1f} / {br['token_latency_ms_p90']:.1f} | "
                         f"{ar['request_latency_ms_mean']:.0f} / {ar['request_latency_ms_p90']:.0f} | "
                         f"{br['request_latency_ms_mean']:.0f} / {br['request_latency_ms_p90']:.0f} |")
    lossy = [r for r in rows if r["lossless"] is False]
    if rows and rows[0]["lossless"] is not None:
        total = sum(r["n_prompts"] for r in rows)
        same = sum(r["identical"] for r in rows)
        lines += ["", (f"Greedy identity with each prompt's batch-1 AR output: {same}/{total} sequences "
                       f"(worst round per row); rows not fully identical: {len(lossy)}.")]
        d = result.get("differences", [])
        if d:
            ties = sum(bool(x["near_tie"]) for x in d)
            lines += [(f"Differing sequences: {len(d)}, of which near-ties (top-2 gap within 2 spacings of the "
                       f"dtype at the first difference): {ties}. Largest gap: "
                       f"{max((x['gap'] or 0) for x in d):.4g}.")]
    lines += _category_lines(rows)
    return "\n".join(lines) + "\n"


def plot_tokens_per_s(result: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["engine"] == "batched"]
    f = findings(result["rows"])
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    labels = []
    for r in rows:
        if r["contender"] not in labels:
            labels.append(r["contender"])
    for lab in labels:
        xs = sorted((r["concurrency"], r["tokens_per_s"]) for r in rows if r["contender"] == lab)
        style = {"lw": 2.2, "color": "black"} if lab == "ar" else {"lw": 1.2, "alpha": 0.85}
        ax.plot([x for x, _ in xs], [y for _, y in xs], marker="o", ms=3, label=lab, **style)
    for C, b in f["best_static"].items():
        ax.scatter([C], [b["tokens_per_s"]], marker="*", s=160, color="red", zorder=5)
        ax.annotate(f"γ={b['gamma']}", (C, b["tokens_per_s"]), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["concurrency"] for r in rows}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrency C (sequences in flight)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title("Batched speculative decoding (red star: best static γ at each C)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    with atomic_path(path, keep_suffix=True) as tmp:  # keeps the suffix: matplotlib picks the format by it
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return Path(path)


def write(result: dict, out_dir: str | Path, meta: dict | None = None, with_plot: bool = True) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{k: r.get(k) for k in ROW_KEYS} for r in result["rows"]]
    atomic_write_json(out / "batch_bench.json", rows, indent=2)
    atomic_write_json(out / "batch_bench_runs.json", {"meta": meta or {}, "findings": findings(result["rows"]),
                                                     "differences": result.get("differences", []),
                                                     "runs": result["runs"]}, indent=2, default=str)
    atomic_write_text(out / "batch_bench.md", markdown(result, meta))
    if with_plot and result["rows"]:
        plot_tokens_per_s(result, out / "batch_bench.png")
    return out


@torch.inference_mode()
def prefill_join_cost(target, concurrency=(2, 4, 8, 16, 32), prompt_len: int = 40, context: int = 96, gamma: int = 3,
                      reps: int = 15, seed: int = 0) -> list[dict]:
    """When one sequence finishes and its slot takes a new prompt: is the prompt's prefill cheaper as its own
    target forward (then the C-1 running slots' verification forward), or joined to that step's forward
    (:func:`~eagle_backbone.batched.model.forward_groups`: projections and MLPs over all tokens at once,
    attention per group)? Median process-CPU ms of each, interleaved, per C."""
    from eagle_backbone.batched.model import BatchedLlama, forward_groups

    g = torch.Generator().manual_seed(seed)
    lm = BatchedLlama(target.model, context + prompt_len + gamma + 4)
    V, dev = target.vocab_size, target.device
    rows_out = []
    for C in concurrency:
        cache = lm.new_cache(C)
        ctx = torch.randint(4, V, (C, context), generator=g).to(dev)
        lm(ctx, torch.arange(context, device=dev)[None].expand(C, context), cache, context)
        run = torch.arange(C - 1, device=dev)
        new = torch.tensor([C - 1], device=dev)
        step_tok = torch.randint(4, V, (C - 1, gamma + 1), generator=g).to(dev)
        step_pos = (context + torch.arange(gamma + 1, device=dev))[None].expand(C - 1, gamma + 1)
        prompt = torch.randint(4, V, (1, prompt_len), generator=g).to(dev)
        ppos = torch.arange(prompt_len, device=dev)[None]
        groups = [(prompt, ppos, new, prompt_len)] + ([(step_tok, step_pos, run, context + gamma + 1)] if C > 1 else [])
        times = {"separate": [], "joined": []}
        for i in range(reps + 2):
            for how in ("separate", "joined") if i % 2 else ("joined", "separate"):
                t0 = time.process_time()
                if how == "separate":
                    lm.logits(lm(prompt, ppos, cache, prompt_len, new)[:, -1:])
                    if C > 1:
                        lm.logits(lm(step_tok, step_pos, cache, context + gamma + 1, run))
                else:
                    hs = forward_groups(lm, groups, cache)
                    lm.logits(hs[0][:, -1:])
                    if C > 1:
                        lm.logits(hs[1])
                if i >= 2:
                    times[how].append(1e3 * (time.process_time() - t0))
        sep, joi = statistics.median(times["separate"]), statistics.median(times["joined"])
        rows_out.append({"concurrency": C, "prompt_len": prompt_len, "gamma": gamma, "separate_ms": sep,
                         "joined_ms": joi, "joined_over_separate": joi / sep})
    return rows_out


@torch.inference_mode()
def profile_components(target, drafter, kind, prompts, make_policy, concurrency=(1, 16), max_new_tokens: int = 32,
                       attn: str = "eager") -> list[dict]:
    """Per-component seconds of the engine's profiled mode (a sync before every clock read; never in the
    timed sweep): prefill, policy, draft, verify, host read and host bookkeeping, per C."""
    out = []
    capacity = max(len(p) for p in prompts) + max_new_tokens + 2
    for C in concurrency:
        eng = BatchedSpeculativeEngine(target, drafter, kind, slots=C, policy=make_policy, capacity=capacity,
                                       attn=attn, profile=True)
        run_workload(eng, prompts[:C], C, 8)  # warm-up
        eng.prof.s = {}
        res = run_workload(eng, prompts, C, max_new_tokens)
        total = sum(eng.prof.s.values())
        out.append({"concurrency": C, "tokens": res.new_tokens, "steps": res.steps,
                    "seconds": {k: round(v, 4) for k, v in eng.prof.s.items()},
                    "share": {k: round(v / total, 3) for k, v in eng.prof.s.items()}})
    return out


if __name__ == "__main__":
    # python -m eagle_backbone.batched.bench OUT_DIR: the prefill-join measurement and a profiled breakdown
    # of static γ=3 on the embedded pair (bf16, eager), written to OUT_DIR/prefill_join.json and profile.json
    import sys

    from eagle_backbone.loading import load_pair
    from eagle_backbone.paths import REPO_ROOT
    from eagle_backbone.policy import StaticPolicy

    set_threads(1)
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/bench_batch")
    e = REPO_ROOT / "data" / "embedded"
    pair = load_pair({"target": str(e / "target"), "drafter": str(e / "drafter"), "drafter_kind": "eagle",
                      "dtype": "bfloat16", "device": "cpu", "attn_implementation": "eager", "tokenizer": str(e / "target")})
    join = {f"prompt_len={n}": prefill_join_cost(pair.target, prompt_len=n) for n in (40, 200)}
    atomic_write_json(out_dir / "prefill_join.json", join)
    for n, rows in join.items():
        for r in rows:
            print(n, f"C={r['concurrency']:>2} separate {r['separate_ms']:.1f} ms, joined {r['joined_ms']:.1f} ms "
                     f"({r['joined_over_separate']:.2f}x)")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, pair.target.vocab_size, (40,), generator=g).tolist() for _ in range(16)]
    prof = profile_components(pair.target, pair.drafter, "eagle", prompts, lambda: StaticPolicy(3))
    atomic_write_json(out_dir / "profile.json", prof)
    for r in prof:
        print(f"C={r['concurrency']}: " + ", ".join(f"{k} {v:.0%}" for k, v in r["share"].items()))
