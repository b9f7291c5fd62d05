"""Choose the head to head's contenders from the sweeps' rows and the replay tuning (the main command's contenders
stage); scripts/compare.py contenders_from=<out_dir>/contenders.json times them.

    python scripts/choose_contenders.py 'sweep.dirs=[outputs/pipeline/embedded/round-1/static,...]' out_dir=FOLDER
"""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.io import atomic_write_json
from ldlp.pipeline.contenders import CONTENDERS, choose


@hydra.main(config_path="../conf", config_name="choose_contenders", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg, loads_models=False)
    chosen = choose(cfg, list(cfg.sweep.dirs), cfg.tuned_from, str(cfg.model.name))
    out = Path(cfg.out_dir)
    atomic_write_json(out / CONTENDERS, chosen)  # the choice alone (no times): the same choice is the same file
    print(f"contenders of {chosen['model']}: {', '.join(chosen['contenders'])} -> {out / CONTENDERS}")


if __name__ == "__main__":
    main()
