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
  per-row overhead would dominate; a rule per dtype, :data:`~eagle_backbone.ragged.DENSE_SLACK`), and always
  on a GPU (one kernel instead of one a row; a varlen kernel is the next step there).

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

The batch layout (:class:`~eagle_backbone.ragged.RaggedBatch`: chains, draft-tree rows and spans) and the
caches (:class:`~eagle_backbone.ragged.SlotCache`) are :mod:`eagle_backbone.ragged`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from transformers.models.llama.modeling_llama import LlamaRMSNorm as _LLAMA_RMS_NORM

from eagle_backbone.linear import Projection
from eagle_backbone.ragged import RaggedBatch, SlotCache


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
        self.fc = Projection(drafter.fc, linear)  # F.linear with its bias cost 1.5x the packed matmul on one row
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
        h = self.fc(torch.cat([d.embed_tokens(tokens).to(features.dtype), features.to(self.dtype)], dim=-1))
        cos, sin = self.rope(batch.rope_pos)
        return self.run_layer(h, cos, sin, cache, 0, batch, self.attn)

    draft = __call__  # drafted pairs (token, predicted feature) read the same way as true ones

    def logits(self, h):
        return self.head(h.to(self.lm_head.weight.dtype))
