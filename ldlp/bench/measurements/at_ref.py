"""This engine against the engine of an earlier commit, batched, on the same prompts in turns
(``scripts/bench_engine_ref.py``): what a change to the decoding core bought or cost, at each C.

The decoding core at ``ref`` is read from git into a temporary package of its own name (every import of
``eagle_backbone`` inside it renamed), so both engines live in one process on the same target weights;
today's continuous-batching workload drives both. Each (prompt set, C, γ) cell runs both engines in turns
for ``rounds`` rounds (the order alternating); the ratio of tokens per process CPU-second, today over
``ref``, gets a paired bootstrap interval over the rounds. Greedy outputs must agree.
"""

from __future__ import annotations

import atexit
import importlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.paths import REPO_ROOT
from eagle_backbone.policy import StaticPolicy
from eagle_backbone.timing import interleaved
from ldlp.bench.harness.engines import capacity_for
from ldlp.bench.harness.identity import GreedyReference
from ldlp.bench.harness.stats import paired_ratio
from ldlp.bench.harness.workload import run_workload

CORE = "eagle_backbone"


def load_core_at(ref: str):
    """The decoding core at commit ``ref`` as a package of its own (``core_at_<ref>``): (its engine module, its
    policy module)."""
    name = "core_at_" + re.sub(r"\W", "_", ref)
    if name in sys.modules:
        return importlib.import_module(f"{name}.engine"), importlib.import_module(f"{name}.policy")
    try:
        blob = subprocess.run(["git", "archive", "--format=tar", ref, CORE], cwd=REPO_ROOT, check=True,
                              capture_output=True).stdout
    except subprocess.CalledProcessError as e:
        raise ValueError(f"ref={ref}: git cannot read {CORE}/ at that commit ({e.stderr.decode().strip()})") from None
    root = Path(tempfile.mkdtemp(prefix="core_at_ref_"))
    atexit.register(shutil.rmtree, root, True)  # the copy lives as long as the process that imports from it
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(root, filter="data")
    (root / CORE).rename(root / name)
    for f in (root / name).rglob("*.py"):
        f.write_text(f.read_text().replace(CORE, name))
    sys.path.insert(0, str(root))
    try:
        engine, policy = importlib.import_module(f"{name}.engine"), importlib.import_module(f"{name}.policy")
    except ImportError as e:
        raise ValueError(f"ref={ref}: its {CORE}/ cannot be loaded next to today's ({e}); choose a later ref") from None
    missing = [f"{m.__name__.split('.')[-1]}.{a}" for m, a in ((engine, "BatchedSpeculativeEngine"),
                                                               (policy, "StaticPolicy")) if not hasattr(m, a)]
    if missing:
        raise ValueError(f"ref={ref}: its {CORE}/ has no {', '.join(missing)} (the batched engine came later); "
                         "choose a ref that has the batched engine")
    return engine, policy


@torch.inference_mode()
def compare(pair, sets: dict, ref: str, concurrency=(1, 16), gammas=(0, 4), rounds: int = 2,
            max_new_tokens: int = 32, bootstrap: int = 2000, seed: int = 0, log=print) -> list[dict]:
    """Rows per (set, C, γ): tokens per CPU-second of today's engine and ``ref``'s (medians over rounds), their
    paired ratio with its interval, and whether every greedy output agreed."""
    old_engine, old_policy = load_core_at(ref)
    engines = {"today": (BatchedSpeculativeEngine, StaticPolicy), "ref": (old_engine.BatchedSpeculativeEngine,
                                                                        old_policy.StaticPolicy)}
    rows = []
    for name, prompts in sets.items():
        capacity = capacity_for(prompts, max_new_tokens)
        for C in concurrency:
            for g in gammas:
                runs = {k: [] for k in engines}
                outs = {}  # (round, engine) -> its outputs

                def one(k, _, __, r):
                    Engine, Static = engines[k]
                    try:
                        eng = Engine(pair.target, pair.drafter if g else None, "eagle" if g else None, slots=C,
                                     policy=Static(g), capacity=capacity)
                    except (TypeError, AttributeError) as e:
                        if k == "today":
                            raise
                        raise ValueError(f"ref={ref}: its engine does not take today's arguments ({e}); choose "
                                         "a later ref") from None
                    res = run_workload(eng, prompts, C, max_new_tokens)
                    runs[k].append((res.new_tokens, res.cpu_s, res.wall_s))
                    outs[r, k] = [o.tokens for o in res.outputs]

                interleaved(list(engines), [None], rounds, one, order="alternate")  # the first engine alternates
                agree = all(GreedyReference(outs[r, "ref"]).lossless([outs[r, "today"]]) for r in range(rounds))
                t, o = runs["today"], runs["ref"]
                ratio = paired_ratio([x[0] for x in t], [x[1] for x in t], [x[0] for x in o], [x[1] for x in o],
                                     bootstrap=bootstrap, seed=seed)
                rows.append({"set": name, "concurrency": C, "gamma": g, "rounds": rounds,
                             "today_tokens_per_cpu_s": sorted(x[0] / x[1] for x in t)[len(t) // 2],
                             "ref_tokens_per_cpu_s": sorted(x[0] / x[1] for x in o)[len(o) // 2],
                             "ratio": ratio["ratio"], "ci95": ratio["ci95"], "outputs_agree": agree})
                log(f"{name} C={C} γ={g}: today/ref {ratio['ratio']:.2f} {ratio['ci95']} agree={agree}")
    return rows
