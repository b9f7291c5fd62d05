"""Batched speculative decoding against concurrency: batched AR, static γ and adaptive policies.

    python scripts/bench_batch.py
    python scripts/bench_batch.py concurrency=[1,4,16] 'contenders=["policy=static policy.gamma=3"]' rounds=1
    python scripts/bench_batch.py 'temperatures=[0.0,0.7,1.0]' blocks=4 data.limit=128   (the load sweep, docs/batched.md)
"""

import logging
from pathlib import Path

import hydra
from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from omegaconf import DictConfig

log = logging.getLogger("bench_batch")


@hydra.main(config_path="../conf", config_name="bench_batch", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    from eagle_backbone.batched.bench import Contender, check_sweep_args, sweep, write
    from eagle_backbone.candidates import make_candidates
    from ldlp.bench.conversation import prompt_categories
    from ldlp.bench.loaders import (
        build_policy,
        load_pair_cached,
        load_prompts,
        machine_info,
        policy_config,
        sampling_config,
    )

    threads = start(cfg)
    # None: the generation's temperature alone
    temperatures = check_sweep_args([int(c) for c in cfg.concurrency], cfg.get("temperatures"), int(cfg.blocks))
    pair = load_pair_cached(cfg.model)
    prompt_set = load_prompts(cfg.data, pair.tokenizer)
    prompts = [ids for _, ids in prompt_set]
    categories = prompt_categories(cfg.data, [pid for pid, _ in prompt_set])  # None where the file has none
    contenders = [Contender("ar", "ar", 0, None)]
    for spec in cfg.contenders:
        name, pcfg = policy_config(cfg, str(spec).split())
        try:
            probe = build_policy(pcfg)
        except (ValueError, InstantiationException) as e:  # a checkpoint this clone has not trained yet
            why = [line for line in str(e).splitlines() if "ValueError" in line] or str(e).splitlines()[:1]
            log.warning("skipping %s: %s", spec, why[0].strip())
            continue
        gamma = getattr(probe, "fixed_gamma", None) if not getattr(probe, "adaptive", True) else None
        label = f"static γ={gamma}" if gamma is not None else name
        contenders.append(Contender(label, name, gamma, lambda pcfg=pcfg: build_policy(pcfg)))
    out = cfg.out_dir or HydraConfig.get().runtime.output_dir
    meta = {"model": cfg.model.name, "dtype": cfg.model.dtype, "attn": cfg.attn, "drafter": cfg.model.drafter_kind,
            "prompts": len(prompts), "max_new_tokens": int(cfg.generation.max_new_tokens), "rounds": int(cfg.rounds),
            "blocks": int(cfg.blocks), "temperatures": temperatures or [float(cfg.generation.get("temperature", 0.0))],
            "threads": threads, "cpu": machine_info().get("cpu")}
    # the pair's candidate generator, its drafter on the benchmark's attention math (as the target's in the engine)
    candidates = pair.candidates
    if getattr(candidates, "attn", str(cfg.attn)) != str(cfg.attn):
        candidates = make_candidates(candidates.kind, pair.drafter, pair.target, str(cfg.attn))
    result = sweep(pair.target, candidates, prompts, contenders,
                   [int(c) for c in cfg.concurrency], int(cfg.generation.max_new_tokens), sampling_config(cfg.generation),
                   rounds=int(cfg.rounds), seed=int(cfg.seed), attn=str(cfg.attn),
                   checkpoint=lambda r: write(r, out, meta, with_plot=False), log=log.info,
                   categories=categories, temperatures=temperatures, blocks=int(cfg.blocks),
                   bootstrap=int(cfg.bootstrap))
    write(result, out, meta)
    print(Path(out, "batch_bench.md").read_text())
    print(f"wrote {out}/batch_bench.json, batch_bench_runs.json, batch_bench.md, batch_bench.png, batch_bench_ratio.png")


if __name__ == "__main__":
    main()
