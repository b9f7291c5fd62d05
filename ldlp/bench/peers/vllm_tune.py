"""Tuning vLLM's Dynamic SD schedule on this machine, the pair and a prompt set (``scripts/tune_vllm_schedule.py``,
issue 36), through the benchmark's own vLLM worker (:class:`~ldlp.bench.peers.vllm_peer.VllmRunner`).

**The grid.** One worker per K in ``ks``, all started first and kept: each runs vLLM's Dynamic SD with the
constant schedule ``[[1, C_max, K]]`` (the mode a tuned schedule runs in), at most ``C_max`` requests in
flight, with its steps traced (:mod:`ldlp.bench.peers.vllm_worker`). For every round, every grid C and every chunk of
C prompts (``prompts_per_cell`` prompts per C, at least C), every worker decodes the chunk in turn (the order
rotating between rounds, C and chunks, so a slow phase of a shared machine hits every K alike): a batch of C
requests that shrinks as they finish. Each call gives its tokens, seconds, vLLM's counters (acceptance by
position among them) and its steps: the step-time model's records at B = C and at the batch sizes of the
tail.

**From the grid** (:mod:`ldlp.bench.peers.vllm_schedule`): acceptance by position pooled over every call, the step
model fitted to the steps that admit no prompt, and per batch size 1..``max_batch`` the K with the most
expected tokens/s. Every output is checked: the K give the same tokens for each prompt, and (``reference``)
the target's own greedy decoding.
"""

from __future__ import annotations

import time
from pathlib import Path

from eagle_backbone.timing import interleaved
from ldlp.bench.harness.identity import GreedyReference
from ldlp.bench.peers.vllm_schedule import (
    StepModel,
    acceptance_by_position,
    calibrated,
    choose_schedule,
    decode_steps,
    expected_tau,
    tokens_per_step,
)


def _chunks(n_prompts: int, C: int, per_cell: int) -> list[list[int]]:
    """Prompt indices per call at C: ``max(C, per_cell)`` prompts (as many as there are), in chunks of C."""
    n = min(n_prompts, max(C, per_cell))
    return [list(range(i, min(i + C, n))) for i in range(0, n, C)]


def measure_grid(runners: dict, prompts: list[list[int]], concurrency: list[int], rounds: int, max_new_tokens: int,
                 stop_ids, prompts_per_cell: int, log=print) -> list[dict]:
    """The grid's calls: ``runners`` K -> a started :class:`~ldlp.bench.peers.vllm_peer.VllmRunner` (its worker traced,
    with at most max(concurrency) in flight). Returns one dict per call: round, C, chunk, k, prompts (indices),
    outputs, new_tokens, wall_s, cpu_s, num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_pos,
    steps."""
    ks = sorted(runners)
    calls = []
    for r in range(rounds):
        t0 = time.perf_counter()
        for ci, C in enumerate(concurrency):
            def call(K, idx, j, _):
                rep = runners[K].generate([prompts[i] for i in idx], max_new_tokens, stop_ids)
                calls.append({"round": r, "C": C, "chunk": j, "k": K, "prompts": idx, "outputs": rep["outputs"],
                              "new_tokens": sum(len(o) for o in rep["outputs"]),
                              **{key: rep.get(key) for key in ("wall_s", "cpu_s", "num_drafts", "num_draft_tokens",
                                                               "num_accepted_tokens", "accepted_per_pos", "steps")}})

            # chunk j at (round r, the ci-th C) starts with K number (7 r + 3 ci + j) mod len(ks)
            interleaved(ks, _chunks(len(prompts), C, prompts_per_cell), 1, call, order="rotate", offset=r * 7 + ci * 3)
        log(f"grid round {r + 1}/{rounds}: {time.perf_counter() - t0:.0f} s")
    return calls


def check_outputs(calls: list[dict], reference: list[list[int]] | None) -> dict:
    """Whether every K gave the same tokens for each prompt, and (``reference``: the target's greedy decoding
    per prompt) whether each equals it: {"sequences", "identical_across_k", "identical_to_greedy" (None
    without a reference), "differing" (up to 5 (k, prompt) pairs)}."""
    by_prompt: dict[int, set] = {}
    ok_ref, n, diff = 0, 0, []
    ref = None if reference is None else GreedyReference(reference)
    for c in calls:
        for i, out in zip(c["prompts"], c["outputs"]):
            by_prompt.setdefault(i, set()).add(tuple(out))
            n += 1
            if ref is not None:
                same = ref.same([out], [i])[0]
                ok_ref += same
                if not same and len(diff) < 5:
                    diff.append({"k": c["k"], "prompt": i})
    return {"sequences": n, "identical_across_k": all(len(v) == 1 for v in by_prompt.values()),
            "identical_to_greedy": None if reference is None else ok_ref, "differing": diff}


def grid_rows(calls: list[dict], model: StepModel, tokens: dict, taus: dict | None = None) -> list[dict]:
    """Per (K, C): the measured tokens/s (all rounds' calls: tokens over wall seconds; per CPU-second too), the
    measured τ (tokens per request forward, the prefill's included: tokens / (prompts + drafts)), and the
    expected tokens/s of decode steps at B = C (the step model and ``tokens``, the expected tokens per request
    and step; no prefill and no tail, so above the measured)."""
    cells: dict[tuple, list[dict]] = {}
    for c in calls:
        cells.setdefault((c["k"], c["C"]), []).append(c)
    out = []
    for (K, C), xs in sorted(cells.items()):
        tok = sum(x["new_tokens"] for x in xs)
        wall = sum(x["wall_s"] for x in xs)
        cpu = sum(x["cpu_s"] for x in xs)
        fw = sum(len(x["prompts"]) + x["num_drafts"] for x in xs)
        out.append({"k": K, "concurrency": C, "calls": len(xs), "new_tokens": tok,
                    "tokens_per_s": tok / wall if wall else None, "tokens_per_cpu_s": tok / cpu if cpu else None,
                    "tau": tok / fw if fw else None, "expected_tokens_per_step": tokens[K],
                    "expected_tau": (taus or {}).get(K),
                    "expected_tokens_per_s": 1e3 * C * tokens[K] / model(C, K)})
    return out


def why_rows(choice: dict, ks) -> list[dict]:
    """Per range of the schedule: its K, the runner-up K and the expected gain over it at the range's first and
    last batch size (from ``choice["per_batch"]``)."""
    per = {row["batch"]: row for row in choice["per_batch"]}
    out = []
    for a, b, k in choice["ranges"]:
        ends = []
        for B in sorted({a, b}):
            rates = per[B]["rates"]
            others = [K for K in ks if K != k]
            second = max(others, key=lambda K: rates[K]) if others else None
            ends.append({"batch": B, "rates": rates, "runner_up": second,
                         "gain": rates[k] / rates[second] - 1 if second is not None else None,
                         "best_k": per[B]["best_k"]})
        out.append({"range": [a, b, k], "ends": ends})
    return out


def tune(make_runner, prompts: list[list[int]], ks: list[int], concurrency: list[int], rounds: int,
         max_new_tokens: int, stop_ids, prompts_per_cell: int, max_batch: int, margin: float = 0.0,
         step_time: str = "cpu", reference: list[list[int]] | None = None, log=print, anchor: bool = False,
         calibrate: bool = True) -> dict:
    """The whole tuning: ``make_runner(K)`` -> a :class:`~ldlp.bench.peers.vllm_peer.VllmRunner` with the constant
    schedule ``[[1, max(concurrency), K]]`` and traced steps. Returns the record the page is written from."""
    C_max = max(concurrency)
    t0 = time.perf_counter()
    runners = {}
    try:
        for K in ks:
            runners[K] = make_runner(K)
            info = runners[K].start(C_max)
            if info.get("dynamic_sd") is None or set(info["dynamic_sd"]) != {K}:
                raise RuntimeError(f"vLLM's worker at K={K} did not resolve the constant schedule: {info.get('dynamic_sd')}")
            runners[K].generate(prompts[:2], min(8, max_new_tokens), stop_ids)  # warm-up, untimed
        start_s = time.perf_counter() - t0
        log(f"{len(ks)} vLLM workers ready in {start_s:.0f} s (vLLM {runners[ks[0]].info.get('vllm')})")
        calls = measure_grid(runners, prompts, concurrency, rounds, max_new_tokens, stop_ids, prompts_per_cell, log)
    finally:
        for r in runners.values():
            r.close()
    lengths = list({i: len(o) for c in calls for i, o in zip(c["prompts"], c["outputs"])}.values())
    rec = {"ks": list(ks), "concurrency": list(concurrency), "rounds": rounds, "prompts_per_cell": prompts_per_cell,
           "max_new_tokens": max_new_tokens, "output_lengths": sorted(lengths),
           "lossless": check_outputs(calls, reference), "workers_start_s": start_s,
           "grid_s": time.perf_counter() - t0 - start_s,
           "calls": [{k: v for k, v in c.items() if k not in ("outputs", "steps")} | {"steps": len(c.get("steps") or [])}
                     for c in calls],
           # every traced step, per call (the script writes it to trace.json.gz): the step model's records
           "trace": [{"round": c["round"], "C": c["C"], "chunk": c["chunk"], "k": c["k"], "steps": c.get("steps") or []}
                     for c in calls]}
    return {**rec, **analyse(rec["calls"], rec["trace"], ks, concurrency, max_batch, margin, step_time, lengths, anchor,
                             calibrate)}


def analyse(calls: list[dict], trace: list[dict], ks, concurrency, max_batch: int, margin: float, step_time: str,
            lengths: list[int], anchor: bool = False, calibrate: bool = True) -> dict:
    """From the grid's calls (their counters) and traced steps: acceptance by position, the step model, the
    expected tokens per step for the prompts' output ``lengths``, the choice and the page's rows. ``anchor``: the
    step model meets the grid's cell medians (else the fit alone, which averages the cells' noise);
    ``calibrate``: the choice prices K by the expected tokens/s scaled to the grid's measured throughput at each
    grid C (:func:`~ldlp.bench.peers.vllm_schedule.calibrated`; else the model alone)."""
    acc = acceptance_by_position(calls)
    steps = [s for t in trace for s in t["steps"]]
    model = StepModel.fit(decode_steps(steps, step_time), anchor_batches=set(concurrency) if anchor else set())
    tokens = {K: tokens_per_step(acc["p"], K, lengths) for K in ks}
    rows = grid_rows(calls, model, tokens, {K: expected_tau(acc["p"], K, lengths) for K in ks})
    scale = None
    price = model
    if calibrate:  # the grid's measured throughput where it was measured (per CPU-second with step_time=cpu)
        metric = "tokens_per_cpu_s" if step_time == "cpu" else "tokens_per_s"
        price, scale = calibrated(model, tokens, {(g["k"], g["concurrency"]): g[metric] for g in rows})
        for g in rows:
            g["calibration"] = scale.get((g["k"], g["concurrency"]))
    choice = choose_schedule(max_batch, ks, tokens, price, margin)
    return {"max_batch": max_batch, "margin": margin, "step_time": step_time, "anchor": anchor,
            "calibrate": calibrate, "acceptance": acc, "step_model": model.to_dict(), "tokens_per_step": tokens,
            "grid": rows, "choice": {"ranges": choice["ranges"], "per_batch": choice["per_batch"]},
            "why": why_rows(choice, ks), "schedule": choice["ranges"], "k_max": max(k for _, _, k in choice["ranges"])}


def write_schedule(record: dict, out: str | Path, method: str = "eagle", model: str | None = None) -> list[Path]:
    """``schedule.json`` (the ``speculative_config`` snippet, which ``engine=vllm spec.schedule=FILE`` reads too)
    and ``schedule.yaml`` (the same, for a YAML config) in ``out``."""
    import json

    import yaml

    from ldlp.bench.peers.vllm_schedule import snippet

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    snip = snippet(record["schedule"], record["k_max"], method, model)
    # the JSON file says what the schedule was tuned for (model, vLLM's dtype, drafter, CPU: checked where it runs);
    # the YAML stays a config vLLM reads as it is
    made_for = {"made_for": record["made_for"]} if record.get("made_for") else {}
    (out / "schedule.json").write_text(json.dumps({**snip, **made_for}, indent=2) + "\n")
    (out / "schedule.yaml").write_text(yaml.safe_dump(snip, default_flow_style=None, sort_keys=False))
    return [out / "schedule.json", out / "schedule.yaml"]


# ---- the held-out evaluation: a load sweep of scripts/bench_batch.py with the schedule as a contender --------

FLOOR, GAIN = 0.98, 0.05  # the goals: >= 0.98x the best static in hindsight; +5% where the single one is wrong


def goals(vs: dict | None, clock: str = "") -> dict | None:
    """The issue's goals on :func:`~ldlp.bench.comparisons.peer_rows.versus_static`'s comparison (``clock``: "" for
    wall, "_cpu" for CPU seconds): at every C the adaptive contender at >= :data:`FLOOR` of the best static in
    hindsight; where the single best static is not the best, at least :data:`GAIN` above it, and nowhere below
    it by more than 1 - FLOOR. Point estimates of the paired ratios (their intervals are on the page)."""
    if not vs:
        return None
    rows = vs["rows"]
    best = {r["concurrency"]: (r[f"ratio_best{clock}"] or {}).get("ratio") for r in rows}
    single = {r["concurrency"]: (r[f"ratio_single{clock}"] or {}).get("ratio") for r in rows}
    wrong = [r["concurrency"] for r in rows if not r["single_is_best"]]
    return {"best_in_hindsight": best, "floor_met": all(v is not None and v >= FLOOR for v in best.values()),
            "single": vs["single"], "vs_single": single, "single_wrong_at": wrong,
            "gain_met": bool(wrong) and all((single[C] or 0) >= 1 + GAIN for C in wrong),
            "never_below_met": all(v is not None and v >= FLOOR for v in single.values())}


def heldout_comparison(folder: str | Path) -> dict:
    """From a load sweep's results folder (``scripts/bench_batch.py``, greedy rows): every vLLM contender with a
    schedule against vLLM's static k of its method, and this engine's ``load_aware_step`` against its own static
    γ (:func:`~ldlp.bench.comparisons.peer_rows.versus_static`), with the goals (:func:`goals`) by wall clock and CPU
    time."""
    from ldlp.bench.comparisons.load_aggregate import read_result, rows_at
    from ldlp.bench.comparisons.peer_rows import versus_static

    result, meta = read_result(folder)
    rows = rows_at(result["rows"], 0.0)
    labels = list(dict.fromkeys(r["contender"] for r in rows))
    out = {"folder": str(folder), "meta": meta, "complete": result.get("complete"), "vllm": [], "engine": None}
    for lab in labels:
        if lab.startswith("vllm ") and " schedule " in lab:
            method = lab.split()[1]
            statics = [x for x in labels if x.startswith(f"vllm {method} k=")]
            vs = versus_static(result, rows, lab, statics)
            out["vllm"].append({"comparison": vs, "goals": goals(vs), "goals_cpu": goals(vs, "_cpu")})
    statics = [r["contender"] for r in rows if r["policy"] == "static"]
    statics = list(dict.fromkeys(statics))
    for lab in ("load_aware_step", "load_aware"):
        if lab in labels:
            vs = versus_static(result, rows, lab, statics)
            out["engine"] = {"comparison": vs, "goals": goals(vs), "goals_cpu": goals(vs, "_cpu")}
            break
    wanted = [x["comparison"]["label"] for x in out["vllm"]] + ([out["engine"]["comparison"]["label"]]
                                                                 if out["engine"] else [])
    out["lossless"] = {lab: all(r.get("lossless") for r in rows if r["contender"] == lab) for lab in wanted}
    out["lossless_all"] = all(r.get("lossless") is not False for r in rows)
    return out
