"""Two measurements of the engine (ldlp/bench/measurements/engine_profile.py): a new prompt's prefill joined to the
step's target forward against its own forward, and a profiled breakdown of static γ per component.

    python scripts/profile_engine.py out_dir=results/embedded/batch_bench
"""

import hydra
from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from omegaconf import DictConfig


@hydra.main(config_path="../conf", config_name="profile_engine", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    from pathlib import Path

    import torch

    from eagle_backbone.io import atomic_write_json
    from eagle_backbone.policy import StaticPolicy
    from ldlp.bench.measurements.engine_profile import prefill_join_cost, profile_components
    from ldlp.bench.harness.loaders import load_pair_cached

    start(cfg)
    out = Path(cfg.out_dir)
    pair = load_pair_cached(cfg.model)
    join = {f"prompt_len={n}": prefill_join_cost(pair.target, tuple(cfg.join_concurrency), prompt_len=int(n))
            for n in cfg.prompt_lens}
    atomic_write_json(out / "prefill_join.json", join)
    for n, rows in join.items():
        for r in rows:
            print(n, f"C={r['concurrency']:>2} separate {r['separate_ms']:.1f} ms, joined {r['joined_ms']:.1f} ms "
                     f"({r['joined_over_separate']:.2f}x)")
    g = torch.Generator().manual_seed(int(cfg.seed))
    prompts = [torch.randint(4, pair.target.vocab_size, (int(cfg.profile.prompt_len),), generator=g).tolist()
               for _ in range(int(cfg.profile.prompts))]
    gamma = int(cfg.profile.gamma)
    prof = profile_components(pair.target, pair.candidates, prompts, lambda: StaticPolicy(gamma),
                              concurrency=tuple(cfg.profile.concurrency), max_new_tokens=int(cfg.profile.max_new_tokens),
                              attn=str(cfg.attn))
    atomic_write_json(out / "profile.json", prof)
    for r in prof:
        print(f"C={r['concurrency']}: " + ", ".join(f"{k} {v:.0%}" for k, v in r["share"].items()))


if __name__ == "__main__":
    main()
