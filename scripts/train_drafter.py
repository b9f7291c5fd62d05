"""Train an EAGLE-1 drafter on a target's features (embedded pair by default, +experiment=vicuna for 7B), or with
``drafter=eagle3`` an EAGLE-3 head (training-time test on the target's own responses; docs/eagle3.md)."""

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.train.drafter import run_drafter_training
from eagle_backbone.train.eagle3 import run_eagle3_training


@hydra.main(config_path="../conf", config_name="train_drafter", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    kind = cfg.drafter_training.get("kind", "eagle")
    print(run_eagle3_training(cfg) if kind == "eagle3" else run_drafter_training(cfg))


if __name__ == "__main__":
    main()
