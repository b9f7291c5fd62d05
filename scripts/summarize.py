"""Summarize evaluation runs: results.md, results.csv, tokens_per_s.png (and summary.json)."""

import hydra
from omegaconf import DictConfig, ListConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.report.summary import summarize


@hydra.main(config_path="../conf", config_name="summarize", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    runs = list(cfg.runs) if isinstance(cfg.runs, ListConfig) else [cfg.runs]
    out = summarize(runs, cfg.out_dir or runs[0], title=cfg.title)
    if cfg.print_table:
        print(out["markdown"])
    print(f"wrote {out['md']}, {out['csv']}, {out['png']}")


if __name__ == "__main__":
    main()
