"""Head to head: policies timed in turns on every prompt, paired against the best static contender.

    python scripts/compare.py
    python scripts/compare.py 'contenders=["policy=static policy.gamma=6","policy=ldlp_ddd"]' rounds=8
"""

import json
from pathlib import Path

import hydra
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import eagle_backbone.paths  # noqa: F401  (registers ${repo:...})
from ldlp.headtohead import head_to_head, markdown


def _contender(cfg: DictConfig, spec: str):
    overrides = str(spec).split()
    names = [o.split("=", 1)[1] for o in overrides if o.startswith("policy=")]
    if len(names) != 1:
        raise ValueError(f"contender {overrides}: give exactly one policy=NAME (a file under conf/policy/)")
    paths = [f"ldlp_path={cfg.ldlp_path}", f"ldlp_survival_path={cfg.ldlp_survival_path}",
             f"acceptance_path={cfg.acceptance_path}"]
    return names[0], compose(config_name="evaluate", overrides=list(overrides) + paths).policy


@hydra.main(config_path="../conf", config_name="compare", version_base="1.3")
def main(cfg: DictConfig) -> None:
    import torch

    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    contenders = [_contender(cfg, c) for c in cfg.contenders]
    result = head_to_head(cfg, contenders, int(cfg.rounds), int(cfg.bootstrap))
    out = Path(cfg.out_dir or HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(result)
    (out / "head_to_head.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "head_to_head.md").write_text(md)
    print(md)
    print(f"wrote {out / 'head_to_head.md'}")


if __name__ == "__main__":
    main()
