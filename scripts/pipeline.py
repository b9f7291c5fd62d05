"""The main command: corpus -> oracle labels -> LDLP and acceptance head -> tuning -> sweeps -> head to head.

    python scripts/pipeline.py                 (the embedded pair on CPU; rerun to resume)
    python scripts/pipeline.py force=true      (redo the tuning and the sweeps)
    python scripts/pipeline.py publish=true    (copy the tables to results/<model> and README's block)
    python scripts/pipeline.py dry_run=true    (the plan: what would run and why)
"""

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.pipeline import run


@hydra.main(config_path="../conf", config_name="pipeline", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    hydra_cfg = HydraConfig.get()
    summary = run(cfg, model=hydra_cfg.runtime.choices.model, overrides=list(hydra_cfg.overrides.task))
    if summary is None:  # dry_run=true: the plan only
        return
    print()
    print(summary["markdown"])
    print(f"wrote {summary['md']}, {summary['csv']} and {summary['png']} in {summary['elapsed_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
