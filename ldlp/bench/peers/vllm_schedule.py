"""vLLM's Dynamic SD schedule, picked from measurements (issue 36): ``speculative_config.
num_speculative_tokens_per_batch_size``, a list of ``(first batch size, last batch size, K)`` ranges that sets
the drafted tokens per step from the number of requests the step schedules (vLLM PR 32374).

* **The schedule file** (:func:`load_schedule`, :func:`check_schedule`): what ``scripts/tune_vllm_schedule.py``
  writes and ``engine=vllm spec.schedule=FILE`` runs; refused in one line before vLLM starts when it does not
  start at batch size 1, has overlapping ranges or a K above the maximum. :func:`dense_lookup` gives the K at
  every batch size as vLLM resolves a valid schedule (the clamp to ``num_speculative_tokens``, a gap or the
  tail carrying the last K forward).
* **Acceptance by position** (:func:`acceptance_by_position`): from vLLM's own per-position counter
  (``vllm:spec_decode_num_accepted_tokens_per_pos``: position i counts drafts whose first i + 1 tokens were
  accepted) over runs at one K each. Under greedy verification the i-th drafted token does not depend on how
  many follow it, so ``P(accepted length > i)`` measured at K >= i + 1 holds at every K; the expected tokens
  per request and step at K is ``1 + Σ_{i<K} p_i``.
* **Step time** (:class:`StepModel`): vLLM's steps, traced by the worker (wall and CPU seconds, requests,
  verified drafts, next K), fitted by non-negative least squares to

      ms = fixed + per_row · B + per_draft_forward · K + per_draft_token · B · K

  (K: the drafts made per request for the next step, the same K the step verified in a steady state: each
  drafted token costs a drafter row and a scored target row) on the steps that admit no prompt. At the grid's
  (B, K) cells the prediction is scaled to their median step (the ratio interpolated in log B between cells of
  one K), so the model is the grid itself where it was measured and the fit's shape between.
  With a budget the last step of a request wastes the drafts past it: :func:`tokens_per_step` gives the expected
  tokens per step for the prompt set's output lengths (an exact recursion on the tokens left).
* **Calibration** (:func:`calibrated`): the expected tokens/s at each grid C scaled to the grid's measured
  throughput there (whole calls: prefill, tail, the step time's spread), the scale interpolated in log B between
  grid C. The model gives the shape between grid points; the grid where it was measured.
* **The choice** (:func:`choose_schedule`, pure): at each batch size B the expected tokens/s of K is
  ``B · tokens(K) / ms(B, K)``; every B takes a K within ``margin`` of its best, with the fewest ranges (each
  threshold is a K switch under load: vllm-project/vllm issue 49548), then the most expected tokens/s in all.

Measuring the grid through the benchmark's vLLM worker is :mod:`ldlp.bench.peers.vllm_tune`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from eagle_backbone.runtime import int_setting

KEY = "num_speculative_tokens_per_batch_size"
MAX_K = 32  # the most drafted tokens a schedule may ask for here (the engine's own draft cap)


# ---- the schedule file --------------------------------------------------------------------------------------

def _ranges_from(obj, where: str) -> tuple[list, int | None]:
    """(ranges as given, num_speculative_tokens or None) from a list of ranges, ``{KEY: [...]}`` (optionally
    with ``num_speculative_tokens``) or ``{"speculative_config": {...}}``."""
    if isinstance(obj, dict) and "speculative_config" in obj:
        obj = obj["speculative_config"]
    k_max = None
    if isinstance(obj, dict):
        if KEY not in obj:
            raise ValueError(f"{where}: no {KEY} (a list of [first batch size, last batch size, K] ranges)")
        k_max = obj.get("num_speculative_tokens")
        if k_max is not None:
            int_setting(f"{where}: num_speculative_tokens", k_max, 1)
        obj = obj[KEY]
    if not isinstance(obj, list) or not obj:
        raise ValueError(f"{where}: {KEY} must be a non-empty list of [first batch size, last batch size, K] ranges")
    return obj, k_max


def check_schedule(ranges, k_max: int | None = None, where: str = "schedule") -> list[tuple[int, int, int]]:
    """The ranges as ``(first, last, K)`` tuples in order, or a one-line ValueError: an entry that is not three
    integers, a batch size below 1, first > last, a K below 0 or above ``k_max`` (vLLM would silently clamp it to
    ``num_speculative_tokens``), ranges that overlap or come out of order, or a first range not starting at
    batch size 1 (vLLM refuses that when its engine starts). A gap between ranges is vLLM's: the K before it
    carries on."""
    out = []
    for e in ranges:
        if (not isinstance(e, (list, tuple)) or len(e) != 3
                or any(isinstance(x, bool) or not isinstance(x, int) for x in e)):
            raise ValueError(f"{where}: each range must be [first batch size, last batch size, K] (integers), got {e!r}")
        a, b, k = e
        if a < 1 or b < a:
            raise ValueError(f"{where}: range {list(e)} must have 1 <= first batch size <= last batch size")
        if k < 0:
            raise ValueError(f"{where}: range {list(e)} has K = {k} < 0")
        cap = MAX_K if k_max is None else int(k_max)
        if k > cap:
            raise ValueError(f"{where}: range {list(e)} has K = {k} above the maximum {cap}"
                             + (" (num_speculative_tokens: vLLM would clamp it silently)" if k_max is not None else ""))
        out.append((a, b, k))
    for (a0, b0, _), (a1, b1, _) in zip(out, out[1:]):
        if a1 <= b0:
            raise ValueError(f"{where}: ranges [{a0}, {b0}] and [{a1}, {b1}] overlap or are out of order")
    if out[0][0] != 1:
        raise ValueError(f"{where}: the first range starts at batch size {out[0][0]}; it must start at 1 "
                         "(every batch size needs a K)")
    return out


def load_schedule(path: str | Path, k_max: int | None = None) -> dict:
    """A schedule file (JSON or YAML: the ranges, ``{KEY: ranges, "num_speculative_tokens": K}`` or the whole
    ``speculative_config``), checked (:func:`check_schedule`) against ``k_max`` (the contender's ``spec.k``;
    None: the file's ``num_speculative_tokens``, else :data:`MAX_K`). Returns {"ranges", "k" (the
    ``num_speculative_tokens`` to run: ``k_max``, the file's, else the largest K), "path"}, and "made_for" where
    the file records what it was tuned for (:func:`check_schedule_made_for`)."""
    path = Path(path)
    where = f"schedule {path}"
    if not path.is_file():
        raise ValueError(f"{where}: no such file")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            obj = yaml.safe_load(text)
        else:
            obj = json.loads(text)
    except Exception as e:  # noqa: BLE001  (any parse error is one line)
        raise ValueError(f"{where}: cannot be read as {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: "
                         f"{str(e).splitlines()[0]}") from None
    ranges, file_k = _ranges_from(obj, where)
    if k_max is not None and file_k is not None and int(file_k) != int(k_max):
        raise ValueError(f"{where}: num_speculative_tokens {file_k} differs from spec.k={k_max}")
    cap = k_max if k_max is not None else file_k
    out = check_schedule(ranges, cap, where)
    k = int(cap) if cap is not None else max(k for _, _, k in out)
    if k < 1:
        raise ValueError(f"{where}: every K is 0; a schedule needs K >= 1 somewhere")
    made_for = obj.get("made_for") if isinstance(obj, dict) else None  # beside speculative_config (tuned files)
    return {"ranges": out, "k": k, "path": str(path), **({"made_for": made_for} if isinstance(made_for, dict) else {})}


def check_schedule_made_for(schedule: dict, model_cfg, dtype: str) -> None:
    """A schedule file (:func:`load_schedule`) that says what it was measured on (``made_for``: the model, the
    dtype, the drafter and the CPU's capabilities: a schedule prices steps) checked against the run's model, vLLM's
    ``dtype`` and this machine: another setup is refused in one line naming the file and both sides
    (``accept_mismatch=true`` takes it, recorded). A file without the record is taken as it is."""
    from eagle_backbone.made_for import COST_FIELDS, check_made_for, run_made_for

    if schedule.get("made_for"):
        check_made_for(f"spec.schedule={schedule['path']}", schedule["made_for"],
                       {**run_made_for(model_cfg, costs=True), "dtype": dtype}, COST_FIELDS,
                       "tune one for this setup (python scripts/tune_vllm_schedule.py)")


def dense_lookup(ranges, max_batch: int, k_max: int) -> list[int]:
    """K at batch sizes 1..``max_batch`` (index B - 1) as vLLM resolves a checked schedule: each K clamped to
    ``k_max``, a gap between ranges and the sizes past the last range taking the K of the range before."""
    srt = sorted(tuple(r) for r in ranges)
    return [min(int(k_max), int([k for a, _, k in srt if a <= b][-1])) for b in range(1, int(max_batch) + 1)]


def ranges_from_table(table: dict) -> list[tuple[int, int, int]]:
    """A table from the largest batch size of each bucket to its K (a goodput learner's schedule,
    :meth:`ldlp.policies.goodput.GoodputFeedback.schedule`) as checked ranges, equal neighbours merged: {1: 4, 2: 4,
    4: 3, 8: 1} gives [(1, 2, 4), (3, 4, 3), (5, 8, 1)]. vLLM carries the last K past the last range."""
    out, lo = [], 1
    for hi, k in sorted((int(b), int(k)) for b, k in table.items()):
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], hi, k)
        else:
            out.append((lo, hi, k))
        lo = hi + 1
    return check_schedule(out, where="learned schedule")


def learned_schedules(serving_json: str | Path) -> dict:
    """{contender: {"ranges", "snippet"}} of every goodput learner in a serving run's ``serving.json``
    (``scripts/bench_batch.py serving=...``), or a one-line ValueError when the file is not one."""
    path = Path(serving_json)
    if path.is_dir():
        path = path / "serving.json"
    if not path.is_file():
        raise ValueError(f"learned: {path} does not exist (a serving run's folder: scripts/bench_batch.py serving=ramp)")
    rec = json.loads(path.read_text())
    out = {}
    for label, ln in (rec.get("learners") or {}).items():
        if ln and ln.get("schedule"):
            ranges = ranges_from_table(ln["schedule"])
            out[label] = {"ranges": ranges, "snippet": snippet(ranges, max(1, max(k for _, _, k in ranges))),
                          "source": str(path)}
    return out


def schedule_tag(ranges) -> str:
    """A short name: ``1-3:3,4-32:1``."""
    return ",".join(f"{a}-{b}:{k}" for a, b, k in ranges)


def snippet(ranges, k_max: int, method: str = "eagle", model: str | None = None) -> dict:
    """The ``speculative_config`` to paste: method, model, ``num_speculative_tokens`` and the schedule."""
    cfg = {"method": method, **({"model": model} if model else {}), "num_speculative_tokens": int(k_max),
           KEY: [[int(a), int(b), int(k)] for a, b, k in ranges]}
    return {"speculative_config": cfg}


# ---- acceptance by position ---------------------------------------------------------------------------------

def acceptance_by_position(runs: list[dict]) -> dict:
    """``p[i]`` = accepted at position i / drafts, pooled over ``runs`` (each with its constant ``k``,
    ``num_drafts`` and ``accepted_per_pos``) whose K reaches position i; ``drafts[i]`` the drafts behind it."""
    k_max = max((int(r["k"]) for r in runs), default=0)
    acc, drafts = [0] * k_max, [0] * k_max
    for r in runs:
        pos = list(r.get("accepted_per_pos") or [])
        for i in range(int(r["k"])):
            acc[i] += int(pos[i]) if i < len(pos) else 0
            drafts[i] += int(r["num_drafts"])
    p = [a / d if d else 0.0 for a, d in zip(acc, drafts)]
    return {"p": p, "drafts": drafts, "accepted": acc}


def expected_tokens(p, K: int) -> float:
    """Tokens a request gains per step at K drafted, in a steady state: 1 + Σ_{i<K} p_i."""
    return 1.0 + float(sum(p[:K]))


def expected_steps(p, K: int, n: int) -> float:
    """Expected decode steps for a request to emit ``n`` tokens at K drafted, when a step emits 1 + its accepted
    drafts and the last one stops at the budget (its drafts past it are wasted): an exact recursion on the
    tokens left, with P(accepted >= a) = p_{a-1}."""
    surv = [1.0] + [float(x) for x in p[:K]]
    pa = [surv[a] - (surv[a + 1] if a < K else 0.0) for a in range(K + 1)]
    S = [0.0] * (max(int(n), 0) + 1)
    for m in range(1, len(S)):
        S[m] = 1.0 + sum(q * S[m - min(a + 1, m)] for a, q in enumerate(pa))
    return S[-1]


def tokens_per_step(p, K: int, lengths=None) -> float:
    """Expected decode tokens per request and step at K for requests of these output ``lengths`` (the first token
    comes from the prefill): Σ (n - 1) / Σ expected_steps(n - 1), which a budget pulls below the steady state
    :func:`expected_tokens` (more for a larger K); None: the steady state."""
    ns = [int(n) - 1 for n in (lengths or []) if int(n) > 1]
    if not ns:
        return expected_tokens(p, K)
    counts: dict[int, int] = {}
    for n in ns:
        counts[n] = counts.get(n, 0) + 1
    return sum(ns) / sum(c * expected_steps(p, K, n) for n, c in counts.items())


def expected_tau(p, K: int, lengths) -> float:
    """Expected tokens per request forward, the prefill's included (what the benchmark reports as τ), for
    requests of these output lengths: Σ n / Σ (1 + expected_steps(n - 1))."""
    ns = [int(n) for n in lengths if int(n) > 0]
    return sum(ns) / sum(1 + expected_steps(p, K, n - 1) for n in ns) if ns else expected_tokens(p, K)


# ---- the step-time model ------------------------------------------------------------------------------------

FEATURES = ("fixed", "per_row", "per_draft_forward", "per_draft_token")
STEP_FIELDS = ("wall_s", "cpu_s", "batch", "new_requests", "scheduled_tokens", "verified", "next_k")


def step_features(B, K) -> np.ndarray:
    return np.array([1.0, B, K, B * K], dtype=float)


def decode_steps(steps: list, time: str = "cpu") -> list[tuple[int, int, int, float]]:
    """(batch, verified drafts, next K, ms) of the traced steps that admit no prompt (``steps``: the worker's
    lists, :data:`STEP_FIELDS`); ``time``: ``cpu`` (the process's CPU time: another job on the core does not
    stretch it) or ``wall``."""
    col = STEP_FIELDS.index("cpu_s" if time == "cpu" else "wall_s")
    return [(int(s[2]), int(s[5]), int(s[6]), 1e3 * float(s[col])) for s in steps if int(s[3]) == 0 and int(s[2]) > 0]


class StepModel:
    """Step milliseconds at B requests drafting K (verifying K per request, as in a steady state)."""

    def __init__(self, coef: dict, cells: list[dict]):
        self.coef = {k: float(coef[k]) for k in FEATURES}
        self.cells = cells  # [{"batch", "k", "steps", "median_ms", "fit_ms"}]
        self._anchor: dict[int, list[tuple[float, float]]] = {}
        for c in cells:
            if c.get("anchor", False) and c["fit_ms"] > 0:
                self._anchor.setdefault(c["k"], []).append((math.log(c["batch"]), c["median_ms"] / c["fit_ms"]))
        for v in self._anchor.values():
            v.sort()

    @classmethod
    def fit(cls, steps: list[tuple[int, int, int, float]], min_steps: int = 5, anchor_batches=(),
            min_anchor_steps: int = 20) -> StepModel:
        """Non-negative least squares on the per-(B, verified, K) cells' median ms (cells of at least
        ``min_steps`` steps, each weighted by its steps). With ``anchor_batches`` (the grid's C;
        None: any batch size) the prediction is scaled to the median of the steady cells (verified = B · K) there
        with at least ``min_anchor_steps`` steps; by default the fit alone, which averages the cells' noise."""
        from eagle_backbone.step_cost import nonnegative_least_squares

        groups: dict[tuple, list[float]] = {}
        for B, ver, K, ms in steps:
            groups.setdefault((B, ver, K), []).append(ms)
        rows, ys, counts = [], [], []
        for (B, ver, K), v in groups.items():
            if len(v) >= min_steps:
                rows.append(step_features(B, K))
                ys.append(float(np.median(v)))
                counts.append(len(v))
        if len(rows) < len(FEATURES):
            raise ValueError(f"step model: {len(rows)} (batch, K) cells with {min_steps}+ steps; it needs "
                             f"{len(FEATURES)} (more prompts per cell, or more batch sizes or K)")
        theta = nonnegative_least_squares(np.array(rows), np.array(ys), np.array(counts, dtype=float))
        coef = dict(zip(FEATURES, theta))
        cells = []
        for (B, ver, K), v in sorted(groups.items()):
            if ver == B * K and len(v) >= min_steps:
                cells.append({"batch": B, "k": K, "steps": len(v), "median_ms": float(np.median(v)),
                              "fit_ms": float(step_features(B, K) @ theta),
                              "anchor": len(v) >= min_anchor_steps and (anchor_batches is None or B in anchor_batches)})
        return cls(coef, cells)

    def fit_ms(self, B: int, K: int) -> float:
        return float(step_features(B, K) @ np.array([self.coef[k] for k in FEATURES]))

    def __call__(self, B: int, K: int) -> float:
        base = self.fit_ms(B, K)
        anchors = self._anchor.get(K)
        if not anchors:
            return base
        x = math.log(B)
        xs, rs = [a for a, _ in anchors], [r for _, r in anchors]
        return base * float(np.interp(x, xs, rs))

    def to_dict(self) -> dict:
        return {"coef": self.coef, "cells": self.cells}

    @classmethod
    def from_dict(cls, d: dict) -> StepModel:
        return cls(d["coef"], d["cells"])


def calibrated(step_ms: Callable[[int, int], float], tokens: dict, measured: dict) -> tuple[Callable, dict]:
    """The step model calibrated to the grid's measured throughput: ``measured`` (K, C) -> tokens/s of whole
    calls of C requests (their prefill, tail and everything outside a steady step included). At each grid C the
    expected tokens/s ``1000 · C · tokens[K] / step_ms(C, K)`` is scaled to the measured; between grid C the
    scale is interpolated in log B (held at the ends). Returns (the effective ms(B, K) the choice prices K by,
    the scale per (K, C))."""
    scale = {(K, C): v / (1e3 * C * tokens[K] / step_ms(C, K)) for (K, C), v in measured.items() if v}
    per_k: dict[int, list[tuple[float, float]]] = {}
    for (K, C), r in sorted(scale.items()):
        per_k.setdefault(K, []).append((math.log(C), r))

    def ms(B: int, K: int) -> float:
        pts = per_k.get(K)
        r = float(np.interp(math.log(B), [x for x, _ in pts], [y for _, y in pts])) if pts else 1.0
        return step_ms(B, K) / r

    return ms, scale


# ---- the choice ---------------------------------------------------------------------------------------------

def choose_schedule(max_batch: int, ks, tokens, step_ms: Callable[[int, int], float], margin: float = 0.0) -> dict:
    """The schedule for batch sizes 1..``max_batch``: at batch size B, K drafted gives the expected tokens/s
    ``1000 · B · tokens[K] / step_ms(B, K)`` (``tokens``: expected tokens per request and step at each K in ``ks``,
    :func:`tokens_per_step`). Each B may take any K within ``margin`` (a fraction) of its best rate; among those
    assignments the schedule has the fewest ranges (each threshold is a K switch under load, vllm-project/vllm
    issue 49548, and a near-tie is within the measurement's noise), then the most total expected tokens/s over
    the batch sizes, then the smaller K. ``margin`` 0: the best K at every batch size. Returns {"per_batch":
    [{"batch", "k", "best_k", "rates": {K: tokens/s}}], "ranges": [[first, last, K]]}."""
    ks = sorted(int(k) for k in ks)
    if not ks or ks[0] < 0:
        raise ValueError(f"ks must be non-empty and >= 0, got {ks}")
    missing = [K for K in ks if K not in tokens]
    if missing:
        raise ValueError(f"no expected tokens per step for K = {missing}")
    rates = [{K: 1e3 * B * float(tokens[K]) / step_ms(B, K) for K in ks} for B in range(1, int(max_batch) + 1)]
    best = [max(ks, key=lambda K: (r[K], -K)) for r in rates]
    allowed = [[K for K in ks if r[K] >= (1 - margin) * r[b] - 1e-12] for r, b in zip(rates, best)]
    # dynamic programme over batch sizes: per K at B, the best (ranges, -total rate, K path) ending there
    score = {K: (1, -rates[0][K]) for K in allowed[0]}
    back: list[dict] = [{K: None for K in allowed[0]}]
    for i in range(1, len(rates)):
        new, prev = {}, {}
        for K in allowed[i]:
            cand = min(((score[J][0] + (J != K), score[J][1] - rates[i][K], J) for J in score))
            new[K], prev[K] = cand[:2], cand[2]
        score = new
        back.append(prev)
    k = min(score, key=lambda K: (score[K], K))
    path = [k]
    for i in range(len(rates) - 1, 0, -1):
        k = back[i][k]
        path.append(k)
    path.reverse()
    per = [{"batch": B, "k": K, "best_k": b, "rates": r}
           for B, (K, b, r) in enumerate(zip(path, best, rates), start=1)]
    ranges: list[list[int]] = []
    for row in per:
        if ranges and ranges[-1][2] == row["k"]:
            ranges[-1][1] = row["batch"]
        else:
            ranges.append([row["batch"], row["batch"], row["k"]])
    return {"per_batch": per, "ranges": ranges}
