"""Drafters head to head: EAGLE-1 and EAGLE-3 (or any drafters of one target) in turns, paired τ and tokens/s.

    python scripts/bench_drafters.py model.dtype=float32 out_dir=results/embedded/eagle3/drafters
"""

from pathlib import Path

import hydra
from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from eagle_backbone.io import atomic_write_json, atomic_write_text
from ldlp.bench.peers.drafters import bench_drafters
from ldlp.report.drafters import drafters_markdown
from ldlp.pipeline.processes import out_dir_lock


@hydra.main(config_path="../conf", config_name="bench_drafters", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    out = Path(cfg.out_dir or HydraConfig.get().runtime.output_dir)
    with out_dir_lock(out):  # one run at a time writes the folder
        result = bench_drafters(cfg)
        atomic_write_json(out / "drafters.json", result, default=str)  # the measurements first: a page can be remade
        md = drafters_markdown(result)
        atomic_write_text(out / "drafters.md", md)
    print(md)
    print(f"wrote {out / 'drafters.md'}")


if __name__ == "__main__":
    main()
