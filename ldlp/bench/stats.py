"""The statistics every comparison shares: the median, the best adaptive contender, its verdict, the headroom.

One definition of each, so the head to head, the pooled runs and the sweeps' summary agree.
"""

from __future__ import annotations

import math
import statistics


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


def verdict_line(result: dict, ref: str, what: str) -> str:
    lo, hi = result["adaptive_gain_ci95"]
    word = "faster than" if lo > 0 else "slower than" if hi < 0 else "not distinguishable from"
    return (f"- {what}: **{result['best_adaptive']}**, {100 * result['adaptive_gain']:+.1f}% vs {ref} "
            f"(95% interval {100 * lo:+.1f}% to {100 * hi:+.1f}%): {word} the best static γ")


def headroom_captured(best: float, static: float, oracle: float | None) -> float | None:
    """(best − static) / (oracle − static): the share of the oracle's gain over the best static γ that an
    adaptive policy captures, in any unit where larger is better (tokens/s, or ratios to the static
    reference, which is then 1). None when there is no oracle or no headroom (oracle ≤ static) or a value
    is not finite."""
    if oracle is None or not all(math.isfinite(x) for x in (best, static, oracle)) or oracle <= static:
        return None
    return (best - static) / (oracle - static)


def paired_ratio(num_tokens, num_seconds, den_tokens, den_seconds, bootstrap: int = 2000, seed: int = 0,
                 level: float = 0.95) -> dict:
    """The throughput ratio of a contender (num) to a baseline (den) measured on the same pairs (e.g. the
    same (round, block) workloads, timed in turns), with a paired bootstrap interval.

    The ratio is (Σ num_tokens / Σ num_seconds) / (Σ den_tokens / Σ den_seconds): tokens per second over all
    pairs, so tokens need not match between the two (sampled outputs differ), and under greedy decoding
    it is the ratio of total seconds. The bootstrap draws pairs with replacement (``bootstrap`` times, numpy's
    generator seeded with ``seed``), each pair keeping both its measurements, and reports the ratio's central
    ``level`` quantile interval. Returns {"ratio", "ci95" ([lo, hi], or None with fewer than 2 pairs), "pairs",
    "half_width" (half the interval's width, in ratio units), "resolves_5pct" (half-width at most 0.05: the
    interval tells a 5% difference from none)}."""
    import numpy as np

    arrays = [np.asarray(x, dtype=float) for x in (num_tokens, num_seconds, den_tokens, den_seconds)]
    n = len(arrays[0])
    if any(a.shape != (n,) for a in arrays):
        raise ValueError(f"paired_ratio: the four inputs must be 1-D of one length, got shapes {[a.shape for a in arrays]}")
    if n == 0:
        raise ValueError("paired_ratio: no pairs")
    if (arrays[1] <= 0).any() or (arrays[3] <= 0).any():
        raise ValueError("paired_ratio: seconds must be > 0")
    if not 0 < level < 1:
        raise ValueError(f"paired_ratio: level must be in (0, 1), got {level}")
    nt, ns, dt, ds = arrays
    ratio = float((nt.sum() / ns.sum()) / (dt.sum() / ds.sum()))
    out = {"ratio": ratio, "ci95": None, "pairs": int(n), "half_width": None, "resolves_5pct": False}
    if n < 2:
        return out
    pick = np.random.default_rng(seed).integers(0, n, size=(int(bootstrap), n))
    boot = (nt[pick].sum(1) / ns[pick].sum(1)) / (dt[pick].sum(1) / ds[pick].sum(1))
    lo, hi = (float(np.quantile(boot, q)) for q in ((1 - level) / 2, (1 + level) / 2))
    out.update(ci95=[lo, hi], half_width=(hi - lo) / 2, resolves_5pct=(hi - lo) / 2 <= 0.05)
    return out
