"""The layout of a forward's tokens and the per-slot KV caches they are written to: a ragged batch
(:class:`RaggedBatch`, vLLM's layout: every row's new tokens flattened into one stream, row i bringing
``counts[i]`` tokens at positions ``starts[i]..`` of its cache slot), planned from host ints once per forward
(its dense blocks, :data:`DENSE_SLACK`), with the tokens' positions and slots on the device; and
:class:`SlotCache`, the preallocated keys and values of every slot. The forward that runs on them, and why
it takes this layout, is :mod:`eagle_backbone.llama`.

**Draft trees** (EAGLE-2 style verification): a row may bring a tree instead of a chain, ``parents[j]`` the
row index of token j's parent or -1 for the slot's cached prefix (token 0, the last accepted token, is -1;
a chain is ``[-1, 0, 1, ...]``). Token j is still *written* at position ``start + j`` (so a row stays one
contiguous span of its slot), but it is *rotated* as if it sat at ``start + depth(j)``, its place on its own
path, and it sees the prefix, its ancestors in the row and itself: each node's output is what the model
gives on ``prefix + path-to-node`` alone. Batches without trees (``parents=None``, or rows that are chains)
run exactly the chain code. After verification :meth:`SlotCache.move` copies the accepted path's keys and
values from their scattered positions to ``start, start + 1, ...``, where a chain would have written them.

**Spans** (:class:`Span`): where the visibility of a row's tokens is data (a draft tree grown on the device),
a batch takes it as a device mask instead of host parents. Row i's tokens see every key before ``bases[i]``
and, of the keys from ``bases[i]`` on, those the mask marks; each token is rotated at the position given.
The drafter grows a tree this way, each depth's frontier seeing its ancestors fed at earlier depths, and the
target verifies a tree selected on the device without reading its shape.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from eagle_backbone.runtime import to_device
from eagle_backbone.tree import ancestor_matrix

# padded keys a row may read in a dense block: about the per-row route's fixed cost, in keys, on a CPU. That
# cost is larger in bfloat16 (each per-row call's scores and softmax pay oneDNN's bf16 setup), so a dense block
# pays over longer padding there (the attention page of scripts/bench_attention.py measures both routes)
DENSE_SLACK = {torch.float32: 64, torch.bfloat16: 256}


def dense_slack(dtype: torch.dtype) -> int:
    """The padding rule's keys a row for activations in ``dtype`` (float32's for a dtype not measured)."""
    return DENSE_SLACK.get(dtype, DENSE_SLACK[torch.float32])


class SlotCache:
    """Preallocated keys and values for ``slots`` sequences of up to ``capacity`` positions each."""

    def __init__(self, layers: int, slots: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        if slots < 1:
            raise ValueError(f"a cache needs at least one slot, got {slots}")
        shape = (layers, slots, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # no lengths here: the engine keeps each slot's length on the host (one int a slot) and rolls back
        # by overwriting positions, so the cache itself holds no state to reset
        self.capacity = capacity

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    def move(self, slots, src, dst) -> None:
        """For every p, copy slot ``slots[p]``'s keys and values at position ``src[p]`` to position ``dst[p]``,
        in every layer (device index tensors or host lists, all of one length; ``dst`` distinct within a slot).

        After a tree verification the accepted path sits at scattered positions ``start + node``; moving it
        to ``start, start + 1, ...`` leaves the slot as if the path had been run as a chain. All positions
        are read before any is written, so a source that is also a destination (a path moved left onto
        itself) is copied from its old contents."""
        slots, src, dst = (x if torch.is_tensor(x) else to_device(list(x), self.k.device) for x in (slots, src, dst))
        for buf in (self.k, self.v):
            # advanced indices on dims 1 and 3 (a slice between them): the gathered shape is (P, layers, H, D)
            # and the same indices scatter it back; the gather is a copy, which is what makes overlaps safe
            buf[:, slots, :, dst] = buf[:, slots, :, src]


class Span(NamedTuple):
    """The visibility of a batch's rows as device data (every row of the batch is a span row).

    Row i's token t sees the keys before ``bases[i]`` (the slot's prefix) and key ``bases[i] + s`` where
    ``mask[i, t, s]``; the keys of the row's own tokens (``starts[i] ..``) count from ``bases[i]`` too, so
    ``starts[i] + counts[i] - bases[i] <= S``. ``rope``: each token's rotary position: flat (a host list or a
    device (N,)) or padded rows (device (R, n))."""

    bases: list[int]
    mask: torch.Tensor  # (R, n, S) bool, n >= every row's count
    rope: torch.Tensor | list[int]


SPAN = "span"  # a span row's entry in RaggedBatch.parents


class RaggedBatch:
    """Where a forward's N flat tokens go: row i has ``counts[i]`` new tokens at positions
    ``starts[i] .. starts[i] + counts[i] - 1`` of cache slot ``slots[i]``, and attends over that slot's
    positions ``0 .. starts[i] + counts[i] - 1``. Host lists, plus the tokens' positions and slots on the
    device (one host-to-device copy).

    ``parents`` (optional, one entry a row): ``None`` for a chain row, or a host list of ``counts[i]`` ints,
    token j's parent in the row (``< j``) or -1 for the cached prefix. Tree rows rotate token j at
    ``starts[i] + depth(j)`` (``rope_pos``; ``pos`` stays where it is written) and mask it to the prefix,
    its ancestors and itself. Rows given as chains are stored as ``None``; a batch with no tree row keeps
    ``parents = None`` and ``rope_pos is pos``.

    ``span`` (a :class:`Span`, instead of ``parents``): every row's visibility and rotary positions given as
    device data; ``parents`` is then :data:`SPAN` for every row."""

    def __init__(self, slots, starts, counts, device, dense_slack: int | None = None, parents=None,
                 span: Span | None = None):
        self.slots, self.starts, self.counts = list(slots), list(starts), list(counts)
        if any(n < 1 for n in self.counts):
            raise ValueError(f"every row of a ragged batch brings at least one token, got counts {self.counts}")
        if span is not None and parents is not None:
            raise ValueError("a ragged batch takes parents or a span, not both")
        self.span = _check_span(span, self.starts, self.counts)
        self.parents = [SPAN] * len(self.counts) if span is not None else _tree_rows(parents, self.counts)
        self.n = sum(self.counts)
        self.ends = list(_cumsum(self.counts))  # row i's tokens are flat [ends[i] - counts[i], ends[i])
        pos = [s + j for s, c in zip(self.starts, self.counts) for j in range(c)]
        slot_of = [b for b, c in zip(self.slots, self.counts) for _ in range(c)]
        if self.parents is None:
            both = to_device(pos + slot_of, device)
            self.pos, self.slot_of = both[: self.n], both[self.n:]
            self.rope_pos = self.pos  # a chain is rotated where it is written
        elif span is not None:
            rope = span.rope if torch.is_tensor(span.rope) else None
            every = to_device(pos + slot_of + ([] if rope is not None else list(span.rope)), device)
            self.pos, self.slot_of = every[: self.n], every[self.n: 2 * self.n]
            self.rope_pos = rope if rope is not None else every[2 * self.n:]
        else:
            rope = [s + d for s, c, p in zip(self.starts, self.counts, self.parents)
                    for d in (range(c) if p is None else _depths(p))]
            every = to_device(pos + slot_of + rope, device)
            self.pos, self.slot_of, self.rope_pos = every[: self.n], every[self.n: 2 * self.n], every[2 * self.n:]
        self.device = torch.device(device)
        self._slack = dense_slack  # None: the rule of the forward's dtype (:func:`dense_slack`)
        self._plans: dict[int, list[tuple[int, int]]] = {}  # slack -> row ranges
        self._pidx: dict[int, torch.Tensor] = {}
        if span is not None and torch.is_tensor(span.rope) and span.rope.dim() == 2:
            self.rope_pos = self.flat(span.rope)  # (R, n) padded rows
        self._anc: torch.Tensor | None = None  # tree rows' ancestor matrices, built on first use
        self._bases: torch.Tensor | None = None  # rows' bases on the device, built on first use
        self._masks: dict = {}  # (i, j, impl, dtype) -> a tree block's mask, shared by every layer

    def __len__(self) -> int:
        return len(self.slots)

    def last(self) -> torch.Tensor:
        """Flat index of each row's last token (device)."""
        return to_device([e - 1 for e in self.ends], self.device)

    def join(self, other: RaggedBatch) -> RaggedBatch:
        """This batch's rows, then ``other``'s (their flat tokens concatenated in that order)."""
        if other.span is not None or (self.span is not None and other.parents is not None):
            raise ValueError("join: a span batch joins only chain rows after it")
        out = copy.copy(self)
        out.slots, out.starts, out.counts = self.slots + other.slots, self.starts + other.starts, self.counts + other.counts
        out.n = self.n + other.n
        out.ends = self.ends + [self.n + e for e in other.ends]
        out.pos, out.slot_of = torch.cat([self.pos, other.pos]), torch.cat([self.slot_of, other.slot_of])
        if self.parents is None and other.parents is None:
            out.rope_pos = out.pos
        else:
            out.parents = (self.parents or [None] * len(self)) + (other.parents or [None] * len(other))
            out.rope_pos = torch.cat([self.rope_pos, other.rope_pos])
        out._plans, out._pidx, out._anc, out._bases, out._masks = {}, {}, None, None, {}
        return out

    @property
    def blocks(self) -> list[tuple[int, int]]:
        """Row ranges [i, j) at the batch's own slack (float32's rule if it was given none)."""
        return self.blocks_for(torch.float32)

    def blocks_for(self, dtype: torch.dtype) -> list[tuple[int, int]]:
        """Row ranges [i, j) for a forward in ``dtype``: a range of length > 1 runs as one dense block, a range
        of one row on its own (planned once per slack from host ints)."""
        slack = self._slack if self._slack is not None else dense_slack(dtype)
        if slack not in self._plans:
            self._plans[slack] = self._plan(slack)
        return self._plans[slack]

    def is_tree(self, i: int) -> bool:
        return self.parents is not None and self.parents[i] is not None

    def base(self, i: int) -> int:
        """The first key of row i that its mask decides (earlier keys: the prefix every token sees)."""
        return self.span.bases[i] if self.span is not None and i < len(self.span.bases) else self.starts[i]

    def tree_mask(self, i: int, j: int, impl: str, dtype: torch.dtype) -> torch.Tensor:
        """The mask of tree rows i..j-1 (consecutive slots, n tokens each) over keys ``0 .. L-1``, L their
        longest context: (m, 1, n, L), bool visibility for sdpa, an additive bias in ``dtype`` for eager.
        Token t of row r sees the keys before its base (:meth:`base`; a parents row's start) and, from the
        base on, its ancestors and itself (a span row: what its mask marks). Built on the device once per
        batch (every layer reads the same one)."""
        key = (i, j, impl, dtype)
        if key not in self._masks:
            m, n = j - i, self.counts[i]
            L = max(s + n for s in self.starts[i:j])
            t = sum(p is not None for p in self.parents[:i])  # row i's index among the tree rows
            anc = self._ancestors()[t: t + m, :n]  # (m, n, S); rows i..j-1 are all tree rows
            S = anc.shape[2]
            if self._bases is None:  # every row's base on the device, once per batch
                self._bases = to_device([self.base(r) for r in range(len(self))], self.device)
            base = self._bases[i:j]
            rel = torch.arange(L, device=self.device) - base[:, None]  # key position from the row's base
            own = anc.gather(2, rel.clamp(0, S - 1)[:, None, :].expand(m, n, L)) & ((rel >= 0) & (rel < S))[:, None]
            visible = ((rel < 0)[:, None] | own)[:, None]  # (m, 1, n, L)
            if impl != "sdpa":
                visible = torch.zeros(visible.shape, dtype=dtype, device=self.device).masked_fill_(
                    ~visible, torch.finfo(dtype).min)
            self._masks[key] = visible
        return self._masks[key]

    def _ancestors(self) -> torch.Tensor:
        """(tree rows, T, S) bool: a span's mask, or for parents rows (T = S their largest count)
        ``A[t, a, b]``: token b is token a or one of its ancestors (tree.ancestor_matrix's pointer jumping on
        the device; padding hangs off the prefix)."""
        if self.span is not None:
            return self.span.mask
        if self._anc is None:
            rows = [p for p in self.parents if p is not None]
            T = max(len(p) for p in rows)
            flat = to_device([x for p in rows for x in p + [-1] * (T - len(p))], self.device)
            self._anc = ancestor_matrix(flat.view(len(rows), T))
        return self._anc

    def _padded_index(self, T: int) -> torch.Tensor:
        """Flat index of each real token in the padded (R, T) layout (device; built once per T)."""
        if T not in self._pidx:
            self._pidx[T] = to_device([i * T + j for i, c in enumerate(self.counts) for j in range(c)], self.device)
        return self._pidx[T]

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """(R, T, ...) padded rows -> (N, ...) real tokens."""
        R, T = x.shape[:2]
        x = x.reshape(R * T, *x.shape[2:])
        return x if self.n == R * T else x.index_select(0, self._padded_index(T))

    def padded(self, x: torch.Tensor, T: int) -> torch.Tensor:
        """(N, ...) real tokens -> (R, T, ...), zeros past each row's count."""
        R = len(self)
        if self.n == R * T:
            return x.view(R, T, *x.shape[1:])
        out = x.new_zeros(R * T, *x.shape[1:]).index_copy_(0, self._padded_index(T), x)
        return out.view(R, T, *x.shape[1:])

    def _plan(self, slack: int) -> list[tuple[int, int]]:
        """Row ranges [i, j): a range of length > 1 runs as one dense block, a range of one row on its own.
        A block holds only chain rows or only tree rows (one mask rule per block)."""
        out, i, R = [], 0, len(self.slots)
        gpu = self.device.type == "cuda"
        tree = self.parents
        while i < R:
            j = i + 1
            while (j < R and self.slots[j] == self.slots[j - 1] + 1 and self.counts[j] == self.counts[i]
                   and (tree is None or (tree[j] is None) == (tree[i] is None))):
                j += 1
            if j - i > 1 and not gpu:
                lens = [s + c for s, c in zip(self.starts[i:j], self.counts[i:j])]
                if (j - i) * max(lens) - sum(lens) > slack * (j - i):
                    j = i + 1  # too ragged: per row
            out.append((i, j))
            i = j
        return out


def _tree_rows(parents, counts) -> list | None:
    """Check a batch's ``parents`` against its counts; chains become None, and no tree at all is None."""
    if parents is None:
        return None
    parents = list(parents)
    if len(parents) != len(counts):
        raise ValueError(f"parents has {len(parents)} rows, the batch {len(counts)}")
    out = []
    for i, (p, c) in enumerate(zip(parents, counts)):
        if p is not None:
            p = [int(x) for x in p]
            if len(p) != c:
                raise ValueError(f"row {i}: {len(p)} parents for {c} tokens")
            if any(not -1 <= x < j for j, x in enumerate(p)):
                raise ValueError(f"row {i}: a token's parent must be -1 or an earlier token of the row, got {p}")
            if all(x == j - 1 for j, x in enumerate(p)):
                p = None  # a chain: the chain code is the same math, with less work
        out.append(p)
    return None if all(p is None for p in out) else out


def _check_span(span: Span | None, starts, counts) -> Span | None:
    if span is None:
        return None
    R = len(counts)
    if len(span.bases) != R or span.mask.dim() != 3 or span.mask.shape[0] != R:
        raise ValueError(f"span: {len(span.bases)} bases and a mask of shape {tuple(span.mask.shape)} for {R} rows")
    n, S = span.mask.shape[1:]
    bad = [i for i in range(R) if counts[i] > n or not 0 <= span.bases[i] <= starts[i]
           or starts[i] + counts[i] - span.bases[i] > S]
    if bad:
        raise ValueError(f"span: row {bad[0]} (start {starts[bad[0]]}, {counts[bad[0]]} tokens, base "
                         f"{span.bases[bad[0]]}) does not fit a mask of {n} tokens over {S} keys")
    return span


def _depths(parents: list[int]) -> list[int]:
    """Each token's number of ancestors in its row (parents come first, so one pass)."""
    d = []
    for x in parents:
        d.append(0 if x < 0 else d[x] + 1)
    return d


def _cumsum(xs):
    t = 0
    for x in xs:
        t += x
        yield t
