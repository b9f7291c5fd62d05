"""Tune draft-length policies by exact replay on the oracle validation split (see ldlp/bench/replay.py).

    python scripts/tune_policies.py
    python scripts/tune_policies.py grid.ddd.threshold=[-2,-4,-6] costs.rounds=3
    python scripts/tune_policies.py costs.table=FILE   # price steps by a cost table (scripts/profile_cost.py)
"""

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.paths import REPO_ROOT
from ldlp.bench.loaders import build_policy, load_pair_cached, load_prompts, policy_config
from ldlp.bench.replay import (CostModel, OracleRows, TableCosts, best_per_policy, grid, measure_costs, tune,
                               tuning_markdown)


def _builder(cfg: DictConfig, name: str):
    _, base = policy_config(cfg, [f"policy={name}"])
    return lambda params: build_policy(OmegaConf.merge(base, params))


@hydra.main(config_path="../conf", config_name="tune_policies", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    pair = load_pair_cached(cfg.model)
    fitted = None
    if cfg.costs.measure:
        prompts = [ids for _, ids in load_prompts(cfg.data, pair.tokenizer)]
        fitted, _ = measure_costs(pair.target, pair.candidates, prompts, tuple(cfg.costs.gammas),
                                  cfg.costs.max_new_tokens, cfg.costs.rounds, cfg.seed)
    else:
        f = cfg.costs.fixed
        fitted = CostModel(f.step_ms / 1e3, f.draft_ms / 1e3, f.accepted_ms / 1e3)
    costs = fitted
    if cfg.costs.get("table"):  # the load-aware policies' measured table prices the steps; the fit is a check
        from eagle_backbone.cost import CostTable

        costs = TableCosts(CostTable.load(cfg.costs.table))
    rows = OracleRows.load(cfg.oracle_dir, cfg.split)
    policies = {name: (_builder(cfg, name), grid(OmegaConf.to_container(params))) for name, params in cfg.grid.items()}
    results = tune(rows, costs, policies, embed=pair.target.embed, vocab_size=pair.target.vocab_size,
                   oracle_cap=cfg.oracle_cap, progress=cfg.progress)
    oracle_dir = Path(cfg.oracle_dir)
    shown = oracle_dir.relative_to(REPO_ROOT) if oracle_dir.is_relative_to(REPO_ROOT) else oracle_dir
    where = f"{shown}, split {cfg.split}"
    md = tuning_markdown(results, costs, rows, where)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tuning.md").write_text(md)
    record = {"costs": costs.as_dict(), "results": results}
    if costs is not fitted:
        record["fitted_costs"] = fitted.as_dict()  # the fit beside the table, as a check
    (out / "tuning.json").write_text(json.dumps(record, indent=2))
    print(md.split("Every setting tried")[0])
    print("Best settings as overrides for scripts/evaluate.py:")
    for name, r in best_per_policy(results).items():
        if name not in ("static", "oracle"):
            print(f"  policy={name} " + " ".join(f"policy.{k}={v}" for k, v in r["params"].items()))
    print(f"wrote {out / 'tuning.md'}")


if __name__ == "__main__":
    main()
