"""The predictor study: compose a config, call the library (see conf/study_predictors.yaml)."""

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.bench.predictors import run_predictor_study


@hydra.main(config_path="../conf", config_name="study_predictors", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    page = run_predictor_study(cfg)
    print(page)


if __name__ == "__main__":
    main()
