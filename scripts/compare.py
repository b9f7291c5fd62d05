"""Head to head: policies timed in turns on every prompt, paired against the best static contender.

    python scripts/compare.py
    python scripts/compare.py 'contenders=["policy=static policy.gamma=6","policy=ldlp_ddd"]' rounds=8
    python scripts/compare.py 'contenders=[{policy:{name:static,gamma:6}},{policy:{name:ldlp_ddd}}]'   (the same)
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
from ldlp.bench.harness.contender import parse_contender
from ldlp.bench.comparisons.headtohead import head_to_head
from ldlp.report.headtohead import head_to_head_markdown
from ldlp.bench.harness.loaders import policy_config
from ldlp.pipeline.processes import out_dir_lock


@hydra.main(config_path="../conf", config_name="compare", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    out = Path(cfg.out_dir or HydraConfig.get().runtime.output_dir)
    specs = [_batch_one(c) for c in _contenders(cfg)]  # every contender read and checked before anything loads
    with out_dir_lock(out):  # one run at a time writes the folder
        contenders = [policy_config(cfg, spec) for spec in specs]
        result = head_to_head(cfg, contenders, int(cfg.rounds), int(cfg.bootstrap))
        result["accepted_mismatches"] = accepted_mismatches()  # accept_mismatch=true: what it let drive the run
        md = head_to_head_markdown(result)
        atomic_write_json(out / "head_to_head.json", result, default=str)
        atomic_write_text(out / "head_to_head.md", md)
    print(md)
    print(f"wrote {out / 'head_to_head.md'}")


def _batch_one(spec):
    """A policy contender as it runs here, at batch 1 on this engine: engine settings or a peer engine are refused."""
    if spec.peer is not None or spec.engine or spec.policy is None:
        raise ConfigError(f"contender {str(spec)!r}: the head to head times policies of this engine at batch 1; give "
                          "policy=NAME [policy.KEY=VALUE ...] (engine settings and peers: scripts/bench_batch.py)")
    return spec


def _contenders(cfg: DictConfig) -> list:
    """``contenders``, or those of the file ``contenders_from`` names (its "contenders" list), each read by the one
    contender parser (a string or a node: ldlp/bench/harness/contender.py) before anything loads."""
    if not cfg.get("contenders_from"):
        return [parse_contender(c) for c in cfg.contenders]
    path = Path(cfg.contenders_from)
    try:
        listed = json.loads(path.read_text())["contenders"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"contenders_from: {path} is no contenders file of scripts/choose_contenders.py "
                          f"({e})") from None
    if not isinstance(listed, list) or not listed:
        raise ConfigError(f"contenders_from: {path} lists no contenders")
    return [parse_contender(c, f"contenders_from: {path}: contender") for c in listed]


if __name__ == "__main__":
    main()
