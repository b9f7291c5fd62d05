"""Pool head-to-head runs of the same contenders into one table: compose a config, call the library.

    python scripts/pool_head_to_head.py
    python scripts/pool_head_to_head.py 'runs=[outputs/compare/*]' out_dir=outputs/pooled
"""

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.paths import repo_path
from ldlp.bench.comparisons.pool import pool_folders
from ldlp.report.headtohead import pooled_markdown, write_pooled
from ldlp.report.pages import publish_pooled


@hydra.main(config_path="../conf", config_name="pool_head_to_head", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg, loads_models=False)
    pooled = pool_folders(list(cfg.runs), cfg.out_dir, int(cfg.bootstrap), int(cfg.seed))
    print(pooled_markdown(pooled))
    print(f"wrote {write_pooled(cfg.out_dir, pooled)}")
    if cfg.update_readme:
        readme = repo_path("docs/evaluation.md")  # the pooled block lives on the evaluation page
        if not publish_pooled(readme, pooled, cfg.out_dir, "python scripts/pool_head_to_head.py update_readme=true"):
            print(f"{readme} has no <!-- head_to_head_long:start --> ... <!-- head_to_head_long:end --> block: left as is")


if __name__ == "__main__":
    main()
