"""The engine at real prompt lengths: attention routes and batched AR's scaling with its prefill share.

    python scripts/bench_attention.py long_path=../shared/data/sharegpt_v3_500/ShareGPT_V3_filtered_500.json
    python scripts/bench_attention.py --help
"""

import logging
import shlex
import sys
from pathlib import Path

import hydra
from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("bench_attention")


@hydra.main(config_path="../conf", config_name="bench_attention", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    from eagle_backbone.llama import BatchedLlama
    from eagle_backbone.io import atomic_write_json, atomic_write_text
    from eagle_backbone.loading import load_target
    from eagle_backbone.runtime import resolve_dtype
    from ldlp.bench.measurements.attention import attention_routes, elementwise_kernels, engine_scaling, linear_kernels
    from ldlp.report.engine import attention_markdown as markdown
    from ldlp.bench.harness.loaders import load_tokenizer_cached, machine_info, short_and_long_prompts

    from eagle_backbone.runtime import int_list_setting, int_setting

    threads = start(cfg)
    where = "conf/bench_attention.yaml"  # every setting before a model loads: one line naming the key
    int_setting("reps", cfg.reps, 1, where)
    int_setting("kernel_reps", cfg.kernel_reps, 1, where)
    int_setting("max_new_tokens", cfg.max_new_tokens, 1, where)
    int_setting("prompts", cfg.prompts, 1, where)
    int_list_setting("slots", cfg.slots, 1, where)
    int_list_setting("concurrency", cfg.concurrency, 1, where)
    if not list(cfg.dtypes or []):
        raise ValueError(f"dtypes is empty; give at least one, e.g. dtypes=[float32] ({where})")
    for dtype in cfg.dtypes:
        resolve_dtype(str(dtype))
    sets = short_and_long_prompts(cfg, "bench_attention", load_tokenizer_cached(cfg.model))
    model = OmegaConf.to_container(cfg.model, resolve=True)
    empty = [name for name, ps in sets.items() if not ps]
    if empty:
        raise ValueError(f"no prompts in the {', '.join(empty)} set(s) (prompts={cfg.prompts}, long_path="
                         f"{cfg.long_path}): give a data file with prompts the target's context holds")
    routes, linear, elementwise = [], [], []
    for dtype in cfg.dtypes:
        target = load_target({**model, "dtype": dtype})
        lm = BatchedLlama(target.model, max(len(p) for ps in sets.values() for p in ps) + cfg.max_new_tokens + 2)
        linear.append({"dtype": dtype, "rows": linear_kernels(lm, reps=cfg.kernel_reps, seed=cfg.seed)})
        elementwise.append({"dtype": dtype, **elementwise_kernels(lm, reps=cfg.kernel_reps, seed=cfg.seed,
                                                                  compile=cfg.compile)})
        for name, ps in sets.items():
            lengths = [len(p) + cfg.max_new_tokens // 2 for p in ps]  # mid-generation contexts
            log.info("routes: %s, %s", dtype, name)
            routes.append({"dtype": dtype, "set": name, "rows": attention_routes(lm, lengths, tuple(cfg.slots), cfg.reps,
                                                                                  cfg.seed)})
    target = load_target(model)
    scaling = []
    for name, ps in sets.items():
        log.info("scaling: %s", name)
        scaling.append({"set": name, "mean_prompt_tokens": sum(map(len, ps)) / len(ps),
                        "rows": engine_scaling(target, ps, tuple(cfg.concurrency), cfg.max_new_tokens)})
    meta = {"model": cfg.model.name, "dtype": str(resolve_dtype(cfg.model.dtype, cfg.model.device)).replace("torch.", ""),
            "threads": threads, "max_new_tokens": cfg.max_new_tokens, "prompts": cfg.prompts, "machine": machine_info(),
            "command": "python scripts/bench_attention.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    result = {"meta": meta, "routes": routes, "linear": linear, "elementwise": elementwise, "scaling": scaling}
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "attention.json", result, indent=2)
    atomic_write_text(out / "attention.md", markdown(result))
    print(markdown(result))
    log.info("wrote %s and %s", out / "attention.json", out / "attention.md")


if __name__ == "__main__":
    main()
