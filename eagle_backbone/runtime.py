"""Process settings every stage shares: torch's thread count, and a clock that waits for the device.

Threads are set once per process from the config's ``threads`` (``None``: leave torch's default).
torch's default uses every core, which oversubscribes a shared machine and makes timings swing by
an order of magnitude; every script therefore calls :func:`set_threads` before any work.
"""

from __future__ import annotations

import time

import torch


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (and the BLAS pools behind numpy/sklearn) when ``threads`` is given;
    returns the count in force."""
    if threads:
        n = int(threads)
        if n < 1:
            raise ValueError(f"threads must be >= 1 (or null for torch's default), got {threads!r}")
        torch.set_num_threads(n)
        try:  # numpy/scikit-learn's BLAS pools, when threadpoolctl is there
            from threadpoolctl import threadpool_limits

            threadpool_limits(n)
        except ImportError:
            pass
    return torch.get_num_threads()


class Clock:
    """perf_counter that waits for the GPU, so seconds land on the part that spent them.

    For profiling only: a synchronising clock inside a hot loop biases what it measures on a GPU."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def to_device(values, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list (indices, lengths, seeds) as a tensor on ``device``, without waiting for the device.

    ``torch.tensor(values, device="cuda")`` copies and then synchronises the stream, so the host would wait for
    every kernel queued before it (a hidden synchronisation in a hot loop); a CPU tensor moved with
    ``non_blocking=True`` is the same copy, ordered on the stream, with no wait (safe from pageable memory:
    the values are staged before the call returns). On a CPU it is just the tensor."""
    t = torch.tensor(values, dtype=dtype)
    return t if t.device == torch.device(device) else t.to(device, non_blocking=True)
