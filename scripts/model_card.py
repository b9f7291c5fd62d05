"""Measure the embedded models and (re)write data/embedded/MODEL_CARD.md from the figures."""

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.bench.measurements.model_card import build_model_card
from ldlp.report.model_card import write_card


@hydra.main(config_path="../conf", config_name="model_card", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    card = build_model_card(cfg)  # measured: model_card.json
    print(write_card(cfg.embedded_dir, card).read_text())
    return card


if __name__ == "__main__":
    main()
