"""Time a trained LDLP against a target decoding step (batch 1, the decoding-time path).

    python scripts/bench_ldlp.py                                   (data/ldlp/embedded vs. the embedded target)
    python scripts/bench_ldlp.py +experiment=vicuna                (the research pair, on its device)
"""

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.loading import load_target
from ldlp.models.policy_cost import HISTORY_FILE, benchmark_ldlp
from ldlp.models.predictor import LDLP


@hydra.main(config_path="../conf", config_name="bench_ldlp", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    target = load_target(cfg.model)
    ldlp = LDLP.from_pretrained(cfg.ldlp_path)
    history = Path(cfg.ldlp_path) / HISTORY_FILE  # compared with, and recorded for, the next measurement
    print(json.dumps(benchmark_ldlp(ldlp, target, context_len=int(cfg.context), reps=int(cfg.reps),
                                    history=history), indent=2))


if __name__ == "__main__":
    main()
