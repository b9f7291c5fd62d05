"""Pretrain the embedded target (or the standalone draft LM): compose a config, call the library."""

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.train.lm import run_lm_training


@hydra.main(config_path="../conf", config_name="train_lm", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    run_lm_training(cfg)


if __name__ == "__main__":
    main()
