"""The process's resident memory over a long run: sampled by a background thread, summarised for the page.

A benchmark that runs for many minutes must not grow: :class:`RssSampler` reads the resident set size (Linux
``/proc/self/statm``; elsewhere only the peak, from ``getrusage``) every ``every_s`` seconds, and
:meth:`RssSampler.summary` gives the peak and, per round of the run, its peak and floor, and the growth from the
first round to the last, which the load sweep's page states."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import sys
import threading
import time

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """The resident set size now (Linux), or None where /proc is not there."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def _libc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _libc_trim()


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim(0)``; elsewhere nothing). An engine's
    KV caches and activations are freed when a run ends, but glibc keeps freed heap pages of tensors below its
    mmap threshold (which it raises up to 32 MB after freeing larger ones), so runs of changing sizes left the
    process's resident memory at its high-water mark and fragmented: the long-prompt load sweep held 1.9 GB where
    0.9 GB was live. Milliseconds; call it between runs, outside the clock."""
    if _TRIM is not None:
        _TRIM(0)


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (getrusage: kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class RssSampler:
    """``with RssSampler(every_s=5) as rss: ...``; then ``rss.summary()``. A daemon thread: it stops with the
    block (or the process), and reading /proc costs microseconds, so the timings beside it do not feel it.

    A run's resident memory swings with what it runs (a load sweep's C = 32 run on long prompts holds twice what it
    holds between runs), so two samples taken at different moments say little: the run :meth:`mark` s where its
    rounds begin, and the summary compares like with like, each round's peak and floor (the lowest sample: what
    stays live between runs)."""

    def __init__(self, every_s: float = 5.0):
        if not every_s > 0:
            raise ValueError(f"RssSampler: every_s must be > 0, got {every_s!r}")
        self.every_s = float(every_s)
        self.samples: list[tuple[float, int]] = []  # (seconds since the start, bytes)
        self.marks: list[tuple[float, str]] = []  # (seconds since the start, the segment that begins there)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _sample(self) -> None:
        value = rss_bytes()
        if value is not None:
            self.samples.append((round(time.perf_counter() - self._t0, 3), value))

    def mark(self, label: str) -> None:
        """A segment of the run begins now (e.g. "round 2"); what came before it is the previous segment (the
        first: "warm-up")."""
        self._sample()
        self.marks.append((self.samples[-1][0] if self.samples else 0.0, label))

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self) -> RssSampler:
        self._t0 = time.perf_counter()
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()

    def segments(self) -> list[dict]:
        """Per segment (warm-up, then one per :meth:`mark`): its label, start, peak and floor in bytes."""
        bounds = [(0.0, "warm-up")] + self.marks
        out = []
        for i, (t0, label) in enumerate(bounds):
            t1 = bounds[i + 1][0] if i + 1 < len(bounds) else float("inf")
            vals = [v for t, v in self.samples if t0 <= t <= t1]
            if vals:
                out.append({"label": label, "start_s": t0, "peak_bytes": max(vals), "floor_bytes": min(vals),
                            "complete": i + 1 < len(bounds)})
        return out

    def summary(self) -> dict:
        """``peak_bytes`` (getrusage's, the whole process), the samples, the :meth:`segments`, and where at least
        two segments follow the warm-up, ``growth``: the last complete one's peak over the first's, less 1, and
        ``floor_growth`` the same for the floors."""
        segs = self.segments()
        out = {"peak_bytes": peak_rss_bytes(), "every_s": self.every_s, "segments": segs,
               "seconds": self.samples[-1][0] if self.samples else 0.0,
               "samples": [list(x) for x in self.samples]}
        rounds = [g for g in segs[1:] if g["complete"]]
        if len(rounds) >= 2:
            first, last = rounds[0], rounds[-1]
            out.update(growth=last["peak_bytes"] / first["peak_bytes"] - 1,
                       floor_growth=last["floor_bytes"] / first["floor_bytes"] - 1,
                       compared=[first["label"], last["label"]])
        return out
