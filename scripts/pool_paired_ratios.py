"""Paired ratios of every contender over a reference contender, pooled over several load-sweep folders
(scripts/bench_batch.py out_dir=...): compose a config, call the library.

    python scripts/pool_paired_ratios.py 'folders=[results/embedded/chunked_prefill/*]' reference=ar
"""

import glob
import os

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.io import atomic_write_text
from ldlp.bench.comparisons.pool import pooled_batch_ratios
from ldlp.report.headtohead import pooled_batch_markdown


@hydra.main(config_path="../conf", config_name="pool_paired_ratios", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg, loads_models=False)
    # a glob's folders (a literal name is kept as given, so a missing one is named)
    folders = sorted({f for pattern in cfg.folders
                      for f in ([g for g in glob.glob(pattern) if os.path.isdir(g)] or [pattern])})
    page = pooled_batch_markdown(pooled_batch_ratios(folders, str(cfg.reference)), str(cfg.reference))
    print(page, end="")
    if cfg.out:
        atomic_write_text(cfg.out, page)
        print(f"wrote {cfg.out}")


if __name__ == "__main__":
    main()
