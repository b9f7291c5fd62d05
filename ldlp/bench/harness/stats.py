"""The statistics every comparison shares: the paired ratio and its bootstrap interval, the median, the best
adaptive contender, its verdict, the headroom.

One definition of each, so the head to head, the pooled runs, the drafters, the load sweep, the serving traces,
the peers and the sweeps' summary agree.
"""

from __future__ import annotations

import math
import statistics

import numpy as np


def _resampled(x: np.ndarray, pick: np.ndarray) -> np.ndarray:
    """Per bootstrap draw, the sum of ``x`` over the units ``pick`` draws (its last axis) and every other axis:
    (bootstrap,)."""
    drawn = x[..., pick]  # (*other, bootstrap, units)
    return drawn.sum(tuple(range(x.ndim - 1)) + (x.ndim,))


def _interval(boot: np.ndarray, level: float, tails: tuple[float, float] | None) -> list[float]:
    lo_q, hi_q = tails if tails is not None else ((1 - level) / 2, (1 + level) / 2)
    return [float(np.quantile(boot, lo_q)), float(np.quantile(boot, hi_q))]


def paired_ratio(num_tokens, num_seconds, den_tokens, den_seconds, bootstrap: int = 2000, seed: int = 0,
                 level: float = 0.95, *, tails: tuple[float, float] | None = None, runs: bool = False) -> dict:
    """The throughput ratio of a contender (num) to a baseline (den) measured on the same pairs (e.g. the
    same (round, block) workloads, timed in turns), with a paired bootstrap interval: the one ratio interval
    of every comparison.

    The ratio is (Σ num_tokens / Σ num_seconds) / (Σ den_tokens / Σ den_seconds): tokens per second over all
    pairs, so tokens need not match between the two (sampled outputs differ), and under greedy decoding
    it is the ratio of total seconds. With ``num_tokens`` and ``den_tokens`` None (both ran the same tokens) it is
    Σ den_seconds / Σ num_seconds. The bootstrap draws the units of the last axis with replacement
    (``bootstrap`` times, numpy's generator seeded with ``seed``), each unit keeping both its measurements and
    all of its other axes (e.g. a prompt with all its rounds: seconds of shape (rounds, prompts)), and reports
    the ratio's central ``level`` quantile interval (``tails``: the two quantiles, where given).

    ``runs=True``: the seconds are lists, one array per run (``num_seconds[j]`` None where the contender did not
    run in run j; the baseline ran in all), tokens None; the ratio pools the runs the contender is in, and the
    bootstrap resamples those runs (numpy's generator seeded with ``[seed, *their indices]``) and then the units
    within each run (one draw per run, from the generator seeded with ``seed``, shared by every contender).

    Returns {"ratio", "ci95" ([lo, hi], or None with fewer than 2 pairs), "pairs", "half_width" (half the
    interval's width, in ratio units), "resolves_5pct" (half-width at most 0.05: the interval tells a 5%
    difference from none)}."""
    if not 0 < level < 1:
        raise ValueError(f"paired_ratio: level must be in (0, 1), got {level}")
    if runs:
        return _pooled_over_runs(num_seconds, den_seconds, bootstrap, seed, level, tails)
    if (num_tokens is None) != (den_tokens is None):
        raise ValueError("paired_ratio: give both token counts or neither")
    given = (num_seconds, den_seconds) if num_tokens is None else (num_tokens, num_seconds, den_tokens, den_seconds)
    arrays = [np.asarray(x, dtype=float) for x in given]
    shape = arrays[0].shape
    if any(a.shape != shape for a in arrays) or not shape:
        raise ValueError(f"paired_ratio: the inputs must be arrays of one length (and shape), got shapes {[a.shape for a in arrays]}")
    n = shape[-1]
    if n == 0:
        raise ValueError("paired_ratio: no pairs")
    if (arrays[-3 if num_tokens is not None else 0] <= 0).any() or (arrays[-1] <= 0).any():
        raise ValueError("paired_ratio: seconds must be > 0")
    if num_tokens is None:
        ns, ds = arrays
        ratio = float(ds.sum() / ns.sum())
    else:
        nt, ns, dt, ds = arrays
        ratio = float((nt.sum() / ns.sum()) / (dt.sum() / ds.sum()))
    out = {"ratio": ratio, "ci95": None, "pairs": int(n), "half_width": None, "resolves_5pct": False}
    if n < 2:
        return out
    pick = np.random.default_rng(seed).integers(0, n, size=(int(bootstrap), n))
    if num_tokens is None:
        boot = _resampled(ds, pick) / _resampled(ns, pick)
    else:
        boot = (_resampled(nt, pick) / _resampled(ns, pick)) / (_resampled(dt, pick) / _resampled(ds, pick))
    lo, hi = _interval(boot, level, tails)
    out.update(ci95=[lo, hi], half_width=(hi - lo) / 2, resolves_5pct=(hi - lo) / 2 <= 0.05)
    return out


def _pooled_over_runs(num_seconds, den_seconds, bootstrap: int, seed: int, level: float,
                      tails: tuple[float, float] | None) -> dict:
    """:func:`paired_ratio` pooled over runs (``runs=True``)."""
    den = [np.asarray(d, dtype=float) for d in den_seconds]
    if len(num_seconds) != len(den) or not den:
        raise ValueError(f"paired_ratio: one array per run for both, got {len(num_seconds)} and {len(den)}")
    present = [j for j, x in enumerate(num_seconds) if x is not None]
    if not present:
        raise ValueError("paired_ratio: the contender ran in no run")
    num = {j: np.asarray(num_seconds[j], dtype=float) for j in present}
    if any(num[j].shape != den[j].shape for j in present):
        raise ValueError("paired_ratio: a run's two arrays differ in shape")
    ratio = float(sum(den[j].sum() for j in present) / sum(num[j].sum() for j in present))
    rng = np.random.default_rng(seed)
    draws = [rng.integers(0, d.shape[-1], size=(bootstrap, d.shape[-1])) for d in den]  # every run's, in order
    pick = np.random.default_rng([seed, *present]).integers(0, len(present), size=(bootstrap, len(present)))
    cols = np.arange(bootstrap)[:, None]

    def seconds(arrays):  # (bootstrap,): the resampled runs' sums of their resampled units
        return np.stack([_resampled(arrays[j], draws[j]) for j in present])[pick, cols].sum(1)

    boot = seconds(den) / seconds(num)
    lo, hi = _interval(boot, level, tails)
    return {"ratio": ratio, "ci95": [lo, hi], "pairs": int(sum(den[j].shape[-1] for j in present)),
            "half_width": (hi - lo) / 2, "resolves_5pct": (hi - lo) / 2 <= 0.05}


def median(values) -> float | None:
    """The median of the values that are not None, as a float; None when none are left."""
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def percent(x: float | None) -> str:
    """A share as a whole percentage ("37%"), "–" when there is none."""
    return "–" if x is None else f"{100 * x:.0f}%"


def best_adaptive(rows: list[dict], ratio: str) -> tuple[dict | None, dict]:
    """The adaptive row (the oracle is not one) with the highest ``ratio`` to the best static contender,
    and the verdict's keys: its name, gain, the gain's 95% interval and whether it excludes zero."""
    adaptive = [r for r in rows if r.get("adaptive") and r.get("policy") != "oracle" and "ci95" in r]
    if not adaptive:
        return None, {}
    best = max(adaptive, key=lambda r: r[ratio])
    return best, {"best_adaptive": best["contender"], "adaptive_gain": best[ratio] - 1,
                  "adaptive_gain_ci95": [best["ci95"][0] - 1, best["ci95"][1] - 1],
                  "adaptive_beats_static": best["ci95"][0] > 1}


def headroom_captured(best: float, static: float, oracle: float | None) -> float | None:
    """(best − static) / (oracle − static): the share of the oracle's gain over the best static γ that an
    adaptive policy captures, in any unit where larger is better (tokens/s, or ratios to the static
    reference, which is then 1). None when there is no oracle or no headroom (oracle ≤ static) or a value
    is not finite."""
    if oracle is None or not all(math.isfinite(x) for x in (best, static, oracle)) or oracle <= static:
        return None
    return (best - static) / (oracle - static)
