"""Paired ratios of tokens per CPU-second (and wall) of every contender over a reference contender, pooled over
several bench_batch.py folders: each (folder, round, block) where both ran is one pair.

    python scripts/pool_paired_ratios.py --reference ar results/embedded/chunked_prefill/*/

Prints, per concurrency and contender: the median ratio, its geometric mean, how many pairs are above 1, and
the median wall-clock ratio (docs/batched.md#chunked-prefill reads its table from this)."""

import argparse
import json
import statistics
import sys
from pathlib import Path


def pooled(folders: list[Path], reference: str) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """{(C, contender): [(CPU-second ratio, wall ratio) per pair]}."""
    out: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for folder in folders:
        runs = json.loads((folder / "batch_bench_runs.json").read_text())["runs"]
        ref = {(r["concurrency"], r["round"], r["block"]): r for r in runs if r["contender"] == reference}
        for r in runs:
            base = ref.get((r["concurrency"], r["round"], r["block"]))
            if r["contender"] == reference or base is None:
                continue
            cpu = (r["new_tokens"] / r["cpu_s"]) / (base["new_tokens"] / base["cpu_s"])
            wall = (r["new_tokens"] / r["wall_s"]) / (base["new_tokens"] / base["wall_s"])
            out.setdefault((r["concurrency"], r["contender"]), []).append((cpu, wall))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", default="ar", help="the contender every ratio is over (default: ar)")
    ap.add_argument("folders", nargs="+", type=Path, help="bench_batch.py out_dir folders")
    args = ap.parse_args()
    missing = [str(f) for f in args.folders if not (f / "batch_bench_runs.json").is_file()]
    if missing:
        sys.exit(f"error: no batch_bench_runs.json in {', '.join(missing)}")
    rows = pooled(args.folders, args.reference)
    if not rows:
        sys.exit(f"error: no contender shares a (round, block) with {args.reference!r} in these folders")
    print(f"tokens per CPU-second over {args.reference!r}, paired by (folder, round, block)")
    print("| C | contender | median | geometric mean | pairs above 1 | wall median |")
    print("|---:|---|---:|---:|---:|---:|")
    for (C, label), pairs in sorted(rows.items()):
        cpu, wall = [p[0] for p in pairs], [p[1] for p in pairs]
        print(f"| {C} | {label} | {statistics.median(cpu):.3f} | {statistics.geometric_mean(cpu):.3f} | "
              f"{sum(x > 1 for x in cpu)}/{len(cpu)} | {statistics.median(wall):.3f} |")


if __name__ == "__main__":
    main()
