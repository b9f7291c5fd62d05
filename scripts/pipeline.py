"""The main command: oracle labels -> LDLP -> static and adaptive sweeps -> table and plot.

    python scripts/pipeline.py                 (the embedded pair on CPU; rerun to resume)
    python scripts/pipeline.py force=true      (redo the sweeps)
"""

import hydra
from omegaconf import DictConfig

import eagle_backbone.paths  # noqa: F401  (registers ${repo:...})
from ldlp.pipeline import run


@hydra.main(config_path="../conf", config_name="pipeline", version_base="1.3")
def main(cfg: DictConfig) -> None:
    summary = run(cfg)
    print()
    print(summary["markdown"])
    print(f"wrote {summary['md']}, {summary['csv']} and {summary['png']} in {summary['elapsed_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
