"""The statistics every comparison shares: the median, the best adaptive contender, its verdict, the headroom.

One definition of each, so the head to head, the pooled runs and the sweeps' summary agree.
"""

from __future__ import annotations

import math
import statistics

from eagle_backbone.timing import paired_ratio  # noqa: F401  (the one paired bootstrap, beside the timing it reads)


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
