"""How often the target keeps the drafter's first, second, third... choice, by depth (docs/trees.md).

    python scripts/bench_tree_ranks.py model.dtype=float32 out=results/embedded/trees/choice_rates.json
"""

import logging

import hydra
from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from omegaconf import DictConfig

log = logging.getLogger("bench_tree_ranks")


@hydra.main(config_path="../conf", config_name="bench_tree_ranks", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    from eagle_backbone.io import atomic_write_json
    from ldlp.bench.harness.loaders import load_pair_cached, load_prompts, load_tokenizer_cached, sampling_config
    from ldlp.bench.measurements.tree_ranks import choice_rates
    from ldlp.report.engine import tree_ranks_markdown

    start(cfg)
    prompts = [ids for _, ids in load_prompts(cfg.data, load_tokenizer_cached(cfg.model))]
    pair = load_pair_cached(cfg.model)
    out = choice_rates(pair.target, pair.candidates, prompts, int(cfg.top_k), int(cfg.depth),
                       int(cfg.generation.max_new_tokens), int(cfg.slots), sampling_config(cfg.generation))
    out["meta"] = {"model": cfg.model.name, "dtype": str(pair.target.dtype), "data": cfg.data.name,
                   "temperature": float(cfg.generation.temperature)}
    print(tree_ranks_markdown(out))
    if cfg.out:
        atomic_write_json(cfg.out, out)
        log.info("wrote %s", cfg.out)


if __name__ == "__main__":
    main()
