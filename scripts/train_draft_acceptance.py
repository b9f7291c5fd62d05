"""Train the per-position acceptance heads and report their calibration: compose a config, call the library.

    python scripts/train_draft_acceptance.py
"""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.report.calibration import write_draft_acceptance_report
from ldlp.training.draft_acceptance import check_inputs, train_at_temperature


@hydra.main(config_path="../conf", config_name="train_draft_acceptance", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    check_inputs(cfg)  # every temperature's labels first: no head is written for a run that cannot finish
    results = [train_at_temperature(cfg, float(t)) for t in cfg.temperatures]
    write_draft_acceptance_report(results, cfg.out_root, int(cfg.n_bins))
    print((Path(cfg.out_root) / "calibration.md").read_text())


if __name__ == "__main__":
    main()
