"""Train an EAGLE-1 drafter on a target's features (embedded pair by default, +experiment=vicuna for 7B)."""

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.train.drafter import run_drafter_training


@hydra.main(config_path="../conf", config_name="train_drafter", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    print(run_drafter_training(cfg))


if __name__ == "__main__":
    main()
