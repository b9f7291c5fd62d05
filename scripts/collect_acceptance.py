"""Collect per-position acceptance labels: compose a config, call the library (see conf/collect_acceptance.yaml)."""

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.labels.acceptance_labels import collect_acceptance
from ldlp.report.labels import write_acceptance_labels_page


@hydra.main(config_path="../conf", config_name="collect_acceptance", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    report = collect_acceptance(cfg)
    page = write_acceptance_labels_page(cfg.out_dir, report)  # report.md, next to report.json
    beta = ", ".join("–" if b is None else f"{b:.2f}" for b in report["mean_beta_by_depth"])
    print(f"{report['positions']} positions from {report['sequences']} sequences at temperature "
          f"{report['temperature']}; mean beta by depth {beta} -> {page}")


if __name__ == "__main__":
    main()
