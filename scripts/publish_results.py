"""Publish the main command's last run into the committed results pages (see conf/publish_results.yaml).

    python scripts/publish_results.py
"""

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.paths import REPO_ROOT
from ldlp.report.publish import publish_run


@hydra.main(config_path="../conf", config_name="publish_results", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg, loads_models=False)
    # one complete set from one run of this model, or one error line before anything is copied
    for line in publish_run(cfg.results, cfg.published, REPO_ROOT / "README.md", None, str(cfg.model.name),
                            command="python scripts/publish_results.py"):
        print(line)


if __name__ == "__main__":
    main()
