"""The engine's linear layers on a CPU: oneDNN's packed-weight matmul where it is faster than ``F.linear``.

PyTorch's own freezing pass (``torch.jit.freeze`` / inductor's CPU path) runs a frozen ``nn.Linear`` as
``mkldnn._linear_pointwise`` on a weight reordered once into oneDNN's blocked layout. The engine does the same
by hand, because its shapes are ragged (a different token count every step) and a compiled graph would
recompile or pad: :class:`Projection` keeps the module's weight and a packed copy (one per weight per process),
and routes each call by its token count.

The route (``ROUTES``: the fewest tokens from which the packed matmul is used, per dtype) was chosen by
measurement on the embedded pair's shapes, one thread (``linear_kernels`` of ``python scripts/bench_attention.py``,
the attention page): in bfloat16 the packed matmul is faster at every token count (1.4-1.8×), in float32 from
3 tokens on (1.2-2.6×; at 1 token it is 0.5-0.75×, so a batch-1 decoding step keeps ``F.linear``). A fixed table rather than a measurement at start-up, so the
same command computes the same numbers twice. ``linear="plain"`` turns it off; a GPU never uses it.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

ROUTES = {torch.float32: 3, torch.bfloat16: 1}  # dtype -> the fewest tokens a call routes to oneDNN from
LINEAR_MODES = ("auto", "plain")
_PACKED: dict[int, tuple[int, torch.Tensor]] = {}  # id(weight) -> (its version when packed, the packed copy)


def check_linear(mode: str) -> str:
    if mode not in LINEAR_MODES:
        raise ValueError(f"linear must be one of {LINEAR_MODES}, got {mode!r}")
    return mode


def onednn_from(weight: torch.Tensor, mode: str) -> int | None:
    """The fewest tokens a call of this weight routes to oneDNN from, or None (always ``F.linear``)."""
    if check_linear(mode) == "plain" or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    return ROUTES.get(weight.dtype)


class Projection:
    """An ``nn.Linear`` as the engine calls it: ``F.linear`` on its weight, or oneDNN's matmul on a packed copy
    for calls of at least ``min_tokens`` rows (:data:`ROUTES`). The module stays as it is (the reference
    decoding and training read it)."""

    def __init__(self, linear: nn.Linear, mode: str = "auto"):
        self.weight, self.bias = linear.weight, linear.bias
        self.min_tokens = onednn_from(self.weight, mode)

    def packed(self) -> torch.Tensor:
        """The packed copy, made once per weight per process and again after the weight changes in place
        (training between two engines)."""
        key, version = id(self.weight), self.weight._version
        got = _PACKED.get(key)
        if got is None or got[0] != version:
            if got is None:
                weakref.finalize(self.weight, _PACKED.pop, key, None)
            got = _PACKED[key] = (version, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 16))
        return got[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.min_tokens is not None and x.dim() == 2 and x.shape[0] >= self.min_tokens:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed(), self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
