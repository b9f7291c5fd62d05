"""Train the shipped draft-length predictor: compose a config, call the library (see conf/train_step_ldlp.yaml)."""

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.training.step_predictor import build_step_ldlp


@hydra.main(config_path="../conf", config_name="train_step_ldlp", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    start(cfg)
    out = build_step_ldlp(cfg, command=" ".join(["python scripts/train_step_ldlp.py", *HydraConfig.get().overrides.task]))
    v = out["validation"]
    print(f"{out['train_examples']} training steps; validation MAE {v['mae']:.3f}, AUC {v['auc_mean']:.3f} (first "
          f"draft {v['auc_1']:.3f}); a token is worth {out['token_ratio']:.3f} plain steps -> {out['out_dir']}")


if __name__ == "__main__":
    main()
