"""Train the shipped draft-length predictor: compose a config, call the library (see conf/train_step_ldlp.yaml).

Three calls, across the layers: record the examples by replay (ldlp.bench), fit the LDLP with Lightning
(ldlp.training), calibrate and score it by replay (ldlp.bench)."""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.loading import load_pair
from ldlp.bench.harness.loaders import replay_costs
from ldlp.bench.comparisons.predictors import predictor_examples, shipped_meta
from ldlp.bench.comparisons.study_rows import require_collections
from ldlp.training.step_predictor import fit_step_ldlp


@hydra.main(config_path="../conf", config_name="train_step_ldlp", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    collections = require_collections(cfg.oracle_dir, cfg.allow_partial)  # before any model loads
    pair = load_pair(cfg.model)
    costs = replay_costs(cfg.costs, cfg.model.name, pair, "train_step_ldlp")
    tr, va, train = predictor_examples(cfg, pair, costs)
    ldlp = fit_step_ldlp(tr.x, tr.label, tr.seq, list(cfg.groups), int(cfg.K), int(cfg.seed), hidden_dim=int(cfg.hidden_dim),
                         num_layers=int(cfg.num_layers), max_epochs=int(cfg.max_epochs), batch_size=int(cfg.batch_size),
                         lr=float(cfg.lr))
    command = " ".join(["python scripts/train_step_ldlp.py", *HydraConfig.get().overrides.task])
    ldlp.config.meta = meta = {**shipped_meta(cfg, ldlp, tr, va, train, costs, pair, command), "collections": collections}
    ldlp.save_pretrained(Path(cfg.out_dir))
    v = meta["validation"]
    print(f"{meta['train_examples']} training steps; validation MAE {v['mae']:.3f}, AUC {v['auc_mean']:.3f} (first "
          f"draft {v['auc_1']:.3f}); a token is worth {meta['token_ratio']:.3f} plain steps -> {cfg.out_dir}")


if __name__ == "__main__":
    main()
