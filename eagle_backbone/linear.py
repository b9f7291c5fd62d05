"""The engine's linear layers on a CPU: oneDNN's packed-weight matmul where it is faster than ``F.linear``.

PyTorch's own freezing pass (``torch.jit.freeze`` / inductor's CPU path) runs a frozen ``nn.Linear`` as
``mkldnn._linear_pointwise`` on a weight reordered once into oneDNN's blocked layout. The engine does the same
by hand, because its shapes are ragged (a different token count every step) and a compiled graph would
recompile or pad: :class:`Projection` keeps the module's weight and a packed copy (one per weight per process),
and routes each call by its token count.

The route (``ROUTES``: the fewest tokens from which the packed matmul is used, per dtype) was chosen by
measurement on the embedded pair's shapes, one thread (``linear_kernels`` of ``python scripts/bench_attention.py``,
the attention page): in bfloat16 the packed matmul is faster at every token count (1.4-1.8×), in float32 from
3 tokens on (1.2-2.6×; at 1 token it is 0.5-0.75×, so a batch-1 decoding step keeps ``F.linear``). A fixed
table rather than a measurement at start-up, so the same command computes the same numbers twice.
``linear="plain"`` turns it off; a GPU never uses it.

On oneDNN's route, projections that read the same input are fused into one matmul (a decoder layer's q/k/v,
and its gate/up): one call instead of three or two, with the same outputs bit for bit, since each output
column is the same dot product. It saves little once the weights are packed (1.00-1.04× over the packed
matmuls one a projection: the attention page's linear table, which also checks the bits); q and k then turn
by the rotary embedding in one pass over the fused output.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

ROUTES = {torch.float32: 3, torch.bfloat16: 1}  # dtype -> the fewest tokens a call routes to oneDNN from
LINEAR_MODES = ("auto", "plain")
_PACKED: dict[tuple, tuple[tuple, torch.Tensor]] = {}  # weight ids -> (their versions when packed, the packed copy)


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
    """One ``nn.Linear``, or several that read the same input fused into one (their weights stacked: the output
    is their outputs side by side, split with :attr:`sizes`), as the engine calls it: ``F.linear``, or oneDNN's
    matmul on a packed copy for calls of at least ``min_tokens`` rows (:data:`ROUTES`). The modules stay as
    they are (the reference decoding and training read them)."""

    def __init__(self, linears: nn.Linear | list[nn.Linear], mode: str = "auto"):
        linears = [linears] if isinstance(linears, nn.Module) else list(linears)
        self.parts = [(m.weight, m.bias) for m in linears]
        if len({b is None for _, b in self.parts}) > 1:
            raise ValueError("fused projections must all have a bias or all have none")
        self.sizes = [w.shape[0] for w, _ in self.parts]
        self.min_tokens = onednn_from(self.parts[0][0], mode)
        self._stacked: tuple | None = None
        self._key = tuple(id(w) for w, _ in self.parts)  # the packed copy's key (ids: a call pays no hashing)
        self._tensors = [w for w, _ in self.parts] + [b for _, b in self.parts if b is not None]

    def packs(self, x: torch.Tensor) -> bool:
        """Whether a call on ``x`` takes oneDNN's packed route."""
        return self.min_tokens is not None and x.dim() == 2 and x.shape[0] >= self.min_tokens

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether several linears run on ``x`` as one matmul: on the packed route (see :meth:`split`)."""
        return len(self.parts) > 1 and self.packs(x)

    def _versions(self) -> tuple:
        return tuple([t._version for t in self._tensors])

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias): the module's own for one linear; for fused ones, their concatenation, made again
        after any of them changes in place."""
        if len(self.parts) == 1:
            return self.parts[0]
        versions = self._versions()
        if self._stacked is None or self._stacked[0] != versions:
            with torch.inference_mode(False):  # a plain tensor even when first made in the engine's inference mode
                w = torch.cat([w.detach() for w, _ in self.parts])
                b = None if self.parts[0][1] is None else torch.cat([b.detach() for _, b in self.parts])
            self._stacked = (versions, w, b)
        return self._stacked[1], self._stacked[2]

    def packed(self) -> torch.Tensor:
        """The packed copy, made once per weight (or fused group) per process and again after a weight changes
        in place (training between two engines)."""
        key, version = self._key, self._versions()
        got = _PACKED.get(key)
        if got is None or got[0] != version:
            if got is None:
                weakref.finalize(self.parts[0][0], _PACKED.pop, key, None)
            weights = [w.detach() for w, _ in self.parts]
            weight = torch.cat(weights) if len(weights) > 1 else weights[0]
            got = _PACKED[key] = (version, torch.ops.mkldnn._reorder_linear_weight(weight, 16))
        return got[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packs(x):
            # the packed route needs the bias alone: no stacked weight is made for it (a Llama has no bias)
            bias = None if self.parts[0][1] is None else self.stacked()[1]
            return torch.ops.mkldnn._linear_pointwise(x, self.packed(), bias, "none", [], "")
        return F.linear(x, *self.stacked())

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The outputs of each linear: on the packed route one fused matmul split into views; otherwise one
        ``F.linear`` each, as fast there (float32 at one or two tokens) and no stacked copy of the weights held
        (a GPU: a 7B target's q/k/v and gate/up are 9 GB in bfloat16)."""
        if len(self.parts) == 1 or self.fuses(x):
            return self(x).split(self.sizes, -1)
        return tuple(F.linear(x, w, b) for w, b in self.parts)
