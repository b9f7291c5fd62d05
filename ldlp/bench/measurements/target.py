"""What a target forward costs, and whether verification sees the logits plain decoding sees.

Two facts decide how well speculative decoding pays on a machine:

* :func:`forward_costs`: the seconds of one target forward that scores ``T`` new tokens after a
  context, for T = 1 .. γ+1. Speculative decoding wins when scoring γ+1 tokens costs little more than
  scoring one (memory-bound decoding, as on GPUs; on a CPU it depends on the dtype's matmul kernels).
* :func:`batch_invariance`: whether the logits of a token scored among T tokens equal, bit for bit,
  its logits when it is decoded alone. Greedy speculative decoding is lossless by construction only
  when they do; otherwise a near-tie between the two best tokens can flip (rare, but it happens in
  half precision with kernels that split their reductions by problem size).
"""

from __future__ import annotations

import statistics

import torch

from eagle_backbone.runtime import Clock
from eagle_backbone.target import TargetModel
from eagle_backbone.timing import interleaved


@torch.inference_mode()
def forward_costs(targets: dict[str, TargetModel], lengths=(1, 2, 3, 4, 5, 6, 7, 8, 9), context: int = 256,
                  reps: int = 20, seed: int = 0) -> dict[str, dict[int, float]]:
    """Median seconds of a forward scoring ``T`` tokens after ``context`` cached ones, per target and T.

    Rounds interleave the targets and the lengths, so drift on a busy machine lands on all alike."""
    g = torch.Generator().manual_seed(seed)
    first = next(iter(targets.values()))
    low = min(first.vocab_size - 1, 4)
    ctx = torch.randint(low, first.vocab_size, (1, context), generator=g)
    new = torch.randint(low, first.vocab_size, (1, max(lengths)), generator=g)
    clocks = {name: Clock(target.device) for name, target in targets.items()}

    def forward(setting, _, k, r):
        name, T = setting
        target, clock = targets[name], clocks[name]
        cache = target.new_cache()
        target(ctx.to(target.device), cache)
        t0 = clock()
        target(new[:, :T].to(target.device), cache)
        return clock() - t0

    settings = [(name, T) for name in targets for T in lengths]
    times = interleaved(settings, [None], reps + 1, forward, order="fixed")
    out: dict[str, dict[int, float]] = {name: {} for name in targets}
    for (name, T), per_round in zip(settings, times):
        out[name][T] = statistics.median(row[0] for row in per_round[1:])  # round 0 warms up
    return out


@torch.inference_mode()
def batch_invariance(target: TargetModel, trials: int = 5, tokens: int = 8, context: int = 64,
                     seed: int = 0) -> dict:
    """Score ``tokens`` tokens in one forward and one at a time after the same context; compare.

    Returns the number of positions compared, how many have bitwise-equal logits, how many have a
    different argmax, and the largest absolute logit difference."""
    g = torch.Generator().manual_seed(seed)
    low = min(target.vocab_size - 1, 4)
    equal = flips = total = 0
    max_diff = 0.0
    for trial in range(trials):
        ctx = torch.randint(low, target.vocab_size, (1, context + 7 * trial), generator=g).to(target.device)
        new = torch.randint(low, target.vocab_size, (1, tokens), generator=g).to(target.device)
        cache = target.new_cache()
        target(ctx, cache)
        together, _ = target(new, cache)
        cache = target.new_cache()
        target(ctx, cache)
        alone = torch.cat([target(new[:, i:i + 1], cache)[0] for i in range(tokens)], dim=1)
        for i in range(tokens):
            a, b = together[0, i], alone[0, i]
            total += 1
            equal += int(torch.equal(a, b))
            flips += int(a.argmax() != b.argmax())
            max_diff = max(max_diff, (a.float() - b.float()).abs().max().item())
    return {"positions": total, "bitwise_equal": equal, "argmax_flips": flips, "max_abs_diff": max_diff}


@torch.inference_mode()
def engine_batch_invariance(lm, contexts=(3, 40, 124, 251, 383), tokens: int = 8, others: int = 31,
                            seed: int = 0) -> dict:
    """Whether the engine's forward (:class:`~eagle_backbone.llama.BatchedLlama`) gives a token the same logits,
    bit for bit, however it is scored: decoded alone (one token a forward, the reference), verified among
    ``tokens`` in one forward (``chain``), as a node of a draft tree (``tree``), beside ``others`` rows in one
    batch with the same context lengths give or take 3 (``batch``: dense blocks), or with ragged ones
    (``batch_ragged``: rows alone), and after a prompt prefilled in chunks of 16 (``chunked_prefill``).

    Returns ``{case: {"positions", "bitwise_equal", "max_abs_diff"}}``: the engine is batch-invariant on this
    CPU and dtype when every case has ``bitwise_equal == positions``."""
    from eagle_backbone.ragged import RaggedBatch

    g = torch.Generator().manual_seed(seed)
    vocab = lm.lm_head.weight.shape[0]
    low = min(vocab - 1, 4)
    rand = lambda n: torch.randint(low, vocab, (n,), generator=g).tolist()  # noqa: E731
    out: dict[str, dict] = {}

    def prefill(cache, slot, ids, chunk=None):
        step = chunk or len(ids)
        for a in range(0, len(ids), step):
            lm(torch.tensor(ids[a: a + step]), RaggedBatch([slot], [a], [len(ids[a: a + step])], "cpu"), cache)

    def score(rows, counts, new, parents=None, chunk=None):
        """Row 0 is ours: contexts ``rows``, each bringing ``counts`` tokens (ours: ``new``); row 0's logits."""
        cache = lm.new_cache(len(rows))
        for s, r in enumerate(rows):
            prefill(cache, s, r, chunk if s == 0 else None)
        toks = list(new) + [x for c in counts[1:] for x in rand(c)]
        batch = RaggedBatch(range(len(rows)), [len(r) for r in rows], counts, "cpu",
                            parents=None if parents is None else [parents] + [None] * (len(rows) - 1))
        return lm.logits(lm(torch.tensor(toks), batch, cache)[: counts[0]])

    def compare(case, got, ref):
        row = out.setdefault(case, {"positions": 0, "bitwise_equal": 0, "max_abs_diff": 0.0})
        for a, b in zip(got, ref):
            row["positions"] += 1
            row["bitwise_equal"] += int(torch.equal(a, b))
            row["max_abs_diff"] = max(row["max_abs_diff"], (a.float() - b.float()).abs().max().item())

    for length in contexts:
        ctx, new = rand(length), rand(tokens)
        cache = lm.new_cache(1)
        prefill(cache, 0, ctx)
        alone = torch.cat([lm.logits(lm(torch.tensor([x]), RaggedBatch([0], [length + i], [1], "cpu"), cache))
                           for i, x in enumerate(new)])
        compare("chain", score([ctx], [tokens], new), alone)
        # a tree: the chain's first five tokens with side branches off its first two nodes
        depth = min(5, tokens)
        parents = list(range(-1, depth - 1)) + [0, 1, 0][: tokens - depth]
        tree_new = new[:depth] + rand(len(parents) - depth)
        compare("tree", score([ctx], [len(parents)], tree_new, parents)[:depth], alone[:depth])
        near = [rand(max(1, length + int(d))) for d in torch.randint(-3, 4, (others,), generator=g)]
        compare("batch", score([ctx] + near, [depth] * (others + 1), new[:depth]), alone[:depth])
        ragged = [rand(int(n)) for n in torch.randint(10, 400, (others,), generator=g)]
        compare("batch_ragged", score([ctx] + ragged, [1] * (others + 1), new[:1]), alone[:1])
        compare("chunked_prefill", score([ctx], [tokens], new, chunk=16), alone)
    return out
