"""Replay beside a head to head: compose a config, call the library (see conf/replay_vs_measured.yaml)."""

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.cost import CostTable
from eagle_backbone.io import atomic_write_json, atomic_write_text
from eagle_backbone.loading import load_pair
from ldlp.bench.harness.loaders import replay_costs
from ldlp.bench.harness.replay import OracleRows
from ldlp.bench.comparisons.replay_beside import replay_beside_measured
from ldlp.report.predictors import beside_markdown


@hydra.main(config_path="../conf", config_name="replay_vs_measured", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    path = Path(cfg.head_to_head)
    if not path.is_file():
        raise ValueError(f"head_to_head={path}: no such file (a head_to_head.json of scripts/compare.py)")
    h2h = json.loads(path.read_text())
    pair = load_pair(cfg.model)
    rows = OracleRows.load(cfg.oracle_dir, split=None, with_features=True)
    fit = h2h["costs"]  # the run's own linear fit of its timed generations
    costs = {"cost table": replay_costs(cfg.costs, cfg.model.name, pair, "replay_vs_measured"),
             "linear fit of the run": CostTable.linear(fit["step_ms"], fit["draft_ms"], fit["accepted_ms"])}
    entries = replay_beside_measured(h2h, rows, costs, pair.target.embed, pair.target.vocab_size, cfg.learned_path)
    md = beside_markdown(entries, list(costs), h2h, str(path.parent))
    atomic_write_json(path.parent / "replay_vs_measured.json", entries)
    atomic_write_text(path.parent / "replay_vs_measured.md", md)
    print(md)


if __name__ == "__main__":
    main()
