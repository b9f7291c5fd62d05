"""The in-step policy's starting weights: compose a config, call the library (see conf/fit_in_step.yaml)."""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.io import atomic_write_json
from eagle_backbone.loading import load_pair
from ldlp.bench.comparisons.study_rows import load_split, oracle_dirs, require_collections
from ldlp.policies.threshold import load_ldlp
from ldlp.training.in_step import fit_in_step


@hydra.main(config_path="../conf", config_name="fit_in_step", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    require_collections(cfg.oracle_dir, False)  # before any model loads
    predictor = load_ldlp(cfg.predictor)
    pair = load_pair(cfg.model)
    rows = load_split(cfg.oracle_dir, cfg.split, None)
    fit = fit_in_step(rows, predictor, pair.target.embed)
    fit["fitted_on"] = {"oracle_dir": oracle_dirs(cfg.oracle_dir), "split": cfg.split}
    out = Path(cfg.out_file)
    atomic_write_json(out, fit, indent=1)
    for name, s in fit["scores"].items():
        print(f"{name:24s} log-loss {s['log_loss']:.4f}  AUC {s['auc']:.4f}")
    print(f"prior {fit['prior']}  drafted {fit['drafted']}  ({fit['events']} events) -> {out}")


if __name__ == "__main__":
    main()
