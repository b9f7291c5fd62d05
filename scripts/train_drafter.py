"""Train an EAGLE-1 drafter on a target's features (embedded pair by default, +experiment=vicuna for 7B), or with
``drafter=eagle3`` an EAGLE-3 head (training-time test on the target's own responses; docs/eagle3.md)."""

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.drafter_kinds import get_kind


@hydra.main(config_path="../conf", config_name="train_drafter", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    kind = cfg.drafter_training.get("kind", "eagle")
    print(get_kind(kind).train(cfg))  # the kind's own recipe (eagle_backbone/kinds/)


if __name__ == "__main__":
    main()
