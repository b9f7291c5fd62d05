"""Evaluate one draft-length policy on one prompt set (a Hydra app; -m sweeps several).

    python scripts/evaluate.py policy=ldlp data.limit=10
    python scripts/evaluate.py -m policy=static policy.gamma=1,2,3,4,5,6,7,8
    python scripts/evaluate.py model=embedded_draft_lm peer=hf_heuristic   (transformers' assisted generation)
"""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.errors import ConfigError
from ldlp.bench.harness.contender import flat_pricing_args, peer_alias
from ldlp.bench.comparisons.evaluate import evaluate, one_line
from ldlp.report.categories import write_categories


@hydra.main(config_path="../conf", config_name="evaluate", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    hc = HydraConfig.get()
    name = hc.runtime.choices.get("peer") or hc.runtime.choices.get("policy")  # a peer runs instead of the policy
    result = evaluate(cfg, policy_name=name, out_dir=hc.runtime.output_dir)
    print(one_line(result), flush=True)
    if write_categories(result, hc.runtime.output_dir):  # two categories or more: the per-category table
        print(open(result["categories_md"], encoding="utf-8").read(), flush=True)


if __name__ == "__main__":
    try:  # the peers' old spelling (policy=hf_heuristic, when they lived in conf/policy/) read as peer=hf_heuristic,
        # and a pricing key written flat (policy.online_costs=false) as the pricing node's
        sys.argv = flat_pricing_args(peer_alias(sys.argv))
    except ConfigError as e:
        sys.exit(f"error: {e}")
    main()
