"""Profile the batched step's costs on this machine: the table that policy=load_aware reads.

    python scripts/profile_cost.py
    python scripts/profile_cost.py threads=2 slots=[1,8,32]
    python scripts/profile_cost.py missing_only=true slots=[1,2,4,8,16]   (profile only what paths.cost lacks)
"""

import hydra
from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from omegaconf import DictConfig


@hydra.main(config_path="../conf", config_name="profile_cost", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    from eagle_backbone.cost import (
        check_costs,
        cost_key,
        full_key,
        profile_costs,
        table_path,
    )
    from eagle_backbone.batched_engine import BatchedSpeculativeEngine
    from ldlp.report.load_sweep import check_markdown
    from ldlp.bench.harness.loaders import load_pair_cached

    from eagle_backbone.runtime import int_list_setting, int_setting

    threads = start(cfg)
    # the raw values, before any model loads
    for name in ("slots", "tokens_per_slot"):
        int_list_setting(name, cfg[name], 1, "conf/profile_cost.yaml", distinct=True)
    int_setting("reps", cfg.reps, 1, "conf/profile_cost.yaml")
    int_setting("context", cfg.context, 1, "conf/profile_cost.yaml")
    if cfg.check.enabled:
        int_list_setting("check.slots", cfg.check.slots, 1, "conf/profile_cost.yaml")
        int_list_setting("check.gammas", cfg.check.gammas, 0, "conf/profile_cost.yaml")
    pair = load_pair_cached(cfg.model)
    if cfg.missing_only:  # the main command's cost stage: only what is missing, as a first use would profile it
        from ldlp.bench.harness.loaders import load_cost_table

        table = load_cost_table(cfg.paths.cost, cfg.model.name, pair.target, pair.candidates, str(cfg.attn),
                                slots=list(cfg.slots))
        print(f"cost table in {cfg.paths.cost}: slot counts {table.slots}, attention {cfg.attn}")
        return
    target, kind = pair.target, cfg.model.drafter_kind
    capacity = int(cfg.context) + 5 * (int(cfg.reps) + 3) + max(cfg.tokens_per_slot) + 8

    def factory(R: int, policy=None):
        return BatchedSpeculativeEngine(target, pair.drafter, kind, slots=R, capacity=capacity, attn=str(cfg.attn),
                                        policy=policy)

    # the whole key: model, dtype, device, threads, torch, processor, drafter kind and weights, attention
    key = full_key(cost_key(cfg.model.name, target.dtype, target.device, threads), factory)
    table = profile_costs(factory, key, slots=list(cfg.slots), tokens=list(cfg.tokens_per_slot),
                          context=int(cfg.context), reps=int(cfg.reps), seed=int(cfg.seed))
    path = table.save(cfg.out or table_path(cfg.paths.cost, key))
    print(f"wrote {path} ({table.meta['seconds']} s; key {key})")
    if cfg.check.enabled:
        # the table against measured engine steps on real prompts: does it rank the γs as the machine does?
        from eagle_backbone.io import atomic_write_text
        from ldlp.bench.harness.loaders import load_prompts

        prompts = [ids for _, ids in load_prompts(cfg.data, pair.tokenizer)]
        rows = check_costs(table, factory, prompts, slots=list(cfg.check.slots), gammas=list(cfg.check.gammas))
        md = check_markdown(rows)
        atomic_write_text(path.with_suffix(".check.md"), md)
        print(md)


if __name__ == "__main__":
    main()
