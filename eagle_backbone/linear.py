"""The engine's linear layers: one kernel per layer at every token count, so that a row's outputs are the same bits
whatever else shares the call (batch invariance by construction).

Greedy speculative decoding is lossless only if a token's logits are the same bits when the target verifies it
among γ + 1 tokens, in a tree, in a batch of 32 rows, or decodes it alone. CPU matmul kernels do not promise
that: each kernel has a few *small-M* code paths whose reduction order differs from its general one. Measured
on the embedded target's own activations, in both dtypes, with and without AVX-512 (docs/embedded.md, "Batch
invariance"; ``ldlp.bench.measurements.target.engine_batch_invariance`` checks the whole forward,
tests/test_embedded.py):

* oneDNN's matmul on a packed weight (``packed``): one row differs from the same row among 2 or more; from
  2 rows on every row has the same bits, float32 and bfloat16, AVX2 and AVX-512;
* ``F.linear`` in float32 or float64 (MKL): rows 1-3 differ; from 4 rows on the same;
* ``F.linear`` in bfloat16 or float16: the same bits at every row count.

:class:`Projection` therefore runs every call of a layer on **one** kernel (never one kernel for one token
and another for many, which gave different bits) and pads a call with fewer rows than that kernel's
:data:`INVARIANT_ROWS` with zero rows. A decoding step then costs a two-row packed matmul instead of a
one-row one: the same weight traffic, measured in docs/embedded.md's "Batch invariance" section.

The kernel is chosen by what the CPU supports (:func:`eagle_backbone.runtime.packed_matmul`, probed once per
dtype): oneDNN's packed matmul where it runs the dtype (float32 on every x86 CPU, bfloat16 where oneDNN has
AVX-512 or AVX-NE-CONVERT), faster than ``F.linear`` from 2 rows on (1.2-2.6× in float32, 1.4-1.8× in
bfloat16, the attention page's linear table); ``F.linear`` elsewhere (bfloat16 on an AVX2-only CPU: emulated,
several times slower than float32; ``eagle_backbone.runtime.resolve_dtype`` says so in one line).
``linear="plain"`` forces ``F.linear`` (still padded); a GPU always uses it, unpadded (batch invariance is not
constructed there).

On the packed route, projections that read the same input are fused into one matmul (a decoder layer's q/k/v,
and its gate/up): one call instead of three or two, with the same outputs bit for bit, since each output
column is the same dot product; q and k then turn by the rotary embedding in one pass over the fused output.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from eagle_backbone import runtime

LINEAR_MODES = ("auto", "plain")
# (kernel, dtype) -> the fewest rows from which each row's output has the same bits whatever rows share the
# call (module docstring); a call with fewer rows is padded to this many. Unlisted dtypes pad to 4 (MKL's)
INVARIANT_ROWS = {("packed", torch.float32): 2, ("packed", torch.bfloat16): 2,
                  ("plain", torch.float32): 4, ("plain", torch.float64): 4,
                  ("plain", torch.bfloat16): 1, ("plain", torch.float16): 1}
_PACKED: dict[tuple, tuple[tuple, torch.Tensor]] = {}  # weight ids -> (their versions when packed, the packed copy)


def check_linear(mode: str) -> str:
    if mode not in LINEAR_MODES:
        raise ValueError(f"linear must be one of {LINEAR_MODES}, got {mode!r}")
    return mode


def linear_route(weight: torch.Tensor, mode: str = "auto") -> str:
    """The kernel every call of this weight runs on: ``packed`` (oneDNN on a packed copy, where this CPU runs the
    weight's dtype so) or ``plain`` (``F.linear``)."""
    if check_linear(mode) == "plain" or weight.device.type != "cpu":
        return "plain"
    return "packed" if runtime.packed_matmul(weight.dtype) else "plain"


def invariant_rows(route: str, weight: torch.Tensor) -> int:
    """The rows a call of ``route`` is padded to (1, no padding, off a CPU)."""
    if weight.device.type != "cpu":
        return 1
    return INVARIANT_ROWS.get((route, weight.dtype), 4)


_PAD: dict[tuple, torch.Tensor] = {}  # (rows, width, dtype, device) -> a buffer short calls are copied into


def _pad_buffer(rows: int, x: torch.Tensor) -> torch.Tensor:
    """A (rows, width) buffer of zeros for calls like ``x`` (one per shape and dtype: the engine runs one call at a
    time), so that padding a short call is one copy, not a new tensor."""
    key = (rows, x.shape[-1], x.dtype, x.device)
    buf = _PAD.get(key)
    if buf is None:
        with torch.inference_mode(False):  # a plain tensor, written in and out of inference mode
            buf = _PAD[key] = torch.zeros(rows, x.shape[-1], dtype=x.dtype, device=x.device)
    return buf


class Projection:
    """One ``nn.Linear``, or several that read the same input fused into one (their weights stacked: the output
    is their outputs side by side, split with :attr:`sizes`), as the engine calls it: every call on one kernel
    (:attr:`route`: oneDNN's matmul on a packed copy, or ``F.linear``), padded to :attr:`min_rows` rows so that
    a row's bits do not depend on the call's other rows. The modules stay as they are (the reference decoding
    and training read them)."""

    def __init__(self, linears: nn.Linear | list[nn.Linear], mode: str = "auto"):
        linears = [linears] if isinstance(linears, nn.Module) else list(linears)
        self.parts = [(m.weight, m.bias) for m in linears]
        if len({b is None for _, b in self.parts}) > 1:
            raise ValueError("fused projections must all have a bias or all have none")
        self.sizes = [w.shape[0] for w, _ in self.parts]
        weight = self.parts[0][0]
        self.route = linear_route(weight, mode)
        self.min_rows = invariant_rows(self.route, weight)
        self._stacked: tuple | None = None
        self._key = tuple(id(w) for w, _ in self.parts)  # the packed copy's key (ids: a call pays no hashing)
        self._tensors = [w for w, _ in self.parts] + [b for _, b in self.parts if b is not None]

    def packs(self, x: torch.Tensor) -> bool:
        """Whether a call on ``x`` takes oneDNN's packed route (every call of a packed projection does)."""
        return self.route == "packed"

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether several linears run on ``x`` as one matmul: on the packed route (see :meth:`split`)."""
        return len(self.parts) > 1 and self.route == "packed"

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

    def _padded(self, fn, x: torch.Tensor) -> torch.Tensor:
        """``fn`` on ``x`` as rows (N, in): a call of fewer than :attr:`min_rows` rows runs with zero rows added,
        and only its own rows are returned."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        n = rows.shape[0]
        if n < self.min_rows:
            buf = _pad_buffer(self.min_rows, rows)
            buf[:n].copy_(rows)
            out = fn(buf)[:n]
            buf[:n].zero_()  # the next short call's padding rows are zeros again
        else:
            out = fn(rows)
        return out.view(*shape[:-1], out.shape[-1])

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.route == "packed":
            # the packed route needs the bias alone: no stacked weight is made for it (a Llama has no bias)
            bias = None if self.parts[0][1] is None else self.stacked()[1]
            return torch.ops.mkldnn._linear_pointwise(rows, self.packed(), bias, "none", [], "")
        return F.linear(rows, *self.stacked())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._padded(self._matmul, x)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The outputs of each linear: on the packed route one fused matmul split into views; otherwise one
        ``F.linear`` each (no stacked copy of the weights held: on a GPU a 7B target's q/k/v and gate/up are
        9 GB in bfloat16)."""
        if len(self.parts) == 1 or self.fuses(x):
            return self(x).split(self.sizes, -1)
        return tuple(self._padded(lambda rows, w=w, b=b: F.linear(rows, w, b), x) for w, b in self.parts)
