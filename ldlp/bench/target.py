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
