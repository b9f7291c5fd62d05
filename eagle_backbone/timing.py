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

