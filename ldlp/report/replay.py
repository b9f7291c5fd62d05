"""The replay tuner's page (:func:`ldlp.bench.harness.replay.tune`) and how it priced its steps."""

from __future__ import annotations

from eagle_backbone.cost import CostTable
from ldlp.bench.harness.replay import OracleRows, best_per_policy, costs_record
from ldlp.bench.harness.stats import percent


def tuning_markdown(results: list[dict], costs: CostTable, rows: OracleRows, where: str) -> str:
    best = best_per_policy(results)
    lines = [f"## Policy tuning by exact replay on oracle labels ({where})", "",
             f"{len(rows)} positions in {len(rows.sequences)} sequences. Counts (τ, drafted, wasted) are exact; "
             f"time is modelled: {describe_costs(costs)}.", "",
             "Best setting per policy:", "",
             "| policy | setting | τ | modelled tokens/s | drafted | wasted | headroom captured |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, r in sorted(best.items(), key=lambda kv: -kv[1]["tokens_per_s"]):
        setting = ", ".join(f"{k}={v}" for k, v in r["params"].items())
        lines.append(f"| {name} | {setting} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['drafted']} | "
                     f"{r['wasted']} | {percent(r['headroom_captured'])} |")
    lines += ["", "Every setting tried:", "", "| policy | setting | τ | modelled tokens/s | wasted |", "|---|---|---:|---:|---:|"]
    for r in results:
        setting = ", ".join(f"{k}={v}" for k, v in r["params"].items())
        lines.append(f"| {r['policy']} | {setting} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['wasted']} |")
    return "\n".join(lines) + "\n"


def describe_costs(costs: CostTable) -> str:
    c = costs_record(costs)
    if c["source"] == "linear":
        return (f"a step costs {c['step_ms']:.2f} ms + {c['draft_ms']:.2f} ms per drafted token + "
                f"{c['accepted_ms']:.2f} ms per accepted token (a linear cost table)")
    where = f" {c['path']}" if c["path"] else ""
    if c["source"] == "step_cost_model":
        return (f"steps are priced by the step-cost model (eagle_backbone/step_cost.py; from{where}) at one slot "
                f"(a plain step {c['step_ms']:.2f} ms, a draft depth {c['draft_ms']:.2f} ms)")
    return (f"steps are priced by the measured cost table{where} at one slot (CostTable.step_ms; "
            f"a plain step {c['step_ms']:.2f} ms, a draft depth {c['draft_ms']:.2f} ms)")
