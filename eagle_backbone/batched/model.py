"""Per-slot KV caches and a compact Llama forward over a Hugging Face model's own modules.

Why a forward of our own (route b) and not transformers' ``LlamaModel.forward`` with a custom cache and a
4D mask (route a): both run on the same :class:`SlotCache` and give the same logits, but transformers'
forward costs per call a fixed overhead of Python (output capturing, kwargs checks, mask preparation, a
rotary recomputation) on top of the same matrix products. Measured on the embedded target (8 layers,
d=384, eager attention, one thread, a one-token step after 256 cached positions, median of 30
interleaved, process CPU time; ``python -m eagle_backbone.batched.model``), on a quiet machine:

    bf16  B=1: route a 11.05 ms, route b 10.17 ms (-8%);  B=16: route a 21.28 ms, route b 19.35 ms (-9%)
    fp32  B=1: route a 10.09 ms, route b  9.34 ms (-7%);  B=16: route a 34.20 ms, route b 32.84 ms (-4%)

(and -9%/-8% in bf16 when the machine was loaded), and a step calls the target once and the drafter up
to γ+1 times. The compact forward calls the checkpoint's own submodules (RMSNorm, q/k/v/o projections,
MLP, rotary inverse frequencies): no weight is copied or re-laid out, so any Llama-family
checkpoint (Vicuna-7B included) loads unchanged through ``AutoModelForCausalLM``, and the per-token math is
transformers' (tests/test_batched.py checks the logits). Only attention and the cache are ours:

* :class:`SlotCache` holds (layers, slots, kv_heads, capacity, head_dim) key and value buffers allocated
  once. A forward writes its keys at each row's own positions (an indexed store, no concatenation) and
  attends over the first ``kv_len`` positions; rolling a slot back is setting its length, since a query at
  position p only ever sees keys at positions <= p, and every such key was written by this or an earlier
  accepted forward. Padded entries of a ragged input write to a scratch position past every real one (the
  engine's choice; see eagle_backbone/engine.py).
* Attention is transformers' eager math (scores in the model dtype, float32 softmax) by default: in
  bfloat16 it gives a token the same logits whether scored alone or among γ+1, as conf/model/embedded.yaml
  explains; ``attn="sdpa"`` uses torch's fused kernel with the same explicit mask.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn


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
        # by using a shorter kv_len and overwriting positions, so the cache itself holds no state to reset
        self.capacity = capacity

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    # ---- transformers' Cache protocol, enough for LlamaAttention (route a, used by the measurement) ----
    def bind(self, rows, positions, kv_len):
        self._rows, self._pos, self._kv = rows, positions, kv_len

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return write_and_read(self, layer_idx, key_states, value_states, self._rows, self._pos, self._kv)


def write_and_read(cache: SlotCache, layer: int, k: torch.Tensor, v: torch.Tensor, rows, positions, kv_len: int):
    """Store (R, H, T, D) keys/values at ``positions`` (R, T) of ``rows`` (None: rows 0..R-1); return the
    (R, H, kv_len, D) keys and values to attend over (views when ``rows`` is None, else a row gather)."""
    kb, vb = cache.k[layer], cache.v[layer]
    r = torch.arange(k.shape[0], device=k.device)[:, None] if rows is None else rows[:, None]
    # advanced indices on dims 0 and 2 with a slice between: the indexed shape is (R, T, H, D)
    kb[r, :, positions] = k.transpose(1, 2)
    vb[r, :, positions] = v.transpose(1, 2)
    if rows is None:
        # a contiguous copy: bf16 matmuls on the strided slice run ~1.6x slower than copy + matmul
        return kb[: k.shape[0], :, :kv_len].contiguous(), vb[: k.shape[0], :, :kv_len].contiguous()
    return kb[rows, :, :kv_len], vb[rows, :, :kv_len]


def visible(positions: torch.Tensor, kv_len: int, impl: str = "sdpa", dtype=torch.float32) -> torch.Tensor:
    """(R, 1, T, kv_len): query at position p sees keys 0..p of its own slot. A bool mask for sdpa; for
    eager the additive mask (0 or the dtype's minimum) that transformers' eager attention adds."""
    keys = torch.arange(kv_len, device=positions.device)
    mask = (keys[None, None, :] <= positions[:, :, None])[:, None]
    if impl == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def attention(q, k, v, mask: torch.Tensor, scaling: float, impl: str) -> torch.Tensor:
    """q (R, Hq, T, D), k/v (R, Hkv, S, D), mask (R, 1, T, S) from :func:`visible` -> (R, T, Hq*D)."""
    R, Hq, T, D = q.shape
    Hkv = k.shape[1]
    if impl == "sdpa":
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                                         enable_gqa=Hq != Hkv)
        return out.transpose(1, 2).reshape(R, T, Hq * D)
    # eager, as transformers computes it; GQA by grouping the query heads instead of copying keys
    rep = Hq // Hkv
    qg = q.reshape(R, Hkv, rep * T, D)
    scores = (torch.matmul(qg, k.transpose(2, 3)) * scaling).view(R, Hkv, rep, T, -1)
    scores = scores + mask[:, :, None]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs.view(R, Hkv, rep * T, -1), v).view(R, Hq, T, D)
    return out.transpose(1, 2).reshape(R, T, Hq * D)


def decoder_layer(layer: nn.Module, x: torch.Tensor, cos, sin, cache: SlotCache, li: int, rows, positions,
                  kv_len: int, mask: torch.Tensor, impl: str) -> torch.Tensor:
    """One transformers LlamaDecoderLayer on (R, T, d), with our cache and mask."""
    R, T, _ = x.shape
    attn = layer.self_attn
    hd = attn.head_dim
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(R, T, -1, hd).transpose(1, 2)
    k = attn.k_proj(h).view(R, T, -1, hd).transpose(1, 2)
    v = attn.v_proj(h).view(R, T, -1, hd).transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    keys, values = write_and_read(cache, li, k, v, rows, positions, kv_len)
    x = x + attn.o_proj(attention(q, keys, values, mask, attn.scaling, impl))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def packed_decoder_layer(layer: nn.Module, x: torch.Tensor, packed: torch.Tensor, R: int, T: int, cos, sin,
                         cache: SlotCache, li: int, rows, positions, kv_len: int, mask: torch.Tensor,
                         impl: str) -> torch.Tensor:
    """:func:`decoder_layer` for a ragged batch: ``x`` (N, d) holds only the real tokens, ``packed`` (N,)
    their flat indices in the padded (R, T) layout. Projections and the MLP run over the N real tokens;
    attention runs padded (padded queries see their own scratch keys only and are dropped)."""
    attn = layer.self_attn
    hd = attn.head_dim
    h = layer.input_layernorm(x)

    def padded(t):  # (N, H*D) -> (R, H, T, D), zeros at padded entries
        full = t.new_zeros(R * T, t.shape[-1]).index_copy_(0, packed, t)
        return full.view(R, T, -1, hd).transpose(1, 2)

    q, k, v = padded(attn.q_proj(h)), padded(attn.k_proj(h)), padded(attn.v_proj(h))
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    keys, values = write_and_read(cache, li, k, v, rows, positions, kv_len)
    out = attention(q, keys, values, mask, attn.scaling, impl).reshape(R * T, -1).index_select(0, packed)
    x = x + attn.o_proj(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


class RotaryTable:
    """cos/sin for positions 0..n-1 from a transformers rotary module (its inv_freq and scaling: any rope type)."""

    def __init__(self, rotary: nn.Module, n: int, dtype: torch.dtype, device):
        dummy = torch.zeros(1, dtype=dtype, device=device)
        cos, sin = rotary(dummy, position_ids=torch.arange(n, device=device)[None])
        self.cos, self.sin = cos[0], sin[0]  # (n, D), already in the model dtype as transformers casts them

    def __call__(self, positions):
        return self.cos[positions][:, None], self.sin[positions][:, None]  # (R, 1, T, D)


class BatchedLlama:
    """A Hugging Face Llama-family causal LM run on a :class:`SlotCache` (target or standalone draft LM).

    ``forward(tokens, positions, cache, kv_len, rows=None, hidden_layers=())`` -> final-normed hidden
    states (R, T, d) and the outputs of decoder layers ``hidden_layers`` (for EAGLE-3 style drafters);
    ``logits(h)`` applies the LM head (so callers score only the positions they need)."""

    def __init__(self, model: nn.Module, capacity: int, attn: str = "eager"):
        decoder = model.get_decoder()
        layers = getattr(decoder, "layers", None)
        if layers is None or not all(hasattr(l, "self_attn") and hasattr(l.self_attn, "q_proj") for l in layers):
            raise ValueError(f"{type(model).__name__}: the batched engine runs Llama-family decoders "
                             "(layers with self_attn.q_proj/k_proj/v_proj/o_proj and an mlp)")
        if attn not in ("eager", "sdpa"):
            raise ValueError(f"attn must be 'eager' or 'sdpa', got {attn!r}")
        self.model, self.decoder, self.layers = model, decoder, list(layers)
        self.lm_head, self.embed_tokens = model.get_output_embeddings(), model.get_input_embeddings()
        self.attn, self.capacity = attn, capacity
        w = self.lm_head.weight
        self.dtype, self.device = w.dtype, w.device
        self.rope = RotaryTable(decoder.rotary_emb, capacity, self.dtype, self.device)
        a = self.layers[0].self_attn
        self.kv_heads = a.k_proj.weight.shape[0] // a.head_dim
        self.head_dim = a.head_dim

    def new_cache(self, slots: int) -> SlotCache:
        return SlotCache(len(self.layers), slots, self.capacity, self.kv_heads, self.head_dim, self.dtype, self.device)

    def forward(self, tokens, positions, cache: SlotCache, kv_len: int, rows=None, hidden_layers=(), packed=None):
        """``packed`` (N,): flat indices of the real tokens of a ragged (R, T) input; the projections and MLPs
        then run over those N only and the padded entries of the result are zeros."""
        cos, sin = self.rope(positions)
        mask = visible(positions, kv_len, self.attn, self.dtype)
        extra = []
        R, T = tokens.shape
        if packed is not None:
            x = self.embed_tokens(tokens.reshape(-1).index_select(0, packed))
            for li, layer in enumerate(self.layers):
                x = packed_decoder_layer(layer, x, packed, R, T, cos, sin, cache, li, rows, positions, kv_len,
                                         mask, self.attn)
                if li in hidden_layers:
                    extra.append(unpack(x, packed, R, T))
            h = unpack(self.decoder.norm(x), packed, R, T)
            return (h, extra) if hidden_layers else h
        x = self.embed_tokens(tokens)
        for li, layer in enumerate(self.layers):
            x = decoder_layer(layer, x, cos, sin, cache, li, rows, positions, kv_len, mask, self.attn)
            if li in hidden_layers:
                extra.append(x)
        h = self.decoder.norm(x)
        return (h, extra) if hidden_layers else h

    __call__ = forward

    def logits(self, h):
        return self.lm_head(h)


def unpack(x: torch.Tensor, packed: torch.Tensor, R: int, T: int) -> torch.Tensor:
    """(N, ...) rows at flat indices ``packed`` -> (R, T, ...), zeros elsewhere."""
    return x.new_zeros(R * T, *x.shape[1:]).index_copy_(0, packed, x).view(R, T, *x.shape[1:])


class BatchedHFLlama(BatchedLlama):
    """Route a: transformers' own ``LlamaModel.forward`` with :class:`SlotCache` as its cache and a 4D
    additive mask (kept for the measurement in the module docstring, and as a reference in tests)."""

    def forward(self, tokens, positions, cache, kv_len, rows=None, hidden_layers=()):
        cache.bind(rows, positions, kv_len)
        bias = visible(positions, kv_len, "eager", self.dtype)
        return self.decoder(input_ids=tokens, attention_mask=bias, position_ids=positions, cache=cache,
                            use_cache=True).last_hidden_state

    __call__ = forward


class BatchedEagleDrafter:
    """An :class:`~eagle_backbone.drafter.EagleDrafter` run on a :class:`SlotCache` (one layer)."""

    def __init__(self, drafter: nn.Module, lm_head: nn.Module, capacity: int, attn: str = "eager"):
        self.drafter, self.lm_head = drafter, lm_head  # the target's LM head reads the predicted features
        self.layer = drafter.layers[0]
        self.attn, self.capacity = attn, capacity
        w = drafter.fc.weight
        self.dtype, self.device = w.dtype, w.device
        self.rope = RotaryTable(drafter.rotary_emb, capacity, self.dtype, self.device)
        a = self.layer.self_attn
        self.kv_heads, self.head_dim = a.k_proj.weight.shape[0] // a.head_dim, a.head_dim

    def new_cache(self, slots: int) -> SlotCache:
        return SlotCache(1, slots, self.capacity, self.kv_heads, self.head_dim, self.dtype, self.device)

    def __call__(self, tokens, features, positions, cache: SlotCache, kv_len: int, rows=None):
        d = self.drafter
        h = d.fc(torch.cat([d.embed_tokens(tokens).to(features.dtype), features.to(self.dtype)], dim=-1))
        cos, sin = self.rope(positions)
        return decoder_layer(self.layer, h, cos, sin, cache, 0, rows, positions, kv_len,
                             visible(positions, kv_len, self.attn, self.dtype), self.attn)

    def logits(self, h):
        return self.lm_head(h.to(self.lm_head.weight.dtype))

def forward_groups(lm: BatchedLlama, groups, cache: SlotCache) -> list[torch.Tensor]:
    """One forward over several row groups, each ``(tokens (R, T), positions (R, T), rows, kv_len)``, with
    the projections and MLPs run once over all groups' tokens packed together and attention per group:
    how a new prompt's prefill joins a decoding step without padding the step's rows to the prompt's
    length. Returns each group's final-normed hidden states. (Measured against a separate prefill
    forward by :func:`eagle_backbone.batched.bench.prefill_join_cost`.)"""
    d = lm.embed_tokens.weight.shape[1]
    shapes = [g[0].shape for g in groups]
    sizes = [r * t for r, t in shapes]
    x = torch.cat([lm.embed_tokens(g[0]).reshape(-1, d) for g in groups])
    ropes = [lm.rope(g[1]) for g in groups]
    masks = [visible(g[1], g[3], lm.attn, lm.dtype) for g in groups]
    for li, layer in enumerate(lm.layers):
        attn = layer.self_attn
        hd = attn.head_dim
        h = layer.input_layernorm(x)
        q_all, k_all, v_all = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        outs = []
        for (tok, pos, rows, kv_len), (R, T), (cos, sin), mask, q, k, v in zip(
                groups, shapes, ropes, masks, q_all.split(sizes), k_all.split(sizes), v_all.split(sizes)):
            q = q.view(R, T, -1, hd).transpose(1, 2)
            k = k.view(R, T, -1, hd).transpose(1, 2)
            v = v.view(R, T, -1, hd).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = write_and_read(cache, li, k, v, rows, pos, kv_len)
            outs.append(attention(q, keys, values, mask, attn.scaling, lm.attn).reshape(R * T, -1))
        x = x + attn.o_proj(torch.cat(outs))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    h = lm.decoder.norm(x)
    return [part.view(R, T, -1) for part, (R, T) in zip(h.split(sizes), shapes)]


# ---- the route measurement -----------------------------------------------------------------------------


@torch.inference_mode()
def measure_routes(model, batches=(1, 16), context: int = 256, reps: int = 30, seed: int = 0) -> dict:
    """Median ms of a one-token step after ``context`` cached positions, route a vs route b, per B.

    Process CPU time, not wall time: on a shared machine other jobs inflate wall time by more than the
    difference measured here (one thread: CPU time is the compute this process spent)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    out = {}
    for B in batches:
        runners = {"a_transformers": BatchedHFLlama(model, context + 8), "b_compact": BatchedLlama(model, context + 8)}
        caches = {k: r.new_cache(B) for k, r in runners.items()}
        ctx = torch.randint(4, vocab, (B, context), generator=g)
        pos = torch.arange(context)[None].expand(B, context)
        for k, r in runners.items():
            r(ctx, pos, caches[k], context)
        step = torch.randint(4, vocab, (B, 1), generator=g)
        spos = torch.full((B, 1), context)
        times = {k: [] for k in runners}
        for i in range(reps + 2):
            for k, r in runners.items():
                t0 = time.process_time()
                r.logits(r(step, spos, caches[k], context + 1))
                if i >= 2:
                    times[k].append(1e3 * (time.process_time() - t0))
        out[B] = {k: statistics.median(v) for k, v in times.items()}
    return out


if __name__ == "__main__":
    from transformers import AutoModelForCausalLM

    from eagle_backbone.paths import REPO_ROOT
    from eagle_backbone.runtime import set_threads

    set_threads(1)
    for dtype in (torch.bfloat16, torch.float32):
        m = AutoModelForCausalLM.from_pretrained(REPO_ROOT / "data/embedded/target", dtype=dtype,
                                                 attn_implementation="eager").eval()
        for B, r in measure_routes(m).items():
            print(f"{dtype} B={B}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in r.items()))
