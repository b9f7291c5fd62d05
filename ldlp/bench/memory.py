"""The process's resident memory over a long run: sampled by a background thread, summarised for the page.

A benchmark that runs for many minutes must not grow: :class:`RssSampler` reads the resident set size (Linux
``/proc/self/statm``; elsewhere only the peak, from ``getrusage``) every ``every_s`` seconds, and
:meth:`RssSampler.summary` gives the peak, the value after warm-up (the first sample past ``warmup_s``) and at the
end, and the growth from warm-up to the end, which the load sweep's page states."""

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
    block (or the process), and reading /proc costs microseconds, so the timings beside it do not feel it."""

    def __init__(self, every_s: float = 5.0, warmup_s: float = 60.0):
        if not every_s > 0:
            raise ValueError(f"RssSampler: every_s must be > 0, got {every_s!r}")
        self.every_s, self.warmup_s = float(every_s), float(warmup_s)
        self.samples: list[tuple[float, int]] = []  # (seconds since the start, bytes)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self.warm_at: float | None = None  # seconds since the start when the run said it was warm (mark_warm)

    def _sample(self) -> None:
        value = rss_bytes()
        if value is not None:
            self.samples.append((round(time.perf_counter() - self._t0, 3), value))

    def mark_warm(self) -> None:
        """The run is past its warm-up (e.g. every concurrency seen once): the growth is measured from here."""
        if self.warm_at is None:
            self._sample()
            self.warm_at = self.samples[-1][0] if self.samples else 0.0

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

    def summary(self) -> dict:
        """Bytes: ``peak`` (getrusage's, the whole process so far), ``after_warmup`` (the sample at :meth:`mark_warm`,
        else the first at or past ``warmup_s``, else the first), ``end``, ``growth`` (end / after_warmup - 1), and
        the samples themselves."""
        warmup = self.warm_at if self.warm_at is not None else self.warmup_s
        out = {"peak_bytes": peak_rss_bytes(), "every_s": self.every_s, "warmup_s": warmup,
               "warm_marked": self.warm_at is not None, "samples": [list(s) for s in self.samples]}
        if self.samples:
            warm = next((v for t, v in self.samples if t >= warmup), self.samples[0][1])
            end = self.samples[-1][1]
            out.update(after_warmup_bytes=warm, end_bytes=end, max_sampled_bytes=max(v for _, v in self.samples),
                       growth=end / warm - 1 if warm else None, seconds=self.samples[-1][0])
        return out


def memory_line(summary: dict | None) -> str | None:
    """One line for a page: the peak, and the growth from warm-up to the end where sampled."""
    if not summary:
        return None
    gb = lambda b: f"{b / 2 ** 30:.2f} GB"  # noqa: E731
    line = f"Memory (resident): peak {gb(summary['peak_bytes'])}"
    if summary.get("after_warmup_bytes"):
        warm = "the first round" if summary.get("warm_marked") else "warm-up"
        line += (f"; {gb(summary['after_warmup_bytes'])} after {summary['warmup_s']:.0f} s ({warm}), "
                 f"{gb(summary['end_bytes'])} at the end ({summary['seconds'] / 60:.1f} min), "
                 f"{100 * summary['growth']:+.1f}% (sampled every {summary['every_s']:g} s)")
    return line + "."
