"""Measure the embedded models and (re)write data/embedded/MODEL_CARD.md from the figures."""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.bench.measurements.model_card import build_model_card, update_eagle3_sets
from ldlp.report.model_card import write_card


def eagle3_head_to_head(cfg: DictConfig) -> dict:
    """scripts/bench_drafters.py's run on the card's folders (the shipped EAGLE-1 drafter and EAGLE-3 head, the
    corpus's test split beside the shared MT-bench and ShareGPT prompts) with ``eagle3_sets.overrides``."""
    from ldlp.bench.peers.drafters import bench_drafters
    from ldlp.pipeline.compose import compose

    root = Path(cfg.embedded_dir)
    folders = [f"model.target={root / 'target'}", f"model.tokenizer={root / 'target'}",
               f"drafters.eagle1.drafter={root / 'drafter'}", f"drafters.eagle3.drafter={root / 'eagle3'}",
               f"prompt_sets.embedded_test.path={Path(cfg.corpus_dir) / 'test.json'}",
               f"threads={'null' if cfg.get('threads') is None else int(cfg.threads)}"]
    return bench_drafters(compose("bench_drafters", folders + list(cfg.eagle3_sets.overrides)))


@hydra.main(config_path="../conf", config_name="model_card", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    only = cfg.get("only")
    card = None if only == "eagle3_sets" else build_model_card(cfg)  # measured: model_card.json
    if only == "eagle3_sets" or (only in (None, "eagle3") and card.get("eagle3")):  # τ on each prompt set
        card = update_eagle3_sets(cfg, eagle3_head_to_head)
    print(write_card(cfg.embedded_dir, card).read_text())
    return card


if __name__ == "__main__":
    main()
