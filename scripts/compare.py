"""Head to head: policies timed in turns on every prompt, paired against the best static contender.

    python scripts/compare.py
    python scripts/compare.py 'contenders=["policy=static policy.gamma=6","policy=ldlp_ddd"]' rounds=8
    python scripts/compare.py contenders_from=FOLDER/contenders.json   (scripts/choose_contenders.py's choice)
"""

import json
from pathlib import Path

import hydra
from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from eagle_backbone.errors import ConfigError, accepted_mismatches
from eagle_backbone.io import atomic_write_json, atomic_write_text
from ldlp.bench.headtohead import head_to_head
from ldlp.report.headtohead import head_to_head_markdown
from ldlp.bench.loaders import policy_config
from ldlp.pipeline.processes import out_dir_lock


@hydra.main(config_path="../conf", config_name="compare", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    out = Path(cfg.out_dir or HydraConfig.get().runtime.output_dir)
    with out_dir_lock(out):  # one run at a time writes the folder
        contenders = [policy_config(cfg, str(c).split()) for c in _contenders(cfg)]
        result = head_to_head(cfg, contenders, int(cfg.rounds), int(cfg.bootstrap))
        result["accepted_mismatches"] = accepted_mismatches()  # accept_mismatch=true: what it let drive the run
        md = head_to_head_markdown(result)
        atomic_write_json(out / "head_to_head.json", result, default=str)
        atomic_write_text(out / "head_to_head.md", md)
    print(md)
    print(f"wrote {out / 'head_to_head.md'}")


def _contenders(cfg: DictConfig) -> list[str]:
    """``contenders``, or those of the file ``contenders_from`` names (its "contenders" list)."""
    if not cfg.get("contenders_from"):
        return [str(c) for c in cfg.contenders]
    path = Path(cfg.contenders_from)
    try:
        listed = json.loads(path.read_text())["contenders"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"contenders_from: {path} is no contenders file of scripts/choose_contenders.py "
                          f"({e})") from None
    if not isinstance(listed, list) or not listed:
        raise ConfigError(f"contenders_from: {path} lists no contenders")
    return [str(c) for c in listed]


if __name__ == "__main__":
    main()
