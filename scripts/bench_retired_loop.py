"""The engine at batch 1 against the batch-1 loop it replaced (issue 15: "no slower than today's engine").

The old loop (``eagle_backbone/engine.py``, ``candidates.py`` and ``sampling.py`` at ``ref``) is read from the
git history into a temporary package, so the comparison can be rerun after the loop left the tree. Both
decode the same prompts in turns (the order alternating), static γ ∈ ``gammas`` (γ = 0: plain decoding on
each side); greedy tokens must agree.

    python scripts/bench_retired_loop.py ref=c1cdba4 out_dir=results/embedded/batch1_parity
"""

import importlib
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from ldlp.bench.harness.identity import GreedyReference
from eagle_backbone.decoder import SpeculativeDecoder, autoregressive_generate
from eagle_backbone.io import atomic_write_json, atomic_write_text
from eagle_backbone.paths import REPO_ROOT
from eagle_backbone.policy import StaticPolicy
from eagle_backbone.sampling import SamplingConfig
from eagle_backbone.timing import interleaved
from ldlp.bench.harness.stats import paired_ratio
from ldlp.report.engine import retired_loop_markdown

RETIRED = ("engine", "candidates", "sampling", "policy")  # its own policy interface (gamma(ctx) per sequence)


def load_retired(ref: str):
    """The retired loop's modules from commit ``ref`` as package ``retired_loop`` (its own engine, candidates
    and sampling; everything else, the policy interface included, is today's)."""
    root = Path(tempfile.mkdtemp(prefix="retired_loop_"))
    pkg = root / "retired_loop"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in RETIRED:
        try:
            src = subprocess.run(["git", "show", f"{ref}:eagle_backbone/{name}.py"], cwd=REPO_ROOT, check=True,
                                 capture_output=True, text=True).stdout
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"ref={ref}: cannot read eagle_backbone/{name}.py from git ({e.stderr.strip()})") from None
        for other in RETIRED:
            src = src.replace(f"eagle_backbone.{other} import", f"retired_loop.{other} import")
        (pkg / f"{name}.py").write_text(src)
    sys.path.insert(0, str(root))
    return importlib.import_module("retired_loop.engine"), importlib.import_module("retired_loop.candidates")


@hydra.main(config_path="../conf", config_name="bench_retired_loop", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    threads = start(cfg)
    # the code measured is the code at start (a commit landing mid-run must not relabel the page)
    commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    old_engine, old_cands = load_retired(str(cfg.ref))
    from ldlp.bench.harness.loaders import load_pair_cached, load_prompts, machine_info

    pair = load_pair_cached(cfg.model)
    prompts = [ids for _, ids in load_prompts(cfg.data, pair.tokenizer)]
    target, n = pair.target, int(cfg.generation.max_new_tokens)
    greedy = SamplingConfig()
    old_cand = (old_cands.EagleCandidateGenerator(pair.drafter, target) if cfg.model.drafter_kind == "eagle"
                else old_cands.DraftModelCandidateGenerator(pair.drafter, target))

    def timed(fn):
        """The generation and the process CPU seconds it took (a shared machine's other jobs do not count)."""
        def run(p):
            c0 = time.process_time()
            out = fn(p)
            return out, time.process_time() - c0
        return run

    def runners(gamma):
        if gamma == 0:
            fns = [lambda p: autoregressive_generate(target, p, n), lambda p: old_engine.autoregressive_generate(target, p, n)]
        else:
            new = SpeculativeDecoder(target, pair.candidates, StaticPolicy(gamma))
            old = old_engine.SpeculativeDecoder(target, old_cand, old_engine.StaticPolicy(gamma))
            fns = [lambda p: new.generate(p, n, greedy, 0), lambda p: old.generate(p, n, greedy, 0)]
        return [timed(f) for f in fns]

    # the losslessness reference: the target's own greedy decoding through transformers, before any clock
    refs = GreedyReference.of_target(target, prompts, n)
    rows = []
    for gamma in cfg.gammas:
        pair_runs = runners(int(gamma))
        for r in pair_runs:  # warm-up
            r(prompts[0])
        runs = interleaved(pair_runs, prompts, int(cfg.rounds), lambda r, p, k, rep: r(p), order="alternate")
        new_runs = [o for rnd in runs[0] for o in rnd]
        old_runs = [o for rnd in runs[1] for o in rnd]
        same = sum(GreedyReference([b.tokens for b, _ in old_runs]).same([a.tokens for a, _ in new_runs]))
        lossless = [sum(refs.same([o.tokens for o, _ in xs], [j % len(prompts) for j in range(len(xs))]))
                    for xs in (new_runs, old_runs)]
        # every output that leaves the reference, once per (side, prompt): is it a near-tie of the dtype?
        differences = []
        for side, xs in (("engine", new_runs), ("retired loop", old_runs)):
            seen = set()
            for j, (o, _) in enumerate(xs):
                i = j % len(prompts)
                if not refs.same([o.tokens], [i])[0] and (i, tuple(o.tokens)) not in seen:
                    seen.add((i, tuple(o.tokens)))
                    differences.append({"side": side, "prompt": i, **refs.difference(i, o.tokens)})
        row = {"gamma": int(gamma), "same_tokens": same, "generations": len(new_runs),
               "engine_lossless": lossless[0], "retired_loop_lossless": lossless[1], "differences": differences}
        for clock, secs in (("wall", lambda o, c: o.stats.wall_s), ("cpu", lambda o, c: c)):
            toks = [[o.stats.new_tokens for o, _ in xs] for xs in (new_runs, old_runs)]
            sec = [[secs(o, c) for o, c in xs] for xs in (new_runs, old_runs)]
            ratio = paired_ratio(toks[0], sec[0], toks[1], sec[1], seed=int(cfg.seed))
            row[clock] = {"engine_tokens_per_s": sum(toks[0]) / sum(sec[0]),
                          "retired_loop_tokens_per_s": sum(toks[1]) / sum(sec[1]),
                          "ratio": ratio["ratio"], "ci95": ratio["ci95"], "pairs": ratio["pairs"]}
        rows.append(row)
        print(f"γ={gamma}: " + "; ".join(
            f"{k} engine {row[k]['engine_tokens_per_s']:.1f} tok/s, retired loop {row[k]['retired_loop_tokens_per_s']:.1f}, "
            f"ratio {row[k]['ratio']:.3f} ({row[k]['ci95'][0]:.3f}-{row[k]['ci95'][1]:.3f})" for k in ("wall", "cpu"))
            + f"; same tokens {same}/{len(new_runs)}; equal to the target's greedy: engine {lossless[0]}, "
            f"retired loop {lossless[1]}", flush=True)
    out = Path(cfg.out_dir)
    meta = {"ref": str(cfg.ref), "commit": commit.stdout.strip() or None, "model": str(cfg.model.name),
            "dtype": str(cfg.model.dtype), "prompts": len(prompts), "max_new_tokens": n, "rounds": int(cfg.rounds),
            "threads": threads, "machine": machine_info()}
    atomic_write_json(out / "parity.json", {"meta": meta, "rows": rows})
    args = " ".join(shlex.quote(o) for o in HydraConfig.get().overrides.task)  # the command as it was typed
    page = retired_loop_markdown(rows, meta, f"python scripts/bench_retired_loop.py {args}")
    atomic_write_text(out / "parity.md", page)
    print(f"wrote {out / 'parity.md'}")


if __name__ == "__main__":
    main()
