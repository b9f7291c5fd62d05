"""Two measurements of the engine itself, behind ``scripts/profile_engine.py`` (committed in
``results/embedded/batch_bench/``): whether a newly admitted prompt's prefill is cheaper joined to the step's
target forward or as its own (:func:`prefill_join_cost`), and where a batched run's time goes, per component of
the engine's profiled mode (:func:`profile_components`).
"""

from __future__ import annotations

import statistics
import time

import torch

from eagle_backbone.timing import interleaved
from ldlp.bench.harness.engines import EngineFactory
from ldlp.bench.harness.workload import run_workload


@torch.inference_mode()
def prefill_join_cost(target, concurrency=(2, 4, 8, 16, 32), prompt_len: int = 40, context: int = 96, gamma: int = 3,
                      reps: int = 15, seed: int = 0) -> list[dict]:
    """When one sequence finishes and its slot takes a new prompt: is the prompt's prefill cheaper as its own
    target forward (then the C-1 running slots' verification forward), or joined to that step's forward
    (one ragged batch: projections and MLPs over all tokens at once, attention per row)? Median
    process-CPU ms of each, interleaved, per C."""
    from eagle_backbone.llama import BatchedLlama
    from eagle_backbone.ragged import RaggedBatch

    g = torch.Generator().manual_seed(seed)
    lm = BatchedLlama(target.model, context + prompt_len + gamma + 4)
    V, dev = target.vocab_size, target.device
    rows_out = []
    for C in concurrency:
        cache = lm.new_cache(C)
        lm(torch.randint(4, V, (C * context,), generator=g).to(dev), RaggedBatch(range(C), [0] * C, [context] * C, dev),
           cache)
        step = RaggedBatch(range(C - 1), [context] * (C - 1), [gamma + 1] * (C - 1), dev)
        new = RaggedBatch([C - 1], [0], [prompt_len], dev)
        joined = step.join(new) if C > 1 else new
        step_tok = torch.randint(4, V, ((C - 1) * (gamma + 1),), generator=g).to(dev)
        prompt = torch.randint(4, V, (prompt_len,), generator=g).to(dev)
        times = {"separate": [], "joined": []}

        def one(how, _, __, i):  # two warm-up rounds; joined first in even rounds
            t0 = time.process_time()
            if how == "separate":
                lm.logits(lm(prompt, new, cache)[-1:])
                if C > 1:
                    lm.logits(lm(step_tok, step, cache))
            else:
                h = lm(torch.cat([step_tok, prompt]), joined, cache)
                lm.logits(h[step.n:][-1:])
                if C > 1:
                    lm.logits(h[: step.n])
            if i >= 2:
                times[how].append(1e3 * (time.process_time() - t0))

        interleaved(("joined", "separate"), [None], reps + 2, one, order="alternate")
        sep, joi = statistics.median(times["separate"]), statistics.median(times["joined"])
        rows_out.append({"concurrency": C, "prompt_len": prompt_len, "gamma": gamma, "separate_ms": sep,
                         "joined_ms": joi, "joined_over_separate": joi / sep})
    return rows_out


@torch.inference_mode()
def profile_components(target, candidates, prompts, make_policy, concurrency=(1, 16), max_new_tokens: int = 32,
                       attn: str = "eager") -> list[dict]:
    """Per-component seconds of the engine's profiled mode (a sync before every clock read; never in the
    timed sweep): prefill, policy, draft, verify, host read and host bookkeeping, per C (``candidates``: a
    :class:`~eagle_backbone.candidates.CandidateGenerator`, or None for batched AR)."""
    out = []
    engines = EngineFactory.for_prompts(target, candidates, prompts, max_new_tokens, attn)
    for C in concurrency:
        eng = engines(C, make_policy, profile=True)
        run_workload(eng, prompts[:C], C, 8)  # warm-up
        eng.prof.s = {}
        res = run_workload(eng, prompts, C, max_new_tokens)
        total = sum(eng.prof.s.values())
        out.append({"concurrency": C, "tokens": res.new_tokens, "steps": res.steps,
                    "seconds": {k: round(v, 4) for k, v in eng.prof.s.items()},
                    "share": {k: round(v / total, 3) for k, v in eng.prof.s.items()}})
    return out
