"""Timing: the median of repeated calls, and one interleaved runner for every comparison of timings.

On a shared machine the speed drifts over minutes by more than the few percent that separate the
things compared here, so every comparison runs its contenders in turns: for each round, for each
item (a prompt, or one step), every runner once, in an order that changes with the round and the
item (:data:`ORDERS`). :func:`interleaved` is that loop, used by the evaluation, the head to head,
the choice of the AR baseline, the replay tuner's cost fit, the model card and the target benchmark.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from eagle_backbone.runtime import Clock

# fixed:     every runner in the given order
# alternate: the given order, reversed on every other (round + item)
# rotate:    the order shifted by one per (round, item), so every runner takes every place
ORDERS = ("fixed", "alternate", "rotate")


def turn_order(n_runners: int, order: str, round_: int, item: int, n_items: int) -> list[int]:
    """The runners' indices in the order they take their turns on ``item`` in ``round_``."""
    idx = list(range(n_runners))
    if order == "fixed":
        return idx
    if order == "alternate":
        return idx if (round_ + item) % 2 == 0 else idx[::-1]
    if order == "rotate":
        shift = (round_ * n_items + item) % n_runners
        return idx[shift:] + idx[:shift]
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def interleaved(runners: Sequence, items: Sequence, rounds: int, call: Callable, order: str = "alternate",
                after_item: Callable[[], None] | None = None) -> list[list[list]]:
    """``results[i][r][k] = call(runners[i], items[k], k, r)``, run round by round, item by item, every
    runner taking its turn on each item in the order :func:`turn_order` gives. ``after_item`` is called
    once all runners have had an item (a progress bar's update)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    results = [[[None] * len(items) for _ in range(rounds)] for _ in runners]
    for r in range(rounds):
        for k, item in enumerate(items):
            for i in turn_order(len(runners), order, r, k, len(items)):
                results[i][r][k] = call(runners[i], item, k, r)
            if after_item is not None:
                after_item()
    return results


def median_seconds(fn: Callable[[], object], reps: int, warmup: int = 5, clock: Clock | None = None) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls, after ``min(warmup, reps)`` untimed calls.

    ``clock`` (default: the CPU's) waits for the device before each reading when it is a GPU's."""
    clock = clock or Clock()
    for _ in range(min(warmup, reps)):
        fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


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
