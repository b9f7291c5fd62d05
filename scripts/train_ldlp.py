"""Train the Lightweight Draft Length Predictor on oracle labels: compose a config, call the library.

    python scripts/train_ldlp.py +experiment=tiny
    python scripts/train_ldlp.py +experiment=vicuna --cfg job     (print the research configuration)
"""

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.report.training import write_ldlp_metrics
from ldlp.training.predictor import run_ldlp_training


@hydra.main(config_path="../conf", config_name="train_ldlp", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    summary = run_ldlp_training(cfg)
    if summary is not None:  # the global-zero process: metrics.md next to metrics.json
        print(write_ldlp_metrics(cfg.ldlp_training.out_dir, summary))


if __name__ == "__main__":
    main()
