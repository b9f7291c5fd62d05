"""The EAGLE-3 head's learning curve page (curve.md, curve.png) from the curve.jsonl its training wrote.

    python scripts/eagle3_curve.py curve=data/embedded/work/eagle3/curve.jsonl out_dir=results/embedded/eagle3/curve
"""

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.report.eagle3_curve import write_curve_page


@hydra.main(config_path="../conf", config_name="eagle3_curve", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    out = write_curve_page(cfg.curve, cfg.out_dir, cfg.title, int(cfg.offset_tokens))
    print(out["markdown"])
    print(f"wrote {out['md']}, {out['png']}")


if __name__ == "__main__":
    main()
