"""Train the acceptance head on oracle rows with drafter states: compose a config, call the library.

    python scripts/train_acceptance.py
"""

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.report.training import write_acceptance_head_metrics
from ldlp.training.acceptance import train_acceptance_head


@hydra.main(config_path="../conf", config_name="train_acceptance", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    metrics = train_acceptance_head(cfg)
    print(write_acceptance_head_metrics(cfg.out_dir, metrics))  # metrics.md next to metrics.json
    print(f"wrote {cfg.out_dir} in {metrics['seconds']} s")


if __name__ == "__main__":
    main()
