"""Profile the batched step's costs on this machine: the table that policy=load_aware reads.

    python scripts/profile_cost.py
    python scripts/profile_cost.py threads=2 slots=[1,8,32]
"""

import hydra
from _setup import start  # scripts/_setup.py: threads, quiet notices, clear model errors
from omegaconf import DictConfig


@hydra.main(config_path="../conf", config_name="profile_cost", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from eagle_backbone.batched.cost import cost_key, profile_costs, table_path
    from eagle_backbone.batched.engine import BatchedSpeculativeEngine
    from ldlp.bench.loaders import load_pair_cached

    threads = start(cfg)
    pair = load_pair_cached(cfg.model)
    target, kind = pair.target, cfg.model.drafter_kind
    key = cost_key(cfg.model.name, target.dtype, target.device, threads)
    capacity = int(cfg.context) + 5 * (int(cfg.reps) + 3) + max(cfg.tokens_per_slot) + 8

    def factory(R: int, policy=None):
        return BatchedSpeculativeEngine(target, pair.drafter, kind, slots=R, capacity=capacity, attn=str(cfg.attn),
                                        policy=policy)

    table = profile_costs(factory, key, slots=list(cfg.slots), tokens=list(cfg.tokens_per_slot),
                          context=int(cfg.context), reps=int(cfg.reps), seed=int(cfg.seed))
    path = table.save(cfg.out or table_path(cfg.paths.cost, key))
    print(f"wrote {path} ({table.meta['seconds']} s)")


if __name__ == "__main__":
    main()
