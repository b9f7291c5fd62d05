"""How long the LDLP takes next to a decoding step: it must stay a small fraction of one (target < 2%).

The decoding step measured here is a single-token target forward continuing a KV cache of
``context_len`` tokens: the cheapest part of a real step (which also drafts and verifies), so the ratio
is an upper bound on the LDLP's share.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from eagle_backbone.io import atomic_write_json
from eagle_backbone.runtime import Clock
from eagle_backbone.target import rollback
from eagle_backbone.timing import interleaved

HISTORY_FILE = "step_costs.json"  # in the LDLP's folder: the target-step figures of earlier benchmarks
OFF_BY = 3.0  # a target step this many times slower or faster than the last measurement is flagged


@torch.inference_mode()
def benchmark_ldlp(ldlp, target, context_len: int = 128, reps: int = 200, seed: int = 0,
                   history: str | Path | None = None) -> dict:
    """Median LDLP ``predict_length`` time (batch 1) and target step time, on the target's device, with the
    threads as set (:func:`eagle_backbone.runtime.set_threads`; nothing here changes them).

    The two are timed in turns, one LDLP call and one target step per repetition, their order alternating,
    so that a slow phase of a shared machine hits both alike; the figures are medians over the repetitions.
    With ``history`` (a JSON file, :data:`HISTORY_FILE` in the LDLP's folder) the target step is compared
    with the last one measured in the same setting (target, device, dtype, threads, context) and recorded;
    a step more than :data:`OFF_BY` times off is flagged (``flag``): the machine was busy, or the setting
    differs from what it seems."""
    device = target.device
    ldlp = ldlp.to(device)
    clock = Clock(device)
    g = torch.Generator().manual_seed(seed)
    context_len = max(1, min(context_len, target.max_length - 1))
    ids = torch.randint(3, target.vocab_size, (1, context_len + 1), generator=g).to(device)
    cache = target.new_cache()
    _, feats = target(ids[:, :context_len], cache)
    embedding, feature = target.embed(ids[0, context_len:])[0], feats[0, -1]

    def target_step():
        target(ids[:, context_len:], cache)
        rollback(cache, context_len)

    def ldlp_call():
        ldlp.predict_length(embedding, feature)

    def timed(fn, *_):
        t0 = clock()
        fn()
        return clock() - t0

    for _ in range(min(5, reps)):  # warm-up: first calls allocate
        target_step()
        ldlp_call()
    step_times, ldlp_times = interleaved((target_step, ldlp_call), [None], max(1, reps), timed, order="alternate")
    step_s = statistics.median(t for row in step_times for t in row)
    ldlp_s = statistics.median(t for row in ldlp_times for t in row)
    out = {"ldlp_us": ldlp_s * 1e6, "target_step_ms": step_s * 1e3, "ratio": ldlp_s / step_s,
           "context_len": context_len, "device": str(device), "threads": torch.get_num_threads(),
           "reps": max(1, reps), "interleaved": True}
    if history is not None:
        out.update(check_step_cost(history, out, _setting(target, out)))
    return out


def _setting(target, out: dict) -> str:
    name = getattr(getattr(target, "model", None), "name_or_path", "") or type(target).__name__
    return f"{name}|{out['device']}|{target.dtype}|threads={out['threads']}|context={out['context_len']}"


def check_step_cost(history: str | Path, out: dict, setting: str) -> dict:
    """Compare ``out['target_step_ms']`` with the last figure ``history`` holds for ``setting``, then record it.
    Returns ``last_target_step_ms``, ``ratio_to_last`` and ``flag`` (None, or a sentence when > OFF_BY off);
    a flagged figure is not recorded, so one bad run does not become the next run's reference."""
    path = Path(history)
    try:
        log = json.loads(path.read_text()) if path.is_file() else {}
    except (json.JSONDecodeError, OSError):
        log = {}
    last = (log.get(setting) or {}).get("target_step_ms")
    ms = float(out["target_step_ms"])
    result = {"last_target_step_ms": last, "ratio_to_last": ms / last if last else None, "flag": None}
    if last and max(ms / last, last / ms) > OFF_BY:
        result["flag"] = (f"the target step ({ms:.2f} ms) is {ms / last:.2f}x the last measurement in this setting "
                          f"({last:.2f} ms, {log[setting].get('when', '?')}): more than {OFF_BY:g}x off, so the "
                          "machine was busy or the setting differs (threads?); rerun python scripts/bench_ldlp.py")
    if result["flag"] is None:  # a flagged figure does not become the reference
        log[setting] = {"target_step_ms": ms, "ldlp_us": out.get("ldlp_us"),
                        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        try:
            atomic_write_json(path, log)
        except OSError:  # a read-only folder: the comparison still stands
            pass
    return result
