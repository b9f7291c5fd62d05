"""What batching costs at real prompt lengths: the attention routes, and the engine's scaling with its
prefill share (``scripts/bench_attention.py``, docs/batched.md).

1. **Routes** (:func:`attention_routes`): one decoding step's attention over R slots with contexts drawn
   from a prompt set's lengths, every layer of the target, timed by process CPU time, interleaved:

   * ``gather``: the retired route: index every running row's whole K/V prefix out of the cache (a copy
     of R × the longest context) and attend over the longest context with a mask;
   * ``copy``: the same when the rows are all slots in order (a contiguous copy instead of a gather);
   * ``per_row``: the engine's route: each row attends over views of its own slot (nothing copied);
   * ``per_row_qkT``: the same with the scores as q @ kᵀ over the transposed view of the cache, the engine's
     form before its bfloat16 one (k @ qᵀ; the same in float32);
   * ``dense``: the engine's dense block: one call on a view of consecutive slots, masked to the longest;
   * ``flex``: ``torch.nn.attention.flex_attention`` with a block mask from the rows' lengths (eager: this
     CPU build has no compiled kernel without ``torch.compile``), where it runs.

2. **Linear kernels** (:func:`linear_kernels`): the target's projections at M tokens through
   ``torch.nn.functional.linear`` (what the compact forward calls) against oneDNN's linear
   (``torch.ops.mkldnn._linear_pointwise``, the kind of kernel CPU serving engines call), with whether each
   gives a row the same bits alone (M = 1) and inside M rows.

3. **Elementwise ops** (:func:`elementwise_kernels`): one layer's RMSNorm, rotary and SiLU-and-multiply at
   M tokens as transformers writes them, as the engine runs them (torch's fused ``rms_norm``, q and k turned
   in one pass), and through ``torch.compile`` (``dynamic=True``: one graph for every M), with its compile
   seconds and whether each gives the eager bits.

4. **Scaling** (:func:`engine_scaling`): batched AR on a prompt set at each C, with prefill in its own
   forward so that its seconds are separable: generated tokens per process CPU-second, the prefill's share
   of the run, and decode-only tokens per CPU-second (prefill seconds left out). Prefill costs the same
   per prompt token at any C (its matrices are already a batch), so a prompt set whose prompts are long
   against the tokens generated scales by Amdahl's law however cheap a decoding step becomes.
"""

from __future__ import annotations

import random
import statistics
import time

import torch
from torch import nn

from eagle_backbone.linear import Projection
from eagle_backbone.llama import BatchedLlama, attend
from eagle_backbone.ragged import RaggedBatch
from eagle_backbone.timing import interleaved

ROUTES = ("gather", "copy", "per_row_qkT", "per_row", "dense", "flex")


def _scores_qkT(q, k, scaling):
    """The scores as the engine computed them before its bfloat16 form: q @ kᵀ over the transposed view."""
    return torch.matmul(q, k.transpose(-1, -2)) * scaling


def _with_scores(scores, fn):
    """``fn()`` with the engine's score kernel swapped for ``scores`` (a retired form, timed beside today's)."""
    from eagle_backbone import llama

    engine_scores, llama._scores = llama._scores, scores
    try:
        return fn()
    finally:
        llama._scores = engine_scores


def _timed(fns: dict, reps: int) -> dict[str, float]:
    """Median process-CPU ms of each function, interleaved in rotating order (one warm-up round)."""
    times = {n: [] for n in fns}

    def one(n, _, k, r):  # round r starts with function r mod n
        t0 = time.process_time()
        fns[n]()
        if r:
            times[n].append(1e3 * (time.process_time() - t0))

    interleaved(list(fns), [None], reps + 1, one, order="rotate")
    return {n: statistics.median(v) for n, v in times.items()}


def _padded_attention(q, k, v, lens, scaling):
    """(R, Hq, 1, D) queries over (R, Hkv, L, D) keys, key j visible to row r while j < lens[r] (eager math;
    grouped query heads, as the engine groups them)."""
    R, Hq, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    visible = torch.arange(L) < torch.tensor(lens)[:, None]
    bias = torch.zeros(R, 1, 1, L, dtype=q.dtype).masked_fill_(~visible[:, None, None], torch.finfo(q.dtype).min)
    scores = torch.matmul(q.reshape(R, Hkv, Hq // Hkv, D), k.transpose(2, 3)) * scaling + bias
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _flex(q, k, v, lens, scaling):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = torch.tensor(lens)
    mask = create_block_mask(lambda b, h, qi, kv: kv < n[b], len(lens), None, 1, k.shape[2], device="cpu")
    return flex_attention(q, k, v, block_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])


@torch.inference_mode()
def attention_routes(lm: BatchedLlama, lengths: list[int], slots=(1, 16, 32), reps: int = 10, seed: int = 0) -> list[dict]:
    """Median CPU ms of one step's attention (all layers, one new token per row) by each route, per R;
    contexts sampled from ``lengths``."""
    rng = random.Random(seed)
    a = lm.layers[0].self_attn
    H, D, nl = lm.kv_heads, lm.head_dim, len(lm.layers)
    out = []
    for R in slots:
        lens = [rng.choice(lengths) + 1 for _ in range(R)]
        cache = lm.new_cache(R) if max(lens) < lm.capacity else None
        if cache is None:
            raise ValueError(f"contexts up to {max(lens)} need a capacity above {lm.capacity}")
        cache.k.normal_()
        cache.v.normal_()
        q = torch.randn(R, a.config.num_attention_heads, D, dtype=lm.dtype)
        kv = torch.randn(R, H, D, dtype=lm.dtype)
        L, rows = max(lens), torch.arange(R)
        qp = q[:, :, None].transpose(1, 2).reshape(R, -1, 1, D)  # (R, Hq, 1, D)
        per_row = RaggedBatch(range(R), [n - 1 for n in lens], [1] * R, "cpu", dense_slack=0)
        dense = RaggedBatch(range(R), [n - 1 for n in lens], [1] * R, "cpu", dense_slack=10**9)
        fns = {
            "gather": lambda: [_padded_attention(qp, cache.k[i][rows, :, :L], cache.v[i][rows, :, :L], lens, a.scaling)
                               for i in range(nl)],
            "copy": lambda: [_padded_attention(qp, cache.k[i][:R, :, :L].contiguous(), cache.v[i][:R, :, :L].contiguous(),
                                               lens, a.scaling) for i in range(nl)],
            "per_row_qkT": lambda: _with_scores(_scores_qkT, lambda: [attend(cache, i, q, kv, kv, per_row, a.scaling,
                                                                               "eager") for i in range(nl)]),
            "per_row": lambda: [attend(cache, i, q, kv, kv, per_row, a.scaling, "eager") for i in range(nl)],
            "dense": lambda: [attend(cache, i, q, kv, kv, dense, a.scaling, "eager") for i in range(nl)],
            "flex": lambda: [_flex(qp, cache.k[i][:R, :, :L], cache.v[i][:R, :, :L], lens, a.scaling) for i in range(nl)],
        }
        errors = {}
        try:
            fns["flex"]()
        except Exception as e:  # no flex_attention on this build/CPU: recorded, not fatal
            errors["flex"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            del fns["flex"]
        ms = _timed(fns, reps)
        out.append({"slots": R, "mean_context": statistics.mean(lens), "max_context": L, "ms": ms, "errors": errors,
                    "copied_mb": 2 * nl * R * H * L * D * cache.k.element_size() / 1e6})
    return out


@torch.inference_mode()
def linear_kernels(lm: BatchedLlama, tokens=(1, 2, 3, 4, 8, 16, 80), reps: int = 10, seed: int = 0) -> list[dict]:
    """Median CPU ms of one layer's q/k/v/o and MLP projections at M tokens: torch's F.linear, oneDNN's linear on
    the weight as stored, and on a copy packed once (``onednn_packed``, what the engine's
    :class:`~eagle_backbone.linear.Projection` calls where the CPU runs the dtype, padded to 2 rows); ``same_bits_alone``: each
    kernel gives the first row the same bits at M = 1 as inside M rows."""
    g = torch.Generator().manual_seed(seed)
    layer = lm.layers[0]
    mods = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
            layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
    onednn = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    kernels = {"F.linear": lambda m, x: torch.nn.functional.linear(x, m.weight, m.bias)}
    if onednn is not None:
        kernels["onednn"] = lambda m, x: onednn(x, m.weight, m.bias, "none", [], "")
        try:
            packed = {m: torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), 16) for m in mods}
            kernels["onednn_packed"] = lambda m, x: onednn(x, packed[m], m.bias, "none", [], "")
        except RuntimeError:  # no packed layout for this dtype here: the two others only
            pass
    # the engine's calls (DecoderLayer): q/k/v fused into one matmul, gate/up into another, each on the route the CPU takes
    fused = [Projection(group) for group in (mods[:3], mods[3:4], mods[4:6], mods[6:])]
    out = []
    for M in tokens:
        xs = {m: torch.randn(M, m.in_features, generator=g).to(lm.dtype) for m in mods}
        fns = {k: (lambda f=f: [f(m, xs[m]) for m in mods]) for k, f in kernels.items()}
        fns["engine_fused"] = lambda: [p.split(xs[m]) for p, m in zip(fused, (mods[0], mods[3], mods[4], mods[6]))]
        try:
            ms = _timed(fns, reps)
        except RuntimeError as e:  # oneDNN without this dtype on this CPU
            ms = _timed({"F.linear": fns["F.linear"]}, reps)
            ms["onednn_error"] = str(e).splitlines()[0][:160]
        same = {k: all(torch.equal(f(m, xs[m][:1]), f(m, xs[m])[:1]) for m in mods) for k, f in kernels.items()
                if k in ms}
        # fused against one call a projection on the same route: the same bits (each column one dot product)
        same_fused = all(torch.equal(torch.cat(p.split(x), -1), torch.cat([Projection(m)(x) for m in grp], -1))
                         for p, grp in zip(fused, (mods[:3], mods[3:4], mods[4:6], mods[6:])) for x in [xs[grp[0]]])
        out.append({"tokens": M, "ms": ms, "same_bits_alone": same, "fused_same_bits": same_fused})
    return out


def elementwise_kernels(lm: BatchedLlama, tokens=(1, 16, 64, 256), reps: int = 10, seed: int = 0,
                        compile: bool = True) -> dict:
    """Median CPU ms of one layer's elementwise work at M tokens: both RMSNorms, rotary on q and k, and
    SiLU-and-multiply; ``eager`` as transformers writes them, ``engine`` as :class:`DecoderLayer` runs them,
    ``compiled`` the eager functions through ``torch.compile(dynamic=True)`` (``compile_s``: the first call's
    seconds). ``same_bits``: each route's outputs equal the eager ones."""
    from eagle_backbone.llama import rms_norm, rotate

    g = torch.Generator().manual_seed(seed)
    layer, rl = lm.layers[0], lm.run_layers[0]
    norm, hd = layer.input_layernorm, rl.head_dim
    nq, nk, _ = rl.qkv.sizes
    d, ff = norm.weight.shape[0], layer.mlp.gate_proj.out_features

    def eager(x, qk, cos, sin, gate, up):
        q, k = qk[:, : nq // hd], qk[:, nq // hd:]
        return (norm(x), layer.post_attention_layernorm(x), rotate(q, cos, sin), rotate(k, cos, sin),
                nn.functional.silu(gate) * up)

    def engine(x, qk, cos, sin, gate, up):
        q, k = rotate(qk, cos, sin).split([nq // hd, nk // hd], 1)
        return (rms_norm(norm, x), rms_norm(layer.post_attention_layernorm, x), q, k, nn.functional.silu(gate) * up)

    routes = {"eager": eager, "engine": engine}
    compile_s = None
    if compile:
        routes["compiled"] = torch.compile(eager, dynamic=True)
    rows = []
    with torch.inference_mode():
        for M in tokens:
            x = torch.randn(M, d, generator=g).to(lm.dtype)
            qk = torch.randn(M, (nq + nk) // hd, hd, generator=g).to(lm.dtype)
            cos, sin = (torch.randn(M, 1, hd, generator=g).to(lm.dtype) for _ in range(2))
            gate, up = (torch.randn(M, ff, generator=g).to(lm.dtype) for _ in range(2))
            args = (x, qk, cos, sin, gate, up)
            if compile and compile_s is None:
                t0 = time.perf_counter()
                routes["compiled"](*args)
                compile_s = time.perf_counter() - t0
            ms = _timed({n: (lambda f=f: f(*args)) for n, f in routes.items()}, reps)
            ref = eager(*args)
            same = {n: all(torch.equal(a, b) for a, b in zip(f(*args), ref)) for n, f in routes.items() if n != "eager"}
            rows.append({"tokens": M, "ms": ms, "same_bits": same})
    return {"compile_s": compile_s, "rows": rows}


@torch.inference_mode()
def engine_scaling(target, prompts: list[list[int]], concurrency=(1, 16), max_new_tokens: int = 48) -> list[dict]:
    """Batched AR over ``prompts`` at each C, prefill in its own forward: CPU-seconds split into prefill and
    decoding (the share from the engine's profiled mode), tokens per CPU-second with and without the prefill."""
    from ldlp.bench.harness.engines import EngineFactory
    from ldlp.bench.harness.workload import run_workload

    out = []
    engines = EngineFactory.for_prompts(target, None, prompts, max_new_tokens)
    for C in concurrency:
        eng = engines(C, prefill="separate", profile=True)
        res = run_workload(eng, prompts, C, max_new_tokens)
        prefill = eng.prof.s.get("prefill", 0.0)
        total = sum(eng.prof.s.values())
        share = prefill / total if total > 0 else 0.0
        out.append({"concurrency": C, "tokens": res.new_tokens, "cpu_s": res.cpu_s, "wall_s": res.wall_s,
                    "tokens_per_cpu_s": res.new_tokens / res.cpu_s, "prefill_share": share,
                    "decode_tokens_per_cpu_s": res.new_tokens / (res.cpu_s * (1 - share))})
    return out
