"""The load sweep's numbers, from its raw runs to the structured rows its page is written from.

:func:`aggregate_runs` turns the (round, block) runs of :func:`~ldlp.bench.comparisons.load_sweep.sweep` into one row
per (contender, C, T): each round's blocks combined, medians over rounds, the step counters, the profiled pass's
milliseconds and the paired ratios to the baselines (:func:`baselines`). :func:`findings` states what the
issues ask for at one temperature. The functions after it give each of the page's tables as rows (dicts):
``ldlp.report.load_sweep`` only formats them, and the tests assert on them. :func:`saved_rows` and
:func:`runs_record` are what ``batch_bench.json`` and ``batch_bench_runs.json`` hold, and :func:`read_result`
reads a results folder back into the result they were written from (so its page can be rendered again).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ldlp.bench.comparisons.peer_rows import PEER_POLICIES
from ldlp.bench.harness.stats import headroom_captured

# the keys of a row in batch_bench.json (with ``complete``)
ROW_KEYS = ("contender", "policy", "gamma", "concurrency", "temperature", "tokens_per_s", "tokens_per_cpu_s",
            "token_latency_ms_mean", "token_latency_ms_p90", "request_latency_ms_mean", "request_latency_ms_p90",
            "tau", "lossless", "identical", "n_prompts", "new_tokens", "rounds", "blocks", "speedup_vs_ar", "vs", "policy_share",
            "by_category", "scored_per_step", "scored_per_row_step", "rows_per_step", "verify_ms_per_step",
            "draft_ms_per_step", "profile")
# the timed runs' step counters (this engine only; summed over a round's blocks): engine steps (speculative steps,
# a prefill-only step not counted), row-steps (a running sequence's share of a step) and target-scored tokens
STEP_COUNTERS = ("engine_steps", "row_steps", "scored_tokens")
BASELINES = ("ar", "best_static", "batch1_static", "oracle")
ORACLES = {"oracle": "chain oracle", "oracle_budget": "batched oracle"}  # policy -> what the findings call it


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _merge_categories(cats: list[dict]) -> dict:
    """Per-category counters of a round's blocks summed, τ recomputed, request latency weighted by prompts."""
    merged: dict[str, dict] = {}
    for bc in cats:
        for cat, v in bc.items():
            m = merged.setdefault(cat, {"n_prompts": 0, "new_tokens": 0, "target_forwards": 0, "_lat": 0.0})
            m["n_prompts"] += v["n_prompts"]
            m["new_tokens"] += v["new_tokens"]
            m["target_forwards"] += v["target_forwards"]
            m["_lat"] += v["request_latency_ms_mean"] * v["n_prompts"]
    return {cat: {"n_prompts": m["n_prompts"], "new_tokens": m["new_tokens"], "target_forwards": m["target_forwards"],
                  "tau": m["new_tokens"] / m["target_forwards"] if m["target_forwards"] else 0.0,
                  "request_latency_ms_mean": m["_lat"] / m["n_prompts"] if m["n_prompts"] else 0.0}
            for cat, m in merged.items()}


def _combine(xs: list[dict]) -> dict:
    """One round's blocks as one run: tokens, seconds and counters summed, τ and tokens/s recomputed,
    latencies averaged over the blocks weighted by their prompts (p90s: the blocks' median)."""
    tok = sum(x["new_tokens"] for x in xs)
    n = sum(x.get("n_prompts", 1) for x in xs)
    out = {"new_tokens": tok, "n_prompts": n}
    wall = sum(x.get("wall_s", 0.0) or 0.0 for x in xs)
    cpu = sum(x.get("cpu_s", 0.0) or 0.0 for x in xs)
    out["wall_s"] = wall
    own = [x["policy_s"] for x in xs if x.get("policy_s") is not None]
    out["policy_share"] = sum(own) / wall if own and wall > 0 else None  # the policy's own time / the run's
    out["tokens_per_s"] = tok / wall if wall > 0 else _median([x["tokens_per_s"] for x in xs])
    out["tokens_per_cpu_s"] = tok / cpu if cpu > 0 else _median([x.get("tokens_per_cpu_s") for x in xs])
    forwards = sum(x["new_tokens"] / x["tau"] for x in xs if x.get("tau"))
    out["tau"] = tok / forwards if forwards else None
    for m in ("token_latency_ms_mean", "request_latency_ms_mean"):
        vals = [(x.get(m), x.get("n_prompts", 1)) for x in xs if x.get(m) is not None]
        out[m] = sum(v * w for v, w in vals) / sum(w for _, w in vals) if vals else None
    for m in ("token_latency_ms_p90", "request_latency_ms_p90"):
        out[m] = _median([x.get(m) for x in xs])
    ident = [x.get("identical") for x in xs]
    out["identical"] = None if None in ident else sum(ident)
    for k in STEP_COUNTERS:  # this engine's rows only (a peer has none)
        out[k] = sum(x[k] for x in xs) if all(x.get(k) is not None for x in xs) else None
    cats = [x["by_category"] for x in xs if x.get("by_category")]
    if cats:
        out["by_category"] = _merge_categories(cats)
    return out


def _cell_row(label, C, T, xs: list[dict], n_prompts: int, profiles) -> dict:
    """The row of one (contender, C, T) from its runs ``xs``, before the ratios."""
    by_round: dict = {}
    for x in xs:
        by_round.setdefault(x["round"], []).append(x)
    per_round = [_combine(v) for v in by_round.values()]
    first = per_round[0]
    ident = [x["identical"] for x in per_round]
    n = first["n_prompts"] if all("n_prompts" in x for x in xs) else n_prompts
    row = {"contender": label, "policy": xs[0]["policy"], "gamma": xs[0]["gamma"], "concurrency": C, "temperature": T,
           "n_prompts": n, "rounds": len(per_round), "blocks": len({x.get("block", 0) for x in xs}),
           "tau": first["tau"], "new_tokens": first["new_tokens"],
           "identical": None if None in ident else min(ident),
           "lossless": None if None in ident else all(i == n for i in ident)}
    for m in ("tokens_per_s", "tokens_per_cpu_s", "token_latency_ms_mean", "token_latency_ms_p90", "request_latency_ms_mean",
              "request_latency_ms_p90", "policy_share"):
        row[m] = _median([x.get(m) for x in per_round])
    steps, row_steps, scored = (first.get(k) for k in STEP_COUNTERS)  # deterministic: the first round's
    row["scored_per_step"] = scored / steps if steps else None
    row["scored_per_row_step"] = scored / row_steps if row_steps else None
    row["rows_per_step"] = row_steps / steps if steps else None
    prof = next((p for p in profiles or [] if (p["contender"], p["concurrency"], p["temperature"]) == (label, C, T)),
                None)
    row["profile"] = None if prof is None else {k: prof[k] for k in ("n_prompts", "steps", "ms_per_step")}
    row["verify_ms_per_step"] = None if prof is None else prof["ms_per_step"].get("verify")
    row["draft_ms_per_step"] = None if prof is None else prof["ms_per_step"].get("draft", 0.0)
    if first.get("by_category"):  # counters are the first round's (deterministic), latency the rounds' median
        row["by_category"] = {cat: dict(v, request_latency_ms_mean=_median(
            [x["by_category"][cat]["request_latency_ms_mean"] for x in per_round if cat in x.get("by_category", {})]))
            for cat, v in first["by_category"].items()}
    return row


def _ratios(runs: list[dict], row: dict, base: dict, bootstrap: int, seed: int) -> dict:
    """An adaptive row's paired ratios to the baselines at its (C, T) (``base``: :func:`baselines`'s cell)."""
    from ldlp.bench.harness.stats import paired_ratio

    vs = {}
    for name in BASELINES:
        ref = base.get(name)
        if ref is None or ref["contender"] == row["contender"]:
            continue
        mine, theirs = _pairs(runs, row["contender"], row), _pairs(runs, ref["contender"], row)
        common = sorted(set(mine) & set(theirs))
        if not common:
            continue
        stat = paired_ratio([mine[k][0] for k in common], [mine[k][1] for k in common],
                            [theirs[k][0] for k in common], [theirs[k][1] for k in common],
                            bootstrap=bootstrap, seed=seed)
        vs[name] = {"contender": ref["contender"], "gamma": ref.get("gamma"), **stat}
    return vs


def aggregate_runs(runs: list[dict], default_temperature: float, n_prompts: int, bootstrap: int = 2000,
                   seed: int = 0, profiles: list[dict] | None = None) -> list[dict]:
    """One row per (contender, C, T): each round's blocks combined (:func:`_combine`), then the median
    over rounds (counters: the first round's, with the scored tokens per step); the profiled pass's milliseconds
    per step where ``profiles`` has the cell; and for adaptive contenders the paired ratios to the
    baselines (:func:`baselines`, :func:`ldlp.bench.harness.stats.paired_ratio`). A run without a temperature is at
    ``default_temperature``."""
    cells: dict[tuple, list[dict]] = {}
    for x in runs:
        cells.setdefault((x["contender"], x["concurrency"], x.get("temperature", default_temperature)), []).append(x)
    rows = [_cell_row(label, C, T, xs, n_prompts, profiles) for (label, C, T), xs in cells.items()]
    for row in rows:
        ar = next((r for r in rows if r["policy"] == "ar"
                   and r["concurrency"] == row["concurrency"] and r["temperature"] == row["temperature"]), None)
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar["tokens_per_s"] if ar and ar["tokens_per_s"] else None
    base = baselines(rows)
    for row in rows:
        if row["policy"] not in ("ar", "static", *PEER_POLICIES):
            row["vs"] = _ratios(runs, row, base.get((row["temperature"], row["concurrency"]), {}), bootstrap, seed)
    return rows


def _pairs(runs: list[dict], label: str, at: dict) -> dict:
    """{(round, block): (new tokens, wall seconds)} of a contender at ``at``'s C and T."""
    return {(x["round"], x.get("block", 0)): (x["new_tokens"], x["wall_s"]) for x in runs
            if x["contender"] == label and x["concurrency"] == at["concurrency"]
            and x.get("temperature", at["temperature"]) == at["temperature"] and x.get("wall_s")}


def baselines(rows: list[dict]) -> dict:
    """{(T, C): {"ar", "best_static", "batch1_static", "oracle": the baseline's row}} among the rows:
    batched AR; the static γ fastest at that (C, T), chosen in hindsight; the static γ fastest at C=1 for that
    T, at this C (what a user tuned at batch 1 deploys; absent without C=1); the oracle (T=0 only)."""
    measured = [r for r in rows if r.get("tokens_per_s") is not None]
    out = {}
    for T in dict.fromkeys(r["temperature"] for r in measured):
        at_t = [r for r in measured if r["temperature"] == T]
        st1 = [r for r in at_t if r["concurrency"] == 1 and r["policy"] == "static"]
        g1 = max(st1, key=lambda r: r["tokens_per_s"])["gamma"] if st1 else None
        for C in dict.fromkeys(r["concurrency"] for r in at_t):
            here = [r for r in at_t if r["concurrency"] == C]
            st = [r for r in here if r["policy"] == "static"]
            out[(T, C)] = {
                "ar": next((r for r in here if r["policy"] == "ar"), None),
                "best_static": max(st, key=lambda r: r["tokens_per_s"]) if st else None,
                "batch1_static": next((r for r in st if r["gamma"] == g1), None),
                "oracle": next((r for r in here if r["policy"] == "oracle"), None)}
    return out


def temperatures_of(rows: list[dict]) -> list[float]:
    """The temperatures of ``rows``, in the order they first appear."""
    return list(dict.fromkeys(r.get("temperature", 0.0) for r in rows))


def rows_at(rows: list[dict], temperature) -> list[dict]:
    """The rows at ``temperature`` (None: the first temperature in ``rows``)."""
    ts = temperatures_of(rows)
    t = ts[0] if temperature is None and ts else temperature
    return [r for r in rows if r.get("temperature", 0.0) == t]


def _headroom(rows: list[dict], best_static: dict, metric: str) -> dict:
    """Each oracle's gain over the best static γ at its C (on tokens/s also the paired ratio)."""
    headroom: dict = {}
    for r in rows:
        b = best_static.get(r["concurrency"])
        if r["policy"] in ORACLES and b and b["tokens_per_s"]:
            h = {"policy": r["policy"], "tokens_per_s": r["tokens_per_s"], "best_static_gamma": b["gamma"],
                 "best_static_tokens_per_s": b["tokens_per_s"], "gain_over_best_static": r["tokens_per_s"] / b["tokens_per_s"] - 1}
            v = (r.get("vs") or {}).get("best_static") if metric == "tokens_per_s" else None
            if v:
                h["paired"] = {k: v.get(k) for k in ("ratio", "ci95", "pairs", "half_width", "resolves_5pct")}
            headroom.setdefault(r["contender"], {})[r["concurrency"]] = h
    return headroom


def _headroom_share(rows: list[dict], best_static: dict, headroom: dict) -> dict:
    """Each adaptive contender's share of the batched oracle's headroom at its C: (it - best) / (oracle - best)."""
    bound = headroom.get(next((lab for lab, per_c in headroom.items()
                               if next(iter(per_c.values()))["policy"] == "oracle_budget"), None), {})
    share: dict = {}
    for r in rows:
        b, h = best_static.get(r["concurrency"]), bound.get(r["concurrency"])
        if r["policy"] in ORACLES or r["policy"] in ("static", "ar") or r["policy"] in PEER_POLICIES or not (b and h):
            continue
        v = headroom_captured(r["tokens_per_s"], b["tokens_per_s"], h["tokens_per_s"])
        if v is not None:
            share.setdefault(r["contender"], {})[r["concurrency"]] = v
    return share


def findings(rows: list[dict], metric: str = "tokens_per_s", temperature: float | None = None) -> dict:
    """The numbers the issues ask for at one temperature (None: the rows' first): AR scaling, best static γ
    per C and its gain, on ``metric`` (tokens_per_s, or tokens_per_cpu_s: tokens per
    CPU-second of this process, which other jobs on a shared machine disturb far less than wall time); the
    oracles' headroom and the adaptive contenders' share of it; and, on tokens/s, the baselines per C and every
    adaptive contender's paired ratios to them."""
    rows = rows_at(rows, temperature)
    base_rows = rows
    rows = [dict(r, tokens_per_s=r.get(metric)) for r in rows if r.get(metric) is not None]
    Cs = sorted({r["concurrency"] for r in rows})
    ar = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["policy"] == "ar"}
    out = {"temperature": rows[0]["temperature"] if rows else temperature, "ar_tokens_per_s": ar, "best_static": {}}
    if 1 in ar and 16 in ar:
        out["ar_c16_over_c1"] = ar[16] / ar[1]
    for C in Cs:
        st = [r for r in rows if r["concurrency"] == C and r["policy"] == "static"]
        if st:
            b = max(st, key=lambda r: r["tokens_per_s"])
            out["best_static"][C] = {"gamma": b["gamma"], "tokens_per_s": b["tokens_per_s"],
                                     "gain_over_ar": b["tokens_per_s"] / ar[C] - 1 if C in ar else None}
    headroom = _headroom(rows, out["best_static"], metric)
    if headroom:
        out["oracle_headroom"] = headroom
        share = _headroom_share(rows, out["best_static"], headroom)
        if share:
            out["headroom_share"] = share
    if metric == "tokens_per_s":
        out["baselines"] = {C: {name: {"contender": b["contender"], "gamma": b["gamma"], "tokens_per_s": b["tokens_per_s"]}
                                for name, b in v.items() if b is not None}
                            for (_, C), v in sorted(baselines(base_rows).items(), key=lambda kv: kv[0][1])}
        out["ratios"] = {}
        for r in base_rows:
            if r.get("vs"):
                out["ratios"].setdefault(r["contender"], {})[r["concurrency"]] = r["vs"]
    return out


# -- the page's tables, as rows (``rows``: one temperature's) ------------------------------------------------


def run_status(result: dict) -> dict:
    """Whether the run finished every round, and how far it got: the page header's and the JSON's."""
    return {"complete": bool(result.get("complete", False)), "rounds_done": result.get("rounds_done", 0),
            "rounds": result.get("rounds")}


def throughput_table(rows: list[dict], metric: str) -> dict:
    """One line per contender, one cell per C: ``metric``, its ratio to batched AR (``vs_ar``, None without an AR
    row) and whether it is the best static γ there (``best``); a cell is None where the contender has no value."""
    f = findings(rows, metric)
    measured = [dict(r, value=r.get(metric)) for r in rows if r.get(metric) is not None]
    Cs = sorted({r["concurrency"] for r in measured})
    ar = f["ar_tokens_per_s"]
    lines = []
    for lab in dict.fromkeys(r["contender"] for r in measured):
        cells = {}
        for C in Cs:
            r = next((x for x in measured if x["contender"] == lab and x["concurrency"] == C), None)
            cells[C] = None if r is None else {
                "value": r["value"], "vs_ar": r["value"] / ar[C] if ar.get(C) else None,
                "best": r["policy"] == "static" and r["gamma"] == f["best_static"].get(C, {}).get("gamma")}
        lines.append({"contender": lab, "cells": cells})
    return {"concurrency": Cs, "rows": lines}


def ratio_rows(rows: list[dict]) -> list[dict]:
    """The adaptive rows (those with paired ratios), by contender and C."""
    return sorted((r for r in rows if r.get("vs")), key=lambda r: (r["contender"], r["concurrency"]))


def verdict_tally(values: list[dict | None]) -> dict:
    """How many paired ratios are faster (interval above 1), slower (below 1), tied (containing 1) and without an
    interval (``counts``, in that order), and of those with an interval (``with_interval``) how many resolve 5%."""
    vs = [v for v in values if v]
    with_ci = [v for v in vs if v.get("ci95")]
    n = {"faster": sum(v["ci95"][0] > 1 for v in with_ci), "slower": sum(v["ci95"][1] < 1 for v in with_ci)}
    n["tied"] = len(with_ci) - n["faster"] - n["slower"]
    n["without interval"] = len(vs) - len(with_ci)
    return {"counts": n, "with_interval": len(with_ci), "resolve_5pct": sum(bool(v["resolves_5pct"]) for v in with_ci)}


def verdicts(rows: list[dict], baseline: str = "best_static") -> dict:
    """{contender: :func:`verdict_tally` of its ratios to ``baseline`` over C}, for every adaptive contender (in
    the rows' order)."""
    adaptive = [r for r in rows if r.get("vs")]
    return {lab: verdict_tally([r["vs"].get(baseline) for r in adaptive if r["contender"] == lab])
            for lab in dict.fromkeys(r["contender"] for r in adaptive)}


def step_rows(rows: list[dict]) -> list[dict]:
    """The rows with step counters or a profiled pass, in the contenders' order, then by C."""
    order = list(dict.fromkeys(r["contender"] for r in rows))
    have = [r for r in rows if r.get("scored_per_step") is not None or r.get("profile")]
    return sorted(have, key=lambda r: (order.index(r["contender"]), r["concurrency"]))


def category_table(rows: list[dict]) -> dict | None:
    """τ and mean request latency per prompt category, one line per (contender, C): {"categories": {category:
    prompts}, "rows": [{"contender", "concurrency", "cells": {category: the row's counters or None}}]}; None
    with fewer than two categories."""
    rows = [r for r in rows if r.get("by_category")]
    cats = list(dict.fromkeys(c for r in rows for c in r["by_category"]))
    if len(cats) < 2:
        return None
    n = rows[0]["by_category"]
    return {"categories": {c: n[c]["n_prompts"] for c in cats},
            "rows": [{"contender": r["contender"], "concurrency": r["concurrency"],
                      "cells": {c: r["by_category"].get(c) for c in cats}} for r in rows]}


def latency_rows(rows: list[dict]) -> list[dict]:
    """Per C with a best static γ: that γ, and the rows of batched AR (``ar``) and of that γ (``best``)."""
    f = findings(rows)
    out = []
    for C in sorted({r["concurrency"] for r in rows}):
        b = f["best_static"].get(C)
        ar = next((x for x in rows if x["concurrency"] == C and x["policy"] == "ar"), None)
        br = next((x for x in rows if x["concurrency"] == C and x["policy"] == "static"
                   and b and x["gamma"] == b["gamma"]), None)
        if b and ar and br:
            out.append({"concurrency": C, "gamma": b["gamma"], "ar": ar, "best": br})
    return out


def greedy_identity(rows: list[dict], differences: list[dict]) -> dict | None:
    """Greedy identity over the rows (None when not checked): sequences identical (worst round per row) of all,
    rows not fully identical, and the differing sequences with how many are near-ties and the largest gap."""
    if not rows or rows[0]["lossless"] is None:
        return None
    return {"identical": sum(r["identical"] for r in rows), "sequences": sum(r["n_prompts"] for r in rows),
            "lossy_rows": sum(r["lossless"] is False for r in rows), "differing": len(differences),
            "near_ties": sum(bool(x["near_tie"]) for x in differences),
            "largest_gap": max((x["gap"] or 0) for x in differences) if differences else None}


def policy_shares(rows: list[dict]) -> dict:
    """{contender: its row with the largest share of the run's time spent in the policy's own calls}."""
    shares = [r for r in rows if r.get("policy_share") is not None]
    return {lab: max((r for r in shares if r["contender"] == lab), key=lambda r: r["policy_share"])
            for lab in dict.fromkeys(r["contender"] for r in shares)}


# -- the raw results on disk ---------------------------------------------------------------------------------


def saved_rows(result: dict) -> list[dict]:
    """batch_bench.json: the rows with :data:`ROW_KEYS` and ``complete``."""
    complete = run_status(result)["complete"]
    return [{**{k: r.get(k) for k in ROW_KEYS}, "complete": complete} for r in result["rows"]]


def runs_record(result: dict, meta: dict | None = None) -> dict:
    """batch_bench_runs.json: meta, the run's status, the cost tables used, findings per temperature, greedy
    differences, skipped contenders, every (round, block) run, the profiled pass, the step-cost rows and the goodput
    learners, and the process's resident memory over the run."""
    by_t = {str(t): findings(result["rows"], temperature=t) for t in temperatures_of(result["rows"])}
    return {"meta": meta or {}, **run_status(result), "cost_tables": result.get("cost_tables") or {}, "findings": by_t,
            "differences": result.get("differences", []), "skipped": result.get("skipped", []),
            "runs": result["runs"], "profiles": result.get("profiles") or [], "step_costs": result.get("step_costs") or [],
            "learners": result.get("learners") or {}, "memory": result.get("memory")}


def read_result(folder: str | Path) -> tuple[dict, dict]:
    """(result, meta) as a results folder holds them (batch_bench.json, batch_bench_runs.json and, where
    written, step_costs.json): what the page and plots were written from."""
    folder = Path(folder)
    rows = json.loads((folder / "batch_bench.json").read_text())
    raw = json.loads((folder / "batch_bench_runs.json").read_text())
    result = {k: raw.get(k) for k in ("complete", "rounds_done", "rounds", "cost_tables", "differences", "skipped",
                                      "runs", "profiles", "step_costs", "learners", "memory")}
    result["rows"] = [{k: v for k, v in r.items() if k != "complete"} for r in rows]
    if (folder / "step_costs.json").is_file():
        result["hindsight"] = json.loads((folder / "step_costs.json").read_text())
    meta = raw.get("meta") or {}
    if isinstance(meta.get("blocks"), dict):  # JSON keeps the blocks per C under string keys
        meta["blocks"] = {int(C): n for C, n in meta["blocks"].items()}
    return result, meta
