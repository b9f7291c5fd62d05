"""Collect oracle draft-length labels: compose a config, call the library (see conf/collect_oracle.yaml)."""

import hydra
from omegaconf import DictConfig

import _setup
from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.labels.collect import collect_oracle
from ldlp.report.labels import write_oracle_page

try:  # a launcher (conf/launcher/: submitit, SLURM) runs main() in a process where scripts/ is not importable:
    import cloudpickle  # send scripts/_setup.py's code with the job instead of its module name

    cloudpickle.register_pickle_by_value(_setup)
except (ImportError, AttributeError):
    pass


@hydra.main(config_path="../conf", config_name="collect_oracle", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    report = collect_oracle(cfg)
    page = write_oracle_page(cfg.out_dir, report)  # report.md, next to report.json
    print(f"{report['positions']} positions from {report['sequences']} sequences; mean label "
          f"{report['mean_label']:.3f}, {report['frac_at_k_max']:.1%} at k_max={report['k_max']}; "
          f"{report['positions_per_s']:.1f} positions/s -> {page}")


if __name__ == "__main__":
    main()
