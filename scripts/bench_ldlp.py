"""Time a trained LDLP against a target decoding step (batch 1, the decoding-time path).

    python scripts/bench_ldlp.py                                   (data/ldlp/embedded vs. the embedded target)
    python scripts/bench_ldlp.py +experiment=vicuna                (the research pair, on its device)
"""

import json

import hydra
from omegaconf import DictConfig

import eagle_backbone.paths  # noqa: F401  (registers ${repo:...})
from eagle_backbone.loading import load_target
from ldlp.policy_cost import benchmark_ldlp
from ldlp.predictor import LDLP


@hydra.main(config_path="../conf", config_name="train_ldlp", version_base="1.3")
def main(cfg: DictConfig) -> None:
    target = load_target(cfg.model)
    ldlp = LDLP.from_pretrained(cfg.ldlp_training.out_dir)
    ev = cfg.ldlp_training.evaluation
    print(json.dumps(benchmark_ldlp(ldlp, target, context_len=ev.benchmark_context, reps=ev.benchmark_reps),
                     indent=2))


if __name__ == "__main__":
    main()
