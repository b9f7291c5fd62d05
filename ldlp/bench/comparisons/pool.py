"""Several head-to-head runs pooled: per-run paired ratios, a pooled ratio, and an interval that
resamples runs, then prompts (``scripts/pool_head_to_head.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle_backbone.io import atomic_write_json
from ldlp.bench.harness.stats import best_adaptive, headroom_captured, paired_ratio


def contender_key(row: dict) -> str:
    """A contender's identity across runs: its label and its setting (checkpoint paths aside)."""
    setting = ", ".join(f"{k}={v}" for k, v in sorted((row.get("setting") or {}).items()) if k != "path")
    return f"{row['contender']} ({setting})" if row.get("adaptive") else row["contender"]


# what pooled runs must share: the model, the prompt set (file, content hash, subset, turns) and the budget
RUN_IDENTITY = ("model", "dataset", "data_path", "data_sha256", "limit", "sample_seed", "turns", "n_prompts",
                "max_new_tokens")


def same_prompt_set(results: list[dict], names: list[str]) -> None:
    """Refuse runs of different models or prompt sets (compared on the keys every run records); warn once
    when runs predate the prompt file's hash (their files cannot be told apart then)."""
    import logging

    shared = [k for k in RUN_IDENTITY if all(k in r for r in results)]
    for name, res in zip(names[1:], results[1:]):
        diff = [f"{k} {results[0][k]!r} vs {res[k]!r}" for k in shared if res[k] != results[0][k]]
        if diff:
            raise ValueError(f"pool: {name} and {names[0]} ran different settings ({'; '.join(diff)}): pool runs of "
                             "one model on one prompt set only")
    old = [name for name, r in zip(names, results) if "data_sha256" not in r]
    if old and len(results) > 1:
        logging.getLogger(__name__).warning(
            "pool: %d of %d runs predate the prompt-file hash (e.g. %s): their prompt files cannot be told apart",
            len(old), len(results), old[0])


def pool(results: list[dict], names: list[str] | None = None, bootstrap: int = 2000, seed: int = 0) -> dict:
    """Pool head-to-head runs (``head_to_head.json`` contents).

    A run measures every contender on the same (round, prompt) pairs, so ratios are paired within a
    run; across runs the machine's speed, and with it the price of a target pass against a drafted
    token, moves. The reference is the static contender fastest over all runs among those in every run.
    Reported per contender (pooled over the runs it is in): its ratio to the reference in each run,
    their median, the pooled ratio over all its pairs, and that ratio's bootstrap 95% interval, which
    resamples runs (so the drift between runs widens it) and then prompts within each run (each prompt
    with all its rounds). Ratios > 1 mean faster than the reference. With an oracle contender, the share
    of its headroom that the best adaptive contender captures."""
    if not results:
        raise ValueError("pool: no head-to-head runs given")
    where = names or [f"run {i + 1}" for i in range(len(results))]
    same_prompt_set(results, where)
    keyed = []  # per run: contender key -> row index
    for name, res in zip(where, results):
        if not res.get("lossless", False):
            raise ValueError(f"{name}: its greedy outputs differ from the target's own greedy decoding; a lossy run is not pooled")
        keyed.append({contender_key(r): i for i, r in enumerate(res["rows"]) if r["contender"] != "AR"})
    keys = list(dict.fromkeys(k for rows in keyed for k in rows))  # in order of first appearance
    present = {k: [j for j, rows in enumerate(keyed) if k in rows] for k in keys}
    first = {k: results[present[k][0]]["rows"][keyed[present[k][0]][k]] for k in keys}
    secs = [{k: np.asarray(res["seconds"][i]) for k, i in rows.items()} for res, rows in zip(results, keyed)]
    static = [k for k in keys if not first[k].get("adaptive") and len(present[k]) == len(results)]
    if not static:
        raise ValueError(f"pool: no static contender is in every run (contenders: {keys})")
    ref = min(static, key=lambda k: sum(s[k].sum() for s in secs))  # the same tokens in every run
    out_rows = []
    for k in keys:
        per_run = [float(s[ref].sum() / s[k].sum()) if k in s else None for s in secs]
        mine = [r for r in per_run if r is not None]
        row = {"contender": k, "policy": first[k].get("policy"), "adaptive": bool(first[k].get("adaptive")),
               "per_run": per_run, "median": float(np.median(mine)),
               "pooled": float(sum(secs[j][ref].sum() for j in present[k]) / sum(secs[j][k].sum() for j in present[k])),
               "tokens_per_s": [res["rows"][rows[k]]["tokens_per_s"] if k in rows else None
                                for res, rows in zip(results, keyed)]}
        if k != ref:  # two-level bootstrap: runs with replacement (the machine's drift between runs), then prompts
            row["ci95"] = paired_ratio(None, [s.get(k) for s in secs], None, [s[ref] for s in secs], bootstrap, seed,
                                       tails=(0.025, 0.975), runs=True)["ci95"]
            row["runs_faster"] = sum(r > 1 for r in mine)
        out_rows.append(row)
    out = {"runs": where, "reference": ref, "rows": out_rows,
           "pairs": int(sum(s[ref].size for s in secs)), "bootstrap": bootstrap,
           "ar_speedup_of_reference": [res["rows"][rows[ref]]["speedup"] for res, rows in zip(results, keyed)],
           "costs": [res.get("costs") for res in results]}
    best, verdict_keys = best_adaptive(out_rows, "pooled")
    out.update(verdict_keys)
    oracle = next((r for r in out_rows if r["policy"] == "oracle"), None)
    captured = headroom_captured(best["pooled"], 1.0, oracle["pooled"]) if best and oracle else None
    if captured is not None:
        out["headroom_captured"] = captured
    return out


def pool_folders(patterns: list[str], out_dir: str | Path, bootstrap: int = 2000, seed: int = 0) -> dict:
    """:func:`pool` over the ``head_to_head.json`` of every folder matching ``patterns`` (globs, in sorted
    order); writes pooled.json to ``out_dir`` (its page: :func:`ldlp.report.headtohead.write_pooled`). The result's
    ``files`` lists the runs read."""
    import glob
    import json

    folders = sorted({Path(f) for pat in patterns for f in glob.glob(str(pat))})
    files = [f / "head_to_head.json" for f in folders if (f / "head_to_head.json").is_file()]
    if not files:
        raise ValueError(f"no head_to_head.json in folders matching {list(patterns)} "
                         "(write them with python scripts/compare.py out_dir=...)")
    results = []
    for f in files:
        try:
            results.append(json.loads(f.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: not valid JSON ({e})") from None
        missing = [k for k in ("rows", "seconds", "lossless") if k not in results[-1]]
        if missing:
            raise ValueError(f"{f}: lacks {missing}; is it a head_to_head.json of scripts/compare.py?")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pooled = pool(results, [f.parent.name for f in files], bootstrap, seed)
    atomic_write_json(out / "pooled.json", pooled)
    return {**pooled, "files": [str(f) for f in files]}


def pooled_batch_ratios(folders: list[Path], reference: str) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """Load-sweep runs (``bench_batch.py`` folders) pooled against one ``reference`` contender: {(C, contender):
    [(tokens per CPU-second ratio, tokens/s ratio) per pair]}, a pair being each (folder, round, block) where
    both ran."""
    import json

    missing = [str(f) for f in folders if not (Path(f) / "batch_bench_runs.json").is_file()]
    if missing:
        raise ValueError(f"no batch_bench_runs.json in {', '.join(missing)}")
    out: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for folder in folders:
        runs = json.loads((Path(folder) / "batch_bench_runs.json").read_text())["runs"]
        ref = {(r["concurrency"], r["round"], r["block"]): r for r in runs if r["contender"] == reference}
        for r in runs:
            base = ref.get((r["concurrency"], r["round"], r["block"]))
            if r["contender"] == reference or base is None:
                continue
            cpu = (r["new_tokens"] / r["cpu_s"]) / (base["new_tokens"] / base["cpu_s"])
            wall = (r["new_tokens"] / r["wall_s"]) / (base["new_tokens"] / base["wall_s"])
            out.setdefault((r["concurrency"], r["contender"]), []).append((cpu, wall))
    if not out:
        raise ValueError(f"no contender shares a (round, block) with {reference!r} in {', '.join(map(str, folders))}")
    return out
