"""The step-cost model's accuracy in the load sweep, and the costs measured in hindsight.

Every timed run of this engine records its steps (:class:`~eagle_backbone.step_cost.StepRecord`) with what the
contender's online model predicted before each step. :func:`run_step_costs` keeps a run's errors once its model
has seen ``warmup`` steps (the issue's "after 50 steps"), :func:`step_cost_rows` pools them per (contender, C, T),
and :func:`hindsight_model` fits one model to every step of the sweep at once: rerun a cost-driven policy with
it (``policy.cost_model=<out>/step_costs.json``) to see how much of its gap to the best static γ is the costs.
:func:`summary` and :func:`decomposition` are the rows the page's sections are written from
(``ldlp.report.step_costs``).
"""

from __future__ import annotations

import random
import statistics

from eagle_backbone.step_cost import OnlineCostModel, StepRecord

WARMUP = 50  # steps a model has seen before its predictions count
SAMPLE = 48  # (predicted, measured) pairs kept per run for the plot


def run_step_costs(log: list[StepRecord], age: int, warmup: int = WARMUP) -> dict:
    """A run's step times against its model's predictions: ``age`` is the steps the model had seen before
    the run; a step counts once the model had seen ``warmup``. Median measured and predicted ms, the relative
    errors (rounded) and a seeded sample of pairs."""
    pairs = [(r.predicted_ms, r.ms) for i, r in enumerate(log)
             if r.predicted_ms is not None and age + i >= warmup and r.ms > 0]
    cpu = [(r.predicted_cpu_ms, r.cpu_ms) for i, r in enumerate(log)
           if r.predicted_cpu_ms is not None and r.cpu_ms and age + i >= warmup]
    out = {"steps": len(log), "n": len(pairs), "measured_ms": statistics.median([r.ms for r in log]) if log else None}
    if cpu:  # the same against the steps' CPU time (what the costs are fitted to on a CPU)
        out["cpu_errors"] = [round((p - m) / m, 4) for p, m in cpu]
    if pairs:
        out["predicted_ms"] = statistics.median(p for p, _ in pairs)
        out["errors"] = [round((p - m) / m, 4) for p, m in pairs]
        out["pairs"] = [[round(p, 3), round(m, 3)] for p, m in
                        random.Random(len(pairs)).sample(pairs, min(SAMPLE, len(pairs)))]
    return out


def step_cost_rows(runs: list[dict]) -> list[dict]:
    """Per (contender, C, T): the steps counted, median measured and predicted step ms, and the median and
    90th percentile of the absolute relative error, pooled over the contender's runs there."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r.get("step_costs"):
            groups.setdefault((r["contender"], r["concurrency"], r["temperature"]), []).append(r)
    rows = []
    for (lab, C, T), rs in groups.items():
        errs = [e for r in rs for e in r["step_costs"].get("errors", [])]
        cpu = sorted(abs(e) for r in rs for e in r["step_costs"].get("cpu_errors", []))
        meas = [r["step_costs"]["measured_ms"] for r in rs if r["step_costs"].get("measured_ms") is not None]
        pred = [r["step_costs"]["predicted_ms"] for r in rs if r["step_costs"].get("predicted_ms") is not None]
        absd = sorted(abs(e) for e in errs)
        rows.append({"contender": lab, "gamma": rs[0].get("gamma"), "concurrency": C, "temperature": T,
                     "n": len(errs), "measured_ms": statistics.median(meas) if meas else None,
                     "predicted_ms": statistics.median(pred) if pred else None,
                     "median_abs_error": statistics.median(absd) if absd else None,
                     "p90_abs_error": absd[int(0.9 * (len(absd) - 1))] if absd else None,
                     "median_error": statistics.median(errs) if errs else None,
                     "cpu_median_abs_error": statistics.median(cpu) if cpu else None})
    return rows


def hindsight_model(records: list[StepRecord], key: dict | None = None) -> dict:
    """One model fitted to every timed step at once (no ageing, no prior): its costs, the steps it saw, its own
    median error on them (wall, and CPU time where measured) and ``key``, the setup they were measured on (a cost
    key: a policy refuses the file on another setup)."""
    m = OnlineCostModel.fit(records)
    m.key = key
    errs = sorted(abs(m.predict(r.shape) - r.ms) / r.ms for r in records if r.ms > 0)
    cpu = sorted(abs(m.predict_cpu(r.shape) - r.cpu_ms) / r.cpu_ms for r in records if r.cpu_ms)
    return {**m.to_dict(), "median_abs_error": errs[len(errs) // 2] if errs else None,
            "cpu_median_abs_error": cpu[len(cpu) // 2] if cpu else None}


def summary(rows: list[dict]) -> dict:
    """The pooled accuracy over every row: the median of the rows' median absolute errors (wall, and CPU time
    where measured), and the worst row."""
    have = [r for r in rows if r.get("median_abs_error") is not None]
    if not have:
        return {}
    worst = max(have, key=lambda r: r["median_abs_error"])
    cpu = [r["cpu_median_abs_error"] for r in have if r.get("cpu_median_abs_error") is not None]
    return {"median": statistics.median(r["median_abs_error"] for r in have), "worst": worst,
            "cpu_median": statistics.median(cpu) if cpu else None}


HINDSIGHT = " (hindsight costs)"  # the label suffix of a policy rerun on the costs measured in hindsight
TRUE_ACCEPTANCE = "oracle_budget" + HINDSIGHT  # the batched oracle on those costs: the true acceptance


def decomposition(rows: list[dict]) -> list[dict]:
    """Per adaptive policy run both ways and per (C, T): its tokens/s over the best static γ at (C, T) on the
    online model, on the costs measured in hindsight, and with the true acceptance too (the batched oracle
    on the hindsight costs); the gap's parts: ``costs`` (hindsight − online) and ``acceptance`` (true
    acceptance − hindsight)."""
    def ratio(label, C, T):
        r = next((r for r in rows if r["contender"] == label and r["concurrency"] == C and r["temperature"] == T), None)
        v = (r or {}).get("vs", {}).get("best_static") if r else None
        return v["ratio"] if v else None

    out = []
    for base in dict.fromkeys(r["contender"][: -len(HINDSIGHT)] for r in rows if r["contender"].endswith(HINDSIGHT)):
        if base == "oracle_budget":
            continue
        for C, T in sorted({(r["concurrency"], r["temperature"]) for r in rows if r["contender"] == base}):
            online, hind, true = ratio(base, C, T), ratio(base + HINDSIGHT, C, T), ratio(TRUE_ACCEPTANCE, C, T)
            out.append({"policy": base, "concurrency": C, "temperature": T, "online": online, "hindsight": hind,
                        "true_acceptance": true,
                        "costs": None if None in (online, hind) else hind - online,
                        "acceptance": None if None in (hind, true) else true - hind})
    return out
