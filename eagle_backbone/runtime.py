"""Process settings every stage shares: torch's thread count, and a clock that waits for the device.

Threads are set once per process from the config's ``threads`` (``None``: leave torch's default).
torch's default uses every core, which oversubscribes a shared machine and makes timings swing by
an order of magnitude; every script therefore calls :func:`set_threads` before any work.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

log = logging.getLogger(__name__)


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


# ---- the model dtype ---------------------------------------------------------------------------------------

DTYPES = ("auto", "bfloat16", "float16", "float32", "float64")
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # bfloat16 matmuls in hardware (AVX-512 BF16, AMX)


def cpu_flags() -> set[str] | None:
    """The first CPU's flags in /proc/cpuinfo (None where there is no /proc/cpuinfo)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


@functools.lru_cache(maxsize=None)
def packed_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU runs oneDNN's packed-weight matmul in ``dtype``: probed once per process by packing a
    tiny weight (oneDNN refuses bfloat16 without AVX-512 BW/VL/DQ or AVX-NE-CONVERT, and honours
    ``ONEDNN_MAX_CPU_ISA``, so the probe sees what oneDNN will actually run)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 16)
    except (RuntimeError, AttributeError):
        return False
    return True


def cpu_isa() -> str:
    """The vector ISA torch's CPU kernels run with here (``AVX512``, ``AVX2``, ``DEFAULT``...;
    ``ATEN_CPU_CAPABILITY`` lowers it)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except AttributeError:  # torch before 2.1
        return "unknown"


def bf16_matmuls(device: str = "cpu", flags: set[str] | None = None) -> bool:
    """Whether ``device`` runs bfloat16 matmuls in hardware: a CUDA GPU that supports bf16, or a CPU with
    AVX-512 BF16 or AMX. ``flags``: a CPU's flags to judge by; None: this machine's (/proc/cpuinfo), and then
    also whether this process's oneDNN runs bfloat16 (:func:`packed_matmul`; ``ONEDNN_MAX_CPU_ISA`` can turn it
    off). Elsewhere bf16 is emulated, several times slower than float32."""
    kind = torch.device(device).type
    if kind == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if kind == "cpu":
        if flags is not None:
            return bool(flags & BF16_CPU_FLAGS)
        flags = cpu_flags()
        return bool(flags and flags & BF16_CPU_FLAGS) and packed_matmul(torch.bfloat16)
    return False


def check_device(device, key: str = "model.device") -> None:
    """Refuse, in one line, a CUDA device on a torch build or machine without one (torch would fail later with an
    assertion traceback, after the models are read)."""
    try:
        kind = torch.device(str(device)).type
    except RuntimeError as e:
        raise ValueError(f"{key}={device}: not a device ({e}); use cpu or cuda") from None
    if kind == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(f"{key}={device}: {why} (torch.cuda.is_available() is False); use {key}=cpu")


def resolve_dtype(dtype: str | None, device: str = "cpu", flags: set[str] | None = None) -> str:
    """``model.dtype`` as the models are loaded: ``auto`` (or None) is bfloat16 where ``device`` has bf16 matmuls
    (:func:`bf16_matmuls`) and float32 otherwise; an explicit dtype is kept."""
    value = "auto" if dtype is None else str(dtype).replace("torch.", "")
    if value not in DTYPES:
        raise ValueError(f"model.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if value == "auto":
        return "bfloat16" if bf16_matmuls(device or "cpu", flags) else "float32"
    if value == "bfloat16" and torch.device(device or "cpu").type == "cpu" and not packed_matmul(torch.bfloat16):
        _say_once(f"model.dtype=bfloat16 on a CPU without bf16 matmuls in oneDNN (vector ISA {cpu_isa()}): it runs "
                  "on F.linear, emulated and several times slower than float32 (model.dtype=auto picks float32)")
    return value


@functools.lru_cache(maxsize=None)
def _say_once(message: str) -> None:
    log.warning(message)


def resolve_model_dtype(model_cfg) -> str | None:
    """Replace ``auto`` in a model config (DictConfig or dict, changed in place) by the dtype it resolves to, so
    that everything that records ``model.dtype`` (results, manifests, benchmarks) records the one used;
    returns it (None when the config has no dtype key)."""
    if model_cfg is None or not hasattr(model_cfg, "get") or "dtype" not in model_cfg:
        return None
    resolved = resolve_dtype(model_cfg.get("dtype"), str(model_cfg.get("device") or "cpu"))
    if model_cfg.get("dtype") != resolved:
        model_cfg["dtype"] = resolved
    return resolved


# ---- settings checked before anything loads ----------------------------------------------------------------


def int_setting(key: str, value, low: int, where: str = "") -> int:
    """``value`` of setting ``key`` as an integer >= ``low``, or a ValueError naming the key (and ``where``: the
    config file) in one line. The one check of integer settings that scripts and the main command share."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key} must be an integer >= {low}, got {value!r}" + (f" ({where})" if where else ""))
    return value


def int_list_setting(key: str, values, low: int, where: str = "", distinct: bool = False) -> list[int]:
    """A non-empty list of integers >= ``low`` (``distinct``: without repeats), or one line naming ``key``."""
    vals = [] if values is None else list(values)
    bad = not vals or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in vals)
    if bad or (distinct and len(set(vals)) < len(vals)):
        raise ValueError(f"{key} must be a non-empty list of {'distinct ' if distinct else ''}integers >= {low}, "
                         f"got {vals}" + (f" ({where})" if where else ""))
    return vals
