"""Target forward cost against the number of scored tokens, and verification's batch invariance.

    python scripts/bench_target.py                         (the embedded target and dtype/attention variants)
    python scripts/bench_target.py variants=[] threads=2
"""

import json

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.bench.measurements.target import batch_invariance, forward_costs
from ldlp.report.engine import target_costs_markdown
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
    print(f"{cfg.model.name}: median ms of a target forward scoring T tokens after {cfg.context} cached "
          f"({cfg.reps} rounds interleaving the settings, {torch.get_num_threads()} threads)\n")
    print(target_costs_markdown(rows, list(cfg.lengths)))
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
