"""The predictor study: compose a config, call the library (see conf/study_predictors.yaml)."""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.io import atomic_write_text
from ldlp.bench.comparisons.predictors import run_predictor_study
from ldlp.bench.comparisons.study_rows import oracle_dirs, require_collections
from ldlp.pipeline.processes import out_dir_lock
from ldlp.report.predictors import study_page
from ldlp.training.step_predictor import fit_step_history, fit_step_ldlp


@hydra.main(config_path="../conf", config_name="study_predictors", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    require_collections(cfg.oracle_dir, cfg.allow_partial)  # before any model loads
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with out_dir_lock(out):  # one study at a time writes the folder
        done = run_predictor_study(cfg, fitters={"ldlp": fit_step_ldlp, "gru": fit_step_history})
        page = study_page(done, " + ".join(oracle_dirs(cfg.oracle_dir)), out)
        atomic_write_text(out / "README.md", page)
    print(page)


if __name__ == "__main__":
    main()
