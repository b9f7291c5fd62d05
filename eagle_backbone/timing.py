"""Timing: the median of repeated calls, and one interleaved runner for every comparison of timings.

On a shared machine the speed drifts over minutes by more than the few percent that separate the
things compared here, so every comparison runs its contenders in turns: for each round, for each
item (a prompt, or one step), every runner once, in an order that changes with the round and the
item (:data:`ORDERS`). :func:`interleaved` is that loop, used by every comparison: the evaluation, the head to
head, the drafters, the load sweep, the serving traces, the vLLM tuner's grid, the engine against an older
commit, the attention kernels, the choice of the AR baseline, the replay tuner's cost fit, the model card and
the target benchmark.

The engine's own clocks live here too: :class:`ComponentProfile` (per-component seconds in profiled mode)
and :class:`StepClock` (each step's milliseconds for the step-cost records).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from eagle_backbone.runtime import Clock

# fixed:     every runner in the given order
# alternate: the given order, reversed on every other (round + item)
# rotate:    the order shifted by one per (round, item), so every runner takes every place
ORDERS = ("fixed", "alternate", "rotate")


def turn_order(n_runners: int, order: str, round_: int, item: int, n_items: int, offset: int = 0) -> list[int]:
    """The runners' indices in the order they take their turns on ``item`` in ``round_`` (``offset``: added to
    the turn's count, for a caller that runs its rounds or cells one call at a time)."""
    idx = list(range(n_runners))
    if order == "fixed":
        return idx
    if order == "alternate":
        return idx if (offset + round_ + item) % 2 == 0 else idx[::-1]
    if order == "rotate":
        shift = (offset + round_ * n_items + item) % n_runners
        return idx[shift:] + idx[:shift]
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def interleaved(runners: Sequence, items: Sequence, rounds: int, call: Callable, order: str = "alternate",
                after_item: Callable[[], None] | None = None, offset: int = 0) -> list[list[list]]:
    """``results[i][r][k] = call(runners[i], items[k], k, r)``, run round by round, item by item, every
    runner taking its turn on each item in the order :func:`turn_order` gives (``offset``: its offset, e.g.
    the round of a caller that runs one round at a time). ``after_item`` is called once all runners have had
    an item (a progress bar's update)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    results = [[[None] * len(items) for _ in range(rounds)] for _ in runners]
    for r in range(rounds):
        for k, item in enumerate(items):
            for i in turn_order(len(runners), order, r, k, len(items), offset):
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


class ComponentProfile:
    """Per-component seconds in profiled mode only (the timed mode never marks). On a GPU, CUDA events
    recorded at each mark and read once at the end of the step (one synchronisation a step, not one a
    component); on a CPU, perf_counter (the work is done when the call returns)."""

    def __init__(self, device, on: bool):
        self.on, self.cuda = on, device.type == "cuda"
        self.s: dict[str, float] = {}
        self._t = None
        self._events: list[tuple[str, object, object]] = []

    def start(self):
        if not self.on:
            return
        if self.cuda:
            self._t = torch.cuda.Event(enable_timing=True)
            self._t.record()
        else:
            self._t = time.perf_counter()

    def mark(self, name: str):
        if not self.on:
            return
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self._events.append((name, self._t, e))
            self._t = e
        else:
            t = time.perf_counter()
            self.s[name] = self.s.get(name, 0.0) + t - self._t
            self._t = t

    def flush(self):
        """Add the step's CUDA event intervals (one synchronisation)."""
        if self.on and self._events:
            self._events[-1][2].synchronize()
            for name, a, b in self._events:
                self.s[name] = self.s.get(name, 0.0) + a.elapsed_time(b) / 1e3
            self._events = []


class StepClock:
    """A step's milliseconds for the step-cost records: on a CPU a wall clock and the thread's CPU clock read
    at the start and the end (torch on one thread computes on this thread; another process on the core
    stretches the wall time, not the CPU time); on a GPU a CUDA event at the start and one just before the
    step's host read, read after it (the read has synchronised, so no extra synchronisation), plus the host's
    time after the read, and no CPU time."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self._t0 = self._t1 = self._t_read = self._c0 = 0.0
        self._ev = None

    def start(self):
        self._t0 = time.perf_counter()
        self._c0 = time.thread_time()
        if self.cuda:
            self._ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._ev[0].record()

    @property
    def started(self) -> float:
        """The wall clock (``time.perf_counter``) at the last :meth:`start`."""
        return self._t0

    @property
    def stopped(self) -> float:
        """The wall clock at the last :meth:`ms` (the step's end as measured)."""
        return self._t1

    def before_read(self):
        if self.cuda:
            self._ev[1].record()
            self._t_read = time.perf_counter()

    def ms(self) -> tuple[float, float | None]:
        """(wall ms, CPU ms or None on a GPU)."""
        now = self._t1 = time.perf_counter()
        if self.cuda:  # the events finished before the host read returned
            return self._ev[0].elapsed_time(self._ev[1]) + 1e3 * (now - self._t_read), None
        return 1e3 * (now - self._t0), 1e3 * (time.thread_time() - self._c0)
