"""This engine against the engine of an earlier commit, batched, on the same prompts in turns.

    python scripts/bench_engine_ref.py ref=5f7644e long_path=../shared/data/sharegpt_v3_500/ShareGPT_V3_filtered_500.json
"""

import shlex
import sys
from pathlib import Path

import hydra
from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from omegaconf import DictConfig


@hydra.main(config_path="../conf", config_name="bench_engine_ref", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    from eagle_backbone.io import atomic_write_json, atomic_write_text
    from ldlp.bench.measurements.at_ref import compare
    from ldlp.report.engine import at_ref_markdown as markdown
    from ldlp.bench.harness.loaders import load_pair_cached, load_tokenizer_cached, machine_info, short_and_long_prompts

    from eagle_backbone.runtime import int_list_setting, int_setting

    threads = start(cfg)
    where = "conf/bench_engine_ref.yaml"  # every setting before a model loads: one line naming the key
    int_list_setting("concurrency", cfg.concurrency, 1, where)
    int_list_setting("gammas", cfg.gammas, 0, where)
    for key in ("rounds", "prompts", "max_new_tokens", "bootstrap"):
        int_setting(key, cfg[key], 1, where)
    if not str(cfg.ref or "").strip():
        raise ValueError(f"ref is empty; give the commit to compare against, e.g. ref=5f7644e ({where})")
    sets = short_and_long_prompts(cfg, "bench_engine_ref", load_tokenizer_cached(cfg.model))
    pair = load_pair_cached(cfg.model)
    rows = compare(pair, sets, cfg.ref, tuple(cfg.concurrency), tuple(cfg.gammas), cfg.rounds, cfg.max_new_tokens,
                   cfg.bootstrap, cfg.seed)
    machine = machine_info()
    meta = {"ref": cfg.ref, "model": cfg.model.name, "dtype": str(pair.target.dtype).replace("torch.", ""),
            "threads": threads, "cpu": machine["cpu"], "max_new_tokens": cfg.max_new_tokens, "rounds": cfg.rounds,
            "prompts": {k: len(v) for k, v in sets.items()}, "machine": machine,
            "command": "python scripts/bench_engine_ref.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "engine_ref.json", {"meta": meta, "rows": rows}, indent=2)
    atomic_write_text(out / "engine_ref.md", markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
