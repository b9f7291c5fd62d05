"""Tune draft-length policies by exact replay on the oracle validation split (see ldlp/bench/harness/replay.py).

    python scripts/tune_policies.py
    python scripts/tune_policies.py grid.ddd.threshold=[-2,-4,-6] costs.check.enabled=false
    python scripts/tune_policies.py costs.table=FILE   # price steps by this cost table (scripts/profile_cost.py)
    python scripts/tune_policies.py costs.linear.step_ms=12 costs.linear.draft_ms=1.5   # a synthetic linear price
"""

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.cost import CostTable
from eagle_backbone.paths import REPO_ROOT
from ldlp.bench.harness.loaders import build_policy, cost_engine_factory, load_pair_cached, load_prompts, \
    policy_config, replay_costs, run_setup
from ldlp.bench.harness.replay import OracleRows, best_per_policy, costs_record, grid, tune
from ldlp.report.replay import tuning_markdown


def _builder(cfg: DictConfig, name: str):
    _, base = policy_config(cfg, f"policy={name}")
    return lambda params: build_policy(OmegaConf.merge(base, params), cfg.model)


def _check(cfg: DictConfig, pair, costs: CostTable) -> list[dict]:
    """The table's predicted step times at one slot against timed static-γ steps of the engine on validation
    prompts (:func:`eagle_backbone.cost.check_costs`): whether it ranks the γs as this machine does."""
    from eagle_backbone.cost import check_costs

    prompts = [ids for _, ids in load_prompts(cfg.data, pair.tokenizer)]
    factory = cost_engine_factory(pair.target, pair.candidates, capacity=None)
    return check_costs(costs, factory, prompts, slots=(1,), gammas=list(cfg.costs.check.gammas),
                       steps=int(cfg.costs.check.steps), max_new_tokens=int(cfg.costs.check.max_new_tokens))


@hydra.main(config_path="../conf", config_name="tune_policies", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    pair = load_pair_cached(cfg.model)
    costs = replay_costs(cfg.costs, cfg.model.name, pair, "tune_policies")
    check = _check(cfg, pair, costs) if cfg.costs.check.enabled and pair.candidates is not None else None
    rows = OracleRows.load(cfg.oracle_dir, cfg.split)
    policies = {name: (_builder(cfg, name), grid(OmegaConf.to_container(params))) for name, params in cfg.grid.items()}
    results = tune(rows, costs, policies, embed=pair.target.embed, vocab_size=pair.target.vocab_size,
                   oracle_cap=cfg.oracle_cap, progress=cfg.progress)
    oracle_dir = Path(cfg.oracle_dir)
    shown = oracle_dir.relative_to(REPO_ROOT) if oracle_dir.is_relative_to(REPO_ROOT) else oracle_dir
    where = f"{shown}, split {cfg.split}"
    md = tuning_markdown(results, costs, rows, where)
    if check:
        from ldlp.report.load_sweep import check_markdown

        md += ("\nThe cost table against timed static-γ steps of the engine at one slot (validation prompts):\n\n"
               + check_markdown(check))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tuning.md").write_text(md)
    # what it was tuned for: scripts/evaluate.py and compare.py refuse it (tuned_from=) for another model, dtype,
    # drafter kind or drafter weights (ldlp/bench/harness/loaders.py check_tuned)
    priced = costs_record(costs)
    made_for = {**run_setup(cfg.model, pair), "cost_key": priced.get("key")}
    record = {"made_for": made_for, "costs": priced, "results": results}
    if check is not None:
        record["cost_check"] = check  # the table beside timed engine steps, as a check
    (out / "tuning.json").write_text(json.dumps(record, indent=2))
    print(md.split("Every setting tried")[0])
    print("Best settings as overrides for scripts/evaluate.py:")
    for name, r in best_per_policy(results).items():
        if name not in ("static", "oracle"):
            print(f"  policy={name} " + " ".join(f"policy.{k}={v}" for k, v in r["params"].items()))
    print(f"wrote {out / 'tuning.md'}")


if __name__ == "__main__":
    main()
