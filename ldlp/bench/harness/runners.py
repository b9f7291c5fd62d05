"""One generation of each kind behind one signature, ``run(prompt, max_new_tokens, seed) -> (tokens, stats)``,
and the choice of the autoregressive baseline: what the evaluation and the head to head time."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from eagle_backbone.decoder import SpeculativeDecoder, autoregressive_generate
from eagle_backbone.metrics import total
from eagle_backbone.sampling import SamplingConfig
from eagle_backbone.timing import interleaved

log = logging.getLogger(__name__)


AR_IMPLS = ("ours", "transformers")


_AR_CHOICE: dict[str, dict] = {}


@dataclass
class Runner:
    """How to generate one prompt; ``run(prompt, max_new_tokens, seed) -> (tokens, stats)``."""

    name: str
    run: object


def engine_runner(name, decoder: SpeculativeDecoder, sampling: SamplingConfig) -> Runner:
    def run(prompt, n, seed):
        out = decoder.generate(prompt, n, sampling=sampling, seed=seed)
        return out.tokens, out.stats

    return Runner(name, run)


def ar_runner(impl: str, target, sampling: SamplingConfig) -> Runner:
    if impl == "ours":
        def run(prompt, n, seed):
            out = autoregressive_generate(target, prompt, n, sampling=sampling, seed=seed)
            return out.tokens, out.stats
    else:
        from ldlp.bench.harness.peer import hf_generate

        def run(prompt, n, seed):
            return hf_generate(target.model, prompt, n, target.eos_token_ids)
    return Runner(f"ar_{impl}", run)


def reference_runner(target) -> Runner:
    """The target's own greedy decoding through transformers (untimed): what lossless outputs must equal."""
    from eagle_backbone.metrics import GenerationStats

    def run(prompt, n, seed):
        out = target.reference_greedy(prompt, n)
        return out, GenerationStats(new_tokens=len(out))

    return Runner("reference", run)


def peer_runner(spec, pair) -> Runner:
    from ldlp.bench.harness.peer import hf_generate

    def run(prompt, n, seed):
        return hf_generate(pair.target.model, prompt, n, pair.target.eos_token_ids, assistant_model=pair.drafter,
                           spec=spec)

    return Runner("transformers_assisted", run)


def choose_ar_baseline(target, prompts, max_new_tokens: int, sampling: SamplingConfig, choice: str,
                       calibration_prompts: int, cache_key: str) -> dict:
    """Which AR implementation is the baseline: ``choice`` if fixed, else the faster of the two on the
    first ``calibration_prompts`` prompts (timed twice each, interleaved; decided once per process)."""
    if choice not in ("auto",) + AR_IMPLS:
        raise ValueError(f"evaluation.ar_baseline must be auto, ours or transformers, got {choice!r}")
    if not sampling.greedy:
        return {"impl": "ours", "reason": "sampling: transformers' sampler draws other random numbers"}
    if choice != "auto":
        return {"impl": choice, "reason": "fixed by evaluation.ar_baseline"}
    if cache_key in _AR_CHOICE:
        return _AR_CHOICE[cache_key]
    runners = [ar_runner(impl, target, sampling) for impl in AR_IMPLS]
    few = [p for _, p in prompts[: max(1, calibration_prompts)]]
    for r in runners:  # warm-up
        r.run(few[0], min(8, max_new_tokens), 0)
    runs = interleaved(runners, few, 2, lambda r, prompt, k, rep: r.run(prompt, max_new_tokens, 0)[1],
                       order="alternate")
    speeds = {impl: total([st for row in per_round for st in row]).tokens_per_s
              for impl, per_round in zip(AR_IMPLS, runs)}
    best = max(AR_IMPLS, key=lambda impl: speeds[impl])
    _AR_CHOICE[cache_key] = {"impl": best, "reason": "faster in calibration",
                             "calibration_tokens_per_s": {k: round(v, 2) for k, v in speeds.items()}}
    log.info("AR baseline: %s (calibration tokens/s %s)", best, _AR_CHOICE[cache_key]["calibration_tokens_per_s"])
    return _AR_CHOICE[cache_key]


def progress_bar(n: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=n, desc=desc, unit="gen", leave=False, disable=not enabled, mininterval=1.0)
