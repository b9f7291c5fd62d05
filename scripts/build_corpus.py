"""Build the embedded conversation corpus from the running Python's standard library."""

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.data.corpus import CorpusConfig, write_corpus


@hydra.main(config_path="../conf", config_name="build_corpus", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    manifest = write_corpus(cfg.out_dir, CorpusConfig(seed=cfg.seed, max_modules=cfg.max_modules))
    print(manifest)


if __name__ == "__main__":
    main()
