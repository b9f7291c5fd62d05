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
from ldlp.bench.identity import GreedyReference
from eagle_backbone.decoder import SpeculativeDecoder, autoregressive_generate
from eagle_backbone.io import atomic_write_json, atomic_write_text
from eagle_backbone.paths import REPO_ROOT
from eagle_backbone.policy import StaticPolicy
from eagle_backbone.sampling import SamplingConfig
from eagle_backbone.timing import interleaved
from ldlp.bench.stats import paired_ratio

RETIRED = ("engine", "candidates", "sampling", "policy")  # its own policy interface (gamma(ctx) per sequence)


def cpu_line(machine: dict) -> str:
    bf16 = {True: "bf16 matmuls in hardware", False: "bf16 matmuls emulated", None: "bf16 support unknown"}
    return f"{machine['cpu']} ({bf16[machine.get('cpu_bf16')]}, torch {machine['torch']})"


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
    from ldlp.bench.loaders import load_pair_cached, load_prompts, machine_info

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
        same = sum(a.tokens == b.tokens for (a, _), (b, _) in zip(new_runs, old_runs))
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
    md = [f"# Batch 1: the engine against the retired batch-1 loop (git {cfg.ref})", "",
          f"{meta['model']} ({meta['dtype']}), {len(prompts)} prompts x {n} new tokens, greedy, {meta['rounds']} "
          f"interleaved rounds, {threads} thread(s), on {cpu_line(meta['machine'])}. Ratio: engine tokens/s over the "
          "retired loop's, with a paired bootstrap 95% interval over (round, prompt); by wall clock and by the "
          "process's CPU seconds (which other jobs on a shared machine do not inflate). Greedy tokens are compared with each other and with the target's own greedy "
          "decoding through transformers (`TargetModel.reference_greedy`).", "",
          "| static γ | clock | engine tok/s | retired loop tok/s | ratio | 95% interval | same tokens | "
          "engine = target greedy | retired loop = target greedy |",
          "|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    md += [f"| {r['gamma']} | {k} | {r[k]['engine_tokens_per_s']:.1f} | {r[k]['retired_loop_tokens_per_s']:.1f} | "
           f"{r[k]['ratio']:.3f} | {r[k]['ci95'][0]:.3f}-{r[k]['ci95'][1]:.3f} | {r['same_tokens']}/{r['generations']} | "
           f"{r['engine_lossless']}/{r['generations']} | {r['retired_loop_lossless']}/{r['generations']} |"
           for r in rows for k in ("wall", "cpu")]
    diffs = [(r["gamma"], d) for r in rows for d in r["differences"]]
    if diffs:
        md += ["", "Outputs that leave the target's greedy decoding, each at its first differing token: the target's "
               "top-2 logit gap there (the reference prefix in one forward) against the dtype's spacing at the top "
               "logit; a near-tie is a gap within two spacings, where rounding alone can flip the argmax.", "",
               "| static γ | side | prompt | token | reference / got | top-2 gap | spacing | near-tie |",
               "|---:|---|---:|---:|---|---:|---:|---|"]
        def num(x):
            return "–" if x is None else f"{x:.5f}"

        md += [f"| {g} | {d['side']} | {d['prompt']} | {d['position']} | {d.get('ref_token')} / {d.get('got_token')} | "
               f"{num(d['gap'])} | {num(d['spacing'])} | {'yes' if d['near_tie'] else 'NO'} |" for g, d in diffs]
    args = " ".join(shlex.quote(o) for o in HydraConfig.get().overrides.task)  # the command as it was typed
    md += ["", f"Command: `python scripts/bench_retired_loop.py {args}` (at git {meta['commit']})"]
    atomic_write_text(out / "parity.md", "\n".join(md) + "\n")
    print(f"wrote {out / 'parity.md'}")


if __name__ == "__main__":
    main()
