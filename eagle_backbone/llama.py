"""Per-slot KV caches and a compact Llama forward over a Hugging Face model's own modules.

The forward takes a *ragged batch* (vLLM's layout): the new tokens of every row flattened into one stream,
row i bringing ``counts[i]`` tokens at positions ``starts[i]..`` of its cache slot. Projections, rotary and
MLPs run once over the N real tokens; nothing is padded to the longest row, so a joined prefill of a
400-token prompt costs its own tokens, and a γ = 0 slot costs one token next to a γ = 8 slot.

Attention reads the cache **in place**: each row attends over its own slot's keys ``0 .. start + count - 1``
as views of the preallocated buffers, so no forward copies or gathers a live K/V prefix and no slot pays
for the longest slot's context. Two ways to run it, chosen per forward from host ints:

* **per row** (the general case): one attention call per row on its slot's views. Its cost is the row's own
  keys plus a fixed Python/kernel overhead per row and layer.
* **dense block**: rows that sit in consecutive slots with the same token count run as one batched call on
  a view ``k[a : a + m, :, :L]`` with a mask (L the block's longest context). Chosen when the padding it
  reads, ``m·L − Σ lengths``, is under ``dense_slack`` keys a row (short, similar contexts, where the
  per-row overhead would dominate; a rule per dtype, :data:`DENSE_SLACK`), and always on a GPU (one kernel
  instead of one a row; a varlen kernel is the next step there).

Why a forward of our own and not transformers' ``LlamaModel.forward`` with a custom cache: that forward
pays a fixed Python overhead per call (output capturing, kwargs checks, mask preparation) on top of the same
matrix products, and it cannot take a ragged batch. The compact forward calls the checkpoint's own
submodules (RMSNorm, q/k/v/o projections, MLP, rotary inverse frequencies): no weight is copied or re-laid
out, any Llama-family checkpoint (Vicuna-7B included) loads unchanged through ``AutoModelForCausalLM``, and
the per-token math is transformers' (tests/test_batched.py checks the logits). Attention is transformers'
eager math (scores in the model dtype, float32 softmax) by default; ``attn="sdpa"`` uses torch's fused
kernel with the same visibility.

Rolling a slot back is setting its length: a query at position p only reads keys at positions <= p, and
every such key was written by this or an earlier accepted forward.

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
import functools
from typing import NamedTuple

import torch
from torch import nn

from transformers.models.llama.modeling_llama import LlamaRMSNorm as _LLAMA_RMS_NORM

from eagle_backbone.linear import Projection
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


@functools.lru_cache(maxsize=64)
def _causal_bias(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(n, n): 0 on and below the diagonal, the dtype's minimum above (a block of n new tokens)."""
    upper = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(n, n, dtype=dtype, device=device).masked_fill_(upper, torch.finfo(dtype).min)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Llama's rotate-half form); cos and sin broadcast against x."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for a Llama RMSNorm in fewer kernels: torch's fused ``rms_norm`` in float32, then the
    weight, in the module's order of casts, so the bits are the module's (tests/test_linear.py); any other
    norm module is called as it is."""
    if type(norm) is not _LLAMA_RMS_NORM:
        return norm(x)
    return norm.weight * nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


SCORES_KQ_ROWS = 32  # bfloat16 scores run as k @ qᵀ up to this many query rows (a head group's tokens)
# float32 (and float64) attention on a CPU runs on MKL's matmul, whose one- to three-row paths sum in another
# order than its general one, and whose sum over the keys changes order with their count: its products then pad
# the query rows to INVARIANT_ROWS (and the keys of a score to INVARIANT_KEYS) and run probs @ v over fixed
# chunks of KEY_CHUNK keys at absolute positions, added in order, so that a query's output has the same bits whatever other queries or masked keys share the
# call (a token verified among γ + 1, in a tree or a dense block, or decoded alone; eagle_backbone/linear.py).
# bfloat16 and float16 products have the same bits at every shape (measured; tests/test_batched.py)
INVARIANT_ROWS = 4
INVARIANT_KEYS = 16  # and scores against fewer than 12 keys differ from the same keys among more
KEY_CHUNK = 128  # MKL sums up to 192 keys in order here (tests/test_batched.py checks it on every CPU)


def _invariant_products(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., m, K) with zero rows added to :data:`INVARIANT_ROWS` where its products must be
    batch-invariant (:func:`_invariant_products`) and it has fewer; otherwise ``x`` itself."""
    m = x.shape[-2]
    if m >= INVARIANT_ROWS or not _invariant_products(x):
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-2], INVARIANT_ROWS - m, x.shape[-1])], -2)


def _matmul_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with ``a``'s rows padded (:func:`_pad_rows`), then only ``a``'s own rows."""
    m = a.shape[-2]
    out = torch.matmul(_pad_rows(a), b)
    return out if out.shape[-2] == m else out[..., :m, :]


def _weighted_values(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """probs (..., m, L) @ v (..., L, D). Where products must be batch-invariant: the rows padded
    (:func:`_pad_rows`) and the keys taken in chunks of :data:`KEY_CHUNK` at absolute positions, their products
    added in order. Within a chunk MKL sums the keys in order, so a masked key (probability exactly 0), a
    key past a query's own, or a shorter last chunk adds nothing to a query's sum."""
    L = probs.shape[-1]
    if not _invariant_products(probs) or (L <= KEY_CHUNK and probs.shape[-2] >= INVARIANT_ROWS):
        return torch.matmul(probs, v)
    m = probs.shape[-2]
    probs, out = _pad_rows(probs), None
    for c in range(0, L, KEY_CHUNK):
        part = torch.matmul(probs[..., c: c + KEY_CHUNK], v[..., c: c + KEY_CHUNK, :])
        out = part if out is None else out.add_(part)
    return out if out.shape[-2] == m else out[..., :m, :]


def _scores(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """q (..., m, D) against keys k (..., L, D), a view of the cache: (..., m, L), times ``scaling``.

    In bfloat16 the product runs as k @ qᵀ, transposed back: on a CPU, oneDNN reads the transposed view of the
    cache that q @ kᵀ needs slowly, while k as stored is a plain row-major operand; a decoding step's per-row
    attention is 1.3-1.6× faster so (the attention page's ``per_row_qkT`` column against ``per_row``). With
    many query rows (a prefill) the copy back to (m, L) costs more than the slow read: q @ kᵀ from
    ``SCORES_KQ_ROWS`` rows on. The bits are the same (tests/test_batched.py). In float32 on a CPU the query
    rows are padded (:data:`INVARIANT_ROWS`)."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[-2] <= SCORES_KQ_ROWS:
        return (torch.matmul(k, q.transpose(-1, -2)) * scaling).transpose(-1, -2).contiguous()
    if _invariant_products(q):
        L = k.shape[-2]
        if L < INVARIANT_KEYS:  # MKL's few-column paths: zero keys added, their scores dropped
            k = torch.cat([k, k.new_zeros(*k.shape[:-2], INVARIANT_KEYS - L, k.shape[-1])], -2)
        out = _matmul_rows(q, k.transpose(-1, -2)) * scaling
        return out if out.shape[-1] == L else out[..., :L].contiguous()
    return torch.matmul(q, k.transpose(-1, -2)) * scaling


# a softmax over fewer keys than one or two vector widths sums them in another order than over more: float32
# rows shorter than this get masked keys added (tests/test_batched.py)
SOFTMAX_KEYS = 32
SOFTMAX_ROWS = 32  # query rows a half-precision softmax runs at a time (its float32 rows then stay in cache)


def _probs(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Attention probabilities as transformers' eager math computes them: softmax over the last dim in float32,
    cast to ``dtype``. A half-precision prefill's scores (rows × keys) run ``SOFTMAX_ROWS`` rows at a time
    into the output: the whole float32 intermediate of a long prompt would leave the cache, and the row-wise
    softmax then costs several times as much (docs/batched.md). Each row is the same computation either way,
    so the bits are the same (tests/test_batched.py)."""
    rows, L = scores.shape[-2:]
    if L < SOFTMAX_KEYS and _invariant_products(scores):  # masked keys added, their (zero) probabilities dropped
        wide = torch.cat([scores, scores.new_full((*scores.shape[:-1], SOFTMAX_KEYS - L), torch.finfo(scores.dtype).min)], -1)
        return torch.softmax(wide, dim=-1, dtype=torch.float32)[..., :L].to(dtype)
    if scores.dtype == torch.float32 or rows <= SOFTMAX_ROWS or scores.device.type != "cpu":
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    out = torch.empty(scores.shape, dtype=dtype, device=scores.device)
    for i in range(0, rows, SOFTMAX_ROWS):
        out[..., i: i + SOFTMAX_ROWS, :] = torch.softmax(scores[..., i: i + SOFTMAX_ROWS, :], dim=-1,
                                                         dtype=torch.float32)
    return out


def _attend_row(q, k, v, start: int, scaling: float, impl: str, tree=None, base: int | None = None) -> torch.Tensor:
    """q (n, Hq, D) at positions start..start+n-1; k/v (Hkv, start+n, D), views of one slot -> (n, Hq*D).

    ``tree``: a tree row's mask from :meth:`RaggedBatch.tree_mask` ((1, 1, n, start+n)), which masks nothing
    before ``base`` (default ``start``); None: causal."""
    n, Hq, D = q.shape
    Hkv, L = k.shape[0], k.shape[1]
    qh = q.transpose(0, 1)  # (Hq, n, D)
    if impl == "sdpa":
        mask = None
        if tree is not None:
            mask = tree[0, 0]
        elif n > 1:
            mask = torch.arange(L, device=q.device) <= start + torch.arange(n, device=q.device)[:, None]
        out = nn.functional.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scaling,
                                                         enable_gqa=Hq != Hkv)
    else:
        # transformers' eager math; GQA by grouping the query heads instead of copying keys
        rep = Hq // Hkv
        # padded once for both products where they must be batch-invariant (a padded row's output is dropped)
        scores = _scores(_pad_rows(qh.reshape(Hkv, rep * n, D)), k, scaling)
        own = scores[:, : rep * n].view(Hkv, rep, n, L)
        # every earlier key is visible to all of the new block (its bias there is 0): add only over the block
        if tree is not None:
            b = start if base is None else base
            own[..., b:] += tree[0, 0, :, b:]
        elif n > 1:  # a chain's block is causal
            own[..., start:] += _causal_bias(n, scores.dtype, scores.device)
        probs = _probs(scores, q.dtype)
        out = _weighted_values(probs, v)[:, : rep * n].reshape(Hq, n, D)
    return out.transpose(0, 1).reshape(n, Hq * D)


def _attend_block(q, kc, vc, batch: RaggedBatch, i: int, j: int, scaling: float, impl: str) -> torch.Tensor:
    """Rows i..j-1 (consecutive slots, n tokens each) as one call on a view of their slots (padded to the
    block's longest context with a mask) -> (m·n, Hq*D). A block of tree rows takes the batch's cached
    tree mask; a chain block's mask is built here."""
    m, n = j - i, batch.counts[i]
    a = batch.slots[i]
    L = max(s + n for s in batch.starts[i:j])
    lo, hi = batch.ends[i] - n, batch.ends[j - 1]
    qb = q[lo:hi].view(m, n, q.shape[1], q.shape[2]).transpose(1, 2)  # (m, Hq, n, D)
    if batch.is_tree(i):
        mask = batch.tree_mask(i, j, impl, q.dtype)  # (m, 1, n, L): bool for sdpa, additive for eager
    else:
        pos = batch.pos[lo:hi].view(m, n)
        mask = (torch.arange(L, device=q.device) <= pos[:, :, None])[:, None]  # (m, 1, n, L)
        if impl != "sdpa":
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, torch.finfo(q.dtype).min)
    k, v = kc[a: a + m, :, :L], vc[a: a + m, :, :L]
    R, Hq, T, D = qb.shape
    Hkv = k.shape[1]
    if impl == "sdpa":
        out = nn.functional.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scaling,
                                                         enable_gqa=Hq != Hkv)
    else:
        rep = Hq // Hkv
        scores = _scores(qb.reshape(R, Hkv, rep * T, D), k, scaling).view(R, Hkv, rep, T, L)
        probs = _probs(scores + mask[:, :, None], q.dtype)
        out = _weighted_values(probs.view(R, Hkv, rep * T, L), v).reshape(R, Hq, T, D)
    return out.transpose(1, 2).reshape(R * T, Hq * D)


def attend(cache: SlotCache, layer: int, q, k, v, batch: RaggedBatch, scaling: float, impl: str) -> torch.Tensor:
    """Store the flat tokens' keys/values (N, Hkv, D) at their slots' positions, then attend each row over
    its own slot, in place: q (N, Hq, D) -> (N, Hq*D)."""
    kc, vc = cache.k[layer], cache.v[layer]
    kc[batch.slot_of, :, batch.pos] = k  # advanced indices on dims 0 and 2: the indexed shape is (N, H, D)
    vc[batch.slot_of, :, batch.pos] = v
    outs = []
    for i, j in batch.blocks_for(q.dtype):
        if j - i > 1:
            outs.append(_attend_block(q, kc, vc, batch, i, j, scaling, impl))
        else:
            b, s, n = batch.slots[i], batch.starts[i], batch.counts[i]
            lo = batch.ends[i] - n
            tree = batch.tree_mask(i, j, impl, q.dtype) if batch.is_tree(i) else None
            outs.append(_attend_row(q[lo: lo + n], kc[b, :, : s + n], vc[b, :, : s + n], s, scaling, impl, tree,
                                    batch.base(i)))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class DecoderLayer:
    """A transformers LlamaDecoderLayer as the engine runs it: its norms and activation, and its projections
    as :class:`~eagle_backbone.linear.Projection` (oneDNN's packed matmul on a CPU where it is faster;
    ``linear="plain"``: ``F.linear``), q/k/v fused into one matmul and gate/up into another. The module itself
    is left as it is."""

    def __init__(self, layer: nn.Module, linear: str = "auto"):
        attn, mlp = layer.self_attn, layer.mlp
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = Projection([attn.q_proj, attn.k_proj, attn.v_proj], linear)
        self.o = Projection(attn.o_proj, linear)
        self.gate_up = Projection([mlp.gate_proj, mlp.up_proj], linear)
        self.down = Projection(mlp.down_proj, linear)
        self.act = mlp.act_fn

    def attention_inputs(self, h: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k turned by the rotary embedding, and v, of the flat tokens h (N, ·): (N, heads, head_dim)
        each. On oneDNN's route q, k and v are one fused matmul's output, and q and k turn in one pass."""
        N, hd = h.shape[0], self.head_dim
        if not self.qkv.fuses(h):
            q, k, v = (t.view(N, -1, hd) for t in self.qkv.split(h))
            return rotate(q, cos, sin), rotate(k, cos, sin), v
        out = self.qkv(h)
        nq, nk, _ = self.qkv.sizes
        q, k = rotate(out[:, : nq + nk].view(N, -1, hd), cos, sin).split([nq // hd, nk // hd], 1)
        return q, k, out[:, nq + nk:].view(N, -1, hd)

    def __call__(self, x: torch.Tensor, cos, sin, cache: SlotCache, li: int, batch: RaggedBatch,
                 impl: str) -> torch.Tensor:
        """The layer on the flat tokens (N, d), with our cache."""
        N = x.shape[0]
        q, k, v = self.attention_inputs(rms_norm(self.input_layernorm, x), cos, sin)
        return self.mlp(x + self.o(attend(cache, li, q, k, v, batch, self.scaling, impl).reshape(N, -1)))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP block with its residual: x + down(act(gate(h)) · up(h)), h the post-attention norm of x."""
        h = rms_norm(self.post_attention_layernorm, x)
        gate, up = self.gate_up.split(h)
        return x + self.down(self.act(gate) * up)


class RotaryTable:
    """cos/sin for positions 0..n-1 from a transformers rotary module (its inv_freq and scaling: any rope type)."""

    def __init__(self, rotary: nn.Module, n: int, dtype: torch.dtype, device):
        dummy = torch.zeros(1, dtype=dtype, device=device)
        cos, sin = rotary(dummy, position_ids=torch.arange(n, device=device)[None])
        self.cos, self.sin = cos[0], sin[0]  # (n, D), already in the model dtype as transformers casts them

    def __call__(self, positions):
        return self.cos[positions][:, None], self.sin[positions][:, None]  # (N, 1, D): broadcast over heads


def _check_attn(attn: str):
    if attn not in ("eager", "sdpa"):
        raise ValueError(f"attn must be 'eager' or 'sdpa', got {attn!r}")


class BatchedLlama:
    """A Hugging Face Llama-family causal LM run on a :class:`SlotCache` (target or standalone draft LM).

    ``forward(tokens (N,), batch, cache, hidden_layers=())`` -> final-normed hidden states (N, d) of the
    flat tokens and, in the order given, the states entering decoder layers ``hidden_layers`` (Hugging Face's
    ``output_hidden_states[i]``: 0 the embeddings; EAGLE-3's features);
    ``logits(h)`` applies the LM head (so callers score only the positions they need)."""

    def __init__(self, model: nn.Module, capacity: int, attn: str = "eager", linear: str = "auto"):
        decoder = model.get_decoder()
        layers = getattr(decoder, "layers", None)
        if layers is None or not all(hasattr(l, "self_attn") and hasattr(l.self_attn, "q_proj") for l in layers):
            raise ValueError(f"{type(model).__name__}: the batched engine runs Llama-family decoders "
                             "(layers with self_attn.q_proj/k_proj/v_proj/o_proj and an mlp)")
        _check_attn(attn)
        self.model, self.decoder, self.layers = model, decoder, list(layers)
        self.run_layers = [DecoderLayer(layer, linear) for layer in self.layers]
        self.lm_head, self.embed_tokens = model.get_output_embeddings(), model.get_input_embeddings()
        self.head = Projection(self.lm_head, linear)
        self.attn, self.capacity = attn, capacity
        w = self.lm_head.weight
        self.dtype, self.device = w.dtype, w.device
        self.rope = RotaryTable(decoder.rotary_emb, capacity, self.dtype, self.device)
        a = self.layers[0].self_attn
        self.kv_heads = a.k_proj.weight.shape[0] // a.head_dim
        self.head_dim = a.head_dim

    def new_cache(self, slots: int) -> SlotCache:
        return SlotCache(len(self.layers), slots, self.capacity, self.kv_heads, self.head_dim, self.dtype, self.device)

    def forward(self, tokens: torch.Tensor, batch: RaggedBatch, cache: SlotCache, hidden_layers=()):
        cos, sin = self.rope(batch.rope_pos)  # a tree node turns as at its depth, not where it is written
        x = self.embed_tokens(tokens)
        extra = {}
        for li, layer in enumerate(self.run_layers):
            if li in hidden_layers:
                extra[li] = x
            x = layer(x, cos, sin, cache, li, batch, self.attn)
        h = rms_norm(self.decoder.norm, x)
        return (h, [extra[i] for i in hidden_layers]) if hidden_layers else h

    __call__ = forward

    def logits(self, h):
        return self.head(h)


class BatchedEagleDrafter:
    """An :class:`~eagle_backbone.drafter.EagleDrafter` run on a :class:`SlotCache` (one layer)."""

    def __init__(self, drafter: nn.Module, lm_head: nn.Module, capacity: int, attn: str = "eager", linear: str = "auto"):
        _check_attn(attn)
        self.drafter, self.lm_head = drafter, lm_head  # the target's LM head reads the predicted features
        self.layer = drafter.layers[0]
        self.run_layer = DecoderLayer(self.layer, linear)
        self.head = Projection(lm_head, linear)
        self.attn, self.capacity = attn, capacity
        w = drafter.fc.weight
        self.dtype, self.device = w.dtype, w.device
        self.rope = RotaryTable(drafter.rotary_emb, capacity, self.dtype, self.device)
        a = self.layer.self_attn
        self.kv_heads, self.head_dim = a.k_proj.weight.shape[0] // a.head_dim, a.head_dim

    def new_cache(self, slots: int) -> SlotCache:
        return SlotCache(1, slots, self.capacity, self.kv_heads, self.head_dim, self.dtype, self.device)

    def __call__(self, tokens, features, batch: RaggedBatch, cache: SlotCache):
        """tokens (N,), features (N, d): the pairs (t_{j+1}, f_j) -> predicted features (N, d)."""
        d = self.drafter
        h = d.fc(torch.cat([d.embed_tokens(tokens).to(features.dtype), features.to(self.dtype)], dim=-1))
        cos, sin = self.rope(batch.rope_pos)
        return self.run_layer(h, cos, sin, cache, 0, batch, self.attn)

    draft = __call__  # drafted pairs (token, predicted feature) read the same way as true ones

    def logits(self, h):
        return self.head(h.to(self.lm_head.weight.dtype))
