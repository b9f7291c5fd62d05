"""Target forward cost against the number of scored tokens, and verification's batch invariance.

    python scripts/bench_target.py                         (the embedded target and dtype/attention variants)
    python scripts/bench_target.py variants=[] threads=2
"""

import json

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.bench.target import batch_invariance, forward_costs
from eagle_backbone.loading import load_target


@hydra.main(config_path="../conf", config_name="bench_target", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    base = OmegaConf.to_container(cfg.model, resolve=True)
    configs = [base] + [{**base, **v} for v in cfg.variants]
    targets = {}
    for mc in configs:
        key = f"{mc['dtype']} {mc.get('attn_implementation') or 'sdpa'}"
        if key not in targets:
            targets[key] = load_target(mc)
    costs = forward_costs(targets, tuple(cfg.lengths), cfg.context, cfg.reps)  # interleaved across targets
    rows = []
    for key, target in targets.items():
        inv = batch_invariance(target, cfg.invariance.trials, cfg.invariance.tokens)
        dtype, attn = key.split()
        rows.append({"dtype": dtype, "attn_implementation": attn, "ms": {T: 1e3 * s for T, s in costs[key].items()},
                     **inv})
    T_max = max(cfg.lengths)
    print(f"{cfg.model.name}: median ms of a target forward scoring T tokens after {cfg.context} cached "
          f"({cfg.reps} rounds interleaving the settings, {torch.get_num_threads()} threads)\n")
    print("| dtype | attention | " + " | ".join(f"T={T}" for T in cfg.lengths) + f" | T={T_max} / T=1 "
          "| verification logits bitwise equal to decoding's | argmax flips |")
    print("|---|---|" + "---:|" * (len(cfg.lengths) + 3))
    for r in rows:
        ms = r["ms"]
        print(f"| {r['dtype']} | {r['attn_implementation']} | " + " | ".join(f"{ms[T]:.2f}" for T in cfg.lengths)
              + f" | {ms[T_max] / ms[1]:.2f} | {r['bitwise_equal']}/{r['positions']} | {r['argmax_flips']} |")
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
