"""Evaluate one draft-length policy on one prompt set, next to the autoregressive baseline.

``evaluate(cfg)`` (the library behind ``scripts/evaluate.py``):

1. loads the pair (``cfg.model``) and the prompts (``cfg.data``), both cached per process: a Hydra
   multirun evaluates many policies in one process, so each is loaded once;
2. builds the policy (``cfg.policy`` via ``hydra.utils.instantiate``) and hands it the models if it
   wants them (``bind``: the oracle);
3. warms up, then picks the autoregressive (AR) baseline: the faster of this project's
   ``autoregressive_generate`` and transformers' ``model.generate`` (both are timed on the first prompts
   once per process and model; the faster is kept);
4. runs ``repeats`` rounds over the prompts, the AR baseline and the speculative run interleaved prompt
   by prompt (their order alternating), so slow phases of a noisy machine hit both alike;
5. reports medians over the rounds of the timings, and the (deterministic) counters of the first round;
   under greedy decoding checks that every speculative output equals the AR output (lossless).

The result is a flat dict (see :data:`RESULT_KEYS`) written as ``results.json``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from eagle_backbone.engine import SpeculativeDecoder, autoregressive_generate
from eagle_backbone.metrics import GenerationStats, total
from eagle_backbone.sampling import SamplingConfig

log = logging.getLogger(__name__)

RESULT_KEYS = ("policy", "gamma", "dataset", "n_prompts", "temperature", "new_tokens", "wall_s", "tokens_per_s",
               "ar_tokens_per_s", "speedup", "tau", "target_forwards", "drafted_tokens", "wasted_tokens", "draft_s",
               "target_s", "policy_s", "lossless")

AR_IMPLS = ("ours", "transformers")

_PAIRS: dict[str, object] = {}
_PROMPTS: dict[str, list] = {}
_AR_CHOICE: dict[str, dict] = {}


# -- loading (cached per process) --------------------------------------------------------------------------


def _key(node) -> str:
    return json.dumps(OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node,
                      sort_keys=True, default=str)


def load_pair_cached(model_cfg):
    from eagle_backbone.loading import load_pair

    key = _key(model_cfg)
    if key not in _PAIRS:
        _PAIRS[key] = load_pair(model_cfg)
    return _PAIRS[key]


def load_prompts(data_cfg, tokenizer) -> list[tuple[str, list[int]]]:
    """(conversation id, prompt token ids) for the prompt set ``data_cfg`` (its first ``limit`` items)."""
    from eagle_backbone.data.conversations import build_prompts, load_conversations

    key = _key(data_cfg) + str(getattr(tokenizer, "name_or_path", id(tokenizer)))
    if key not in _PROMPTS:
        path = data_cfg.get("path")
        if not path:
            raise ValueError(f"data.path is empty (data={data_cfg.get('name')}); give a prompt file with data.path=FILE")
        conversations = load_conversations(path, fmt=data_cfg.get("format", "auto"),
                                           on_error=data_cfg.get("on_error", "raise"), limit=data_cfg.get("limit"),
                                           sample_seed=data_cfg.get("sample_seed"))
        prompts = build_prompts(tokenizer, conversations, data_cfg.get("max_prompt_tokens"),
                                turns=data_cfg.get("turns", "first"), chat_template=data_cfg.get("chat_template"))
        if not prompts:
            raise ValueError(f"data.path={path}: no prompts (empty file or every conversation skipped)")
        _PROMPTS[key] = [(str(cid), list(ids)) for cid, ids in prompts]
    return _PROMPTS[key]


# the checkpoint folders that conf/policy/*.yaml interpolate (${ldlp_path}, ...)
CHECKPOINT_KEYS = ("ldlp_path", "ldlp_survival_path", "acceptance_path")


def policy_config(cfg, overrides: list[str]) -> tuple[str, DictConfig]:
    """(name, policy node) that ``scripts/evaluate.py`` would build under ``overrides`` (one ``policy=NAME``
    and any ``policy.FIELD=...``), with ``cfg``'s checkpoint folders. For scripts that run several
    policies; call it inside a Hydra app (its search path holds conf/)."""
    from hydra import compose

    from eagle_backbone.paths import REPO_ROOT

    names = [o.split("=", 1)[1] for o in overrides if o.startswith("policy=")]
    if len(names) != 1:
        raise ValueError(f"{list(overrides)}: give exactly one policy=NAME (a file under conf/policy/)")
    if not (REPO_ROOT / "conf" / "policy" / f"{names[0]}.yaml").is_file():
        raise ValueError(f"policy={names[0]}: there is no conf/policy/{names[0]}.yaml")
    paths = [f"{k}={cfg[k]}" for k in CHECKPOINT_KEYS if k in cfg]
    return names[0], compose(config_name="evaluate", overrides=list(overrides) + paths).policy


def build_policy(policy_cfg):
    from hydra.utils import instantiate

    if "_target_" not in policy_cfg:
        raise ValueError("policy config has no _target_: pick one with policy=static|ldlp|ddd|... "
                         "(files under conf/policy/)")
    return instantiate(policy_cfg)


def apply_tuned(policy_cfg, tuned_from, policy_name: str | None):
    """``policy_cfg`` with the best replay-tuned setting of ``policy_name`` from ``tuned_from`` (the
    tuning.json of scripts/tune_policies.py) merged in; (config, the applied setting or None)."""
    if not tuned_from or not policy_name:
        return policy_cfg, None
    path = Path(tuned_from)
    if not path.is_file():
        raise ValueError(f"tuned_from={tuned_from}: no such file (run python scripts/tune_policies.py first)")
    try:
        results = json.loads(path.read_text())["results"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"tuned_from={tuned_from}: not a tuning.json of scripts/tune_policies.py ({e!r})") from None
    from ldlp.replay import best_per_policy

    best = best_per_policy(results).get(policy_name)
    if best is None or policy_name in ("static", "oracle"):
        return policy_cfg, None
    log.info("policy %s: tuned setting %s from %s", policy_name, best["params"], tuned_from)
    return OmegaConf.merge(policy_cfg, best["params"]), best["params"]


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:  # the model name is more telling than "x86_64" where /proc/cpuinfo exists
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# -- one generation of each kind ------------------------------------------------------------------------


@dataclass
class Runner:
    """How to generate one prompt; ``run(prompt, max_new_tokens, seed) -> (tokens, stats)``."""

    name: str
    run: object


def _engine_runner(name, decoder: SpeculativeDecoder, sampling: SamplingConfig) -> Runner:
    def run(prompt, n, seed):
        out = decoder.generate(prompt, n, sampling=sampling, seed=seed)
        return out.tokens, out.stats

    return Runner(name, run)


def _ar_runner(impl: str, target, sampling: SamplingConfig) -> Runner:
    if impl == "ours":
        def run(prompt, n, seed):
            out = autoregressive_generate(target, prompt, n, sampling=sampling, seed=seed)
            return out.tokens, out.stats
    else:
        from ldlp.peer import hf_generate

        def run(prompt, n, seed):
            return hf_generate(target.model, prompt, n, target.eos_token_ids)
    return Runner(f"ar_{impl}", run)


def _peer_runner(spec, pair) -> Runner:
    from ldlp.peer import hf_generate

    def run(prompt, n, seed):
        return hf_generate(pair.target.model, prompt, n, pair.target.eos_token_ids, assistant_model=pair.drafter,
                           spec=spec)

    return Runner("transformers_assisted", run)


def _tokens_per_s(stats: list[GenerationStats]) -> float:
    return total(stats).tokens_per_s


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
    runners = [_ar_runner(impl, target, sampling) for impl in AR_IMPLS]
    few = [p for _, p in prompts[: max(1, calibration_prompts)]]
    for r in runners:  # warm-up
        r.run(few[0], min(8, max_new_tokens), 0)
    stats = {r.name: [] for r in runners}
    for rep in range(2):
        for k, prompt in enumerate(few):
            for r in (runners if (rep + k) % 2 == 0 else runners[::-1]):
                stats[r.name].append(r.run(prompt, max_new_tokens, 0)[1])
    speeds = {impl: _tokens_per_s(stats[f"ar_{impl}"]) for impl in AR_IMPLS}
    best = max(AR_IMPLS, key=lambda impl: speeds[impl])
    _AR_CHOICE[cache_key] = {"impl": best, "reason": "faster in calibration",
                             "calibration_tokens_per_s": {k: round(v, 2) for k, v in speeds.items()}}
    log.info("AR baseline: %s (calibration tokens/s %s)", best, _AR_CHOICE[cache_key]["calibration_tokens_per_s"])
    return _AR_CHOICE[cache_key]


# -- the evaluation -------------------------------------------------------------------------------------


def _median(values):
    return float(statistics.median(values)) if values else None


def _sampling(gen_cfg) -> SamplingConfig:
    return SamplingConfig(temperature=float(gen_cfg.get("temperature", 0.0)), top_k=int(gen_cfg.get("top_k", 0)),
                          top_p=float(gen_cfg.get("top_p", 1.0)))


def evaluate(cfg, policy_name: str | None = None, out_dir: str | Path | None = None) -> dict:
    """Run the evaluation described by ``cfg`` (model, data, policy, generation, evaluation, seed)."""
    from ldlp.peer import TransformersAssisted

    ev = cfg.evaluation
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(int(cfg.seed))
    max_new_tokens = int(cfg.generation.max_new_tokens)
    if max_new_tokens < 1:
        raise ValueError(f"generation.max_new_tokens must be >= 1, got {max_new_tokens}")
    repeats = int(ev.repeats)
    if repeats < 1:
        raise ValueError(f"evaluation.repeats must be >= 1, got {repeats}")
    sampling = _sampling(cfg.generation)

    pair = load_pair_cached(cfg.model)
    prompts = load_prompts(cfg.data, pair.tokenizer)
    policy_cfg, tuned = apply_tuned(cfg.policy, cfg.get("tuned_from"), policy_name)
    policy = build_policy(policy_cfg)
    policy_name = policy_name or getattr(policy, "name", type(policy).__name__)

    if isinstance(policy, TransformersAssisted):
        if cfg.model.drafter_kind != "draft_lm":
            raise ValueError(f"policy={policy_name} runs transformers' assisted generation, which needs a standalone "
                             f"draft LM (model=embedded_draft_lm), not model.drafter_kind={cfg.model.drafter_kind}")
        if not sampling.greedy:
            raise ValueError(f"policy={policy_name}: the transformers peer is compared under greedy decoding only "
                             "(generation.temperature=0)")
        spec_runner = _peer_runner(policy, pair)
        engine = "transformers"
    else:
        if hasattr(policy, "bind"):
            policy.bind(pair.target, pair.candidates, max_new_tokens, sampling)
        spec_runner = _engine_runner(policy_name, SpeculativeDecoder(pair.target, pair.candidates, policy), sampling)
        engine = "ours"

    ar_key = _key(cfg.model) + _key(cfg.data) + f"{max_new_tokens}{sampling}"
    ar_info = choose_ar_baseline(pair.target, prompts, max_new_tokens, sampling, str(ev.ar_baseline),
                                 int(ev.calibration_prompts), ar_key)
    ar_runner = _ar_runner(ar_info["impl"], pair.target, sampling)

    seed = int(cfg.seed)
    for _, prompt in prompts[: int(ev.warmup)]:  # warm-up: first calls allocate, later ones are what we time
        spec_runner.run(prompt, min(16, max_new_tokens), seed)
        ar_runner.run(prompt, min(16, max_new_tokens), seed)

    spec_stats = [[None] * len(prompts) for _ in range(repeats)]
    ar_stats = [[None] * len(prompts) for _ in range(repeats)]
    spec_out, ar_out = [None] * len(prompts), [None] * len(prompts)
    progress = _progress(repeats * len(prompts), policy_name, bool(ev.get("progress", True)))
    for r in range(repeats):
        for k, (_, prompt) in enumerate(prompts):
            s = seed + k  # the same seed for a prompt in every round: sampled outputs repeat too
            order = ((ar_runner, ar_stats, ar_out), (spec_runner, spec_stats, spec_out))
            for runner, stats, outs in (order if (r + k) % 2 == 0 else order[::-1]):
                tokens, st = runner.run(prompt, max_new_tokens, s)
                stats[r][k] = st
                if r == 0:
                    outs[k] = tokens
            progress.update(1)
    progress.close()

    lossless, mismatches = None, []
    if sampling.greedy and bool(ev.check_lossless):
        mismatches = [prompts[k][0] for k in range(len(prompts)) if spec_out[k] != ar_out[k]]
        lossless = not mismatches
        if mismatches:
            log.warning("policy %s: %d outputs differ from the AR output (prompts %s)", policy_name, len(mismatches),
                        mismatches[:5])

    rounds = [total(row) for row in spec_stats]
    ar_rounds = [total(row) for row in ar_stats]
    first = rounds[0]
    steps = max(1, first.target_forwards - 1)
    gamma = None if getattr(policy, "adaptive", True) else int(policy.fixed_gamma)
    result = {
        "policy": policy_name,
        "gamma": gamma,
        "dataset": str(cfg.data.get("name", Path(str(cfg.data.path)).stem)),
        "n_prompts": len(prompts),
        "temperature": sampling.temperature,
        "new_tokens": first.new_tokens,
        "wall_s": _median([x.wall_s for x in rounds]),
        "tokens_per_s": _median([x.tokens_per_s for x in rounds]),
        "ar_tokens_per_s": _median([x.tokens_per_s for x in ar_rounds]),
        "speedup": _median([x.tokens_per_s / y.tokens_per_s for x, y in zip(rounds, ar_rounds) if y.tokens_per_s]),
        "tau": first.tau,
        "target_forwards": first.target_forwards,
        "drafted_tokens": first.drafted_tokens,
        "wasted_tokens": first.wasted_tokens,
        "draft_s": _median([x.draft_s for x in rounds]),
        "target_s": _median([x.target_s for x in rounds]),
        "policy_s": _median([x.policy_s for x in rounds]) if engine == "ours" else None,
        "lossless": lossless,
        # context for the table and for reruns
        "engine": engine,
        "model": str(cfg.model.get("name", "")),
        "drafter_kind": str(cfg.model.drafter_kind),
        "data_path": str(cfg.data.path),
        "max_new_tokens": max_new_tokens,
        "acceptance_rate": first.acceptance_rate,
        "mean_drafted_per_step": first.drafted_tokens / steps,
        "ar_new_tokens": ar_rounds[0].new_tokens,
        "ar_impl": ar_info["impl"],
        "ar_choice": ar_info,
        "repeats": repeats,
        "interleaved": True,
        "tokens_per_s_rounds": [x.tokens_per_s for x in rounds],
        "ar_tokens_per_s_rounds": [x.tokens_per_s for x in ar_rounds],
        "lossless_mismatches": mismatches,
        "policy_config": OmegaConf.to_container(policy_cfg, resolve=True),
        "tuned_from": str(cfg.tuned_from) if tuned else None,
        "seed": seed,
        "machine": machine_info(),
    }
    if engine == "transformers":  # its counters come from forward hooks, see ldlp/peer.py
        result["policy_s"] = None
    if out_dir is not None:
        write_results(result, out_dir)
    return result


def _progress(n: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=n, desc=desc, unit="gen", leave=False, disable=not enabled, mininterval=1.0)


def write_results(result: dict, out_dir: str | Path) -> Path:
    """``results.json`` in ``out_dir``, written atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out / "results.json")
    return out / "results.json"


def one_line(result: dict) -> str:
    g = "" if result["gamma"] is None else f" γ={result['gamma']}"
    loss = {True: "lossless", False: "NOT LOSSLESS", None: "unchecked"}[result["lossless"]]
    return (f"{result['policy']}{g} [{result['model']}] on {result['dataset']} ({result['n_prompts']} prompts): "
            f"{result['tokens_per_s']:.1f} tok/s vs AR {result['ar_tokens_per_s']:.1f} = {result['speedup']:.2f}x, "
            f"τ={result['tau']:.2f}, wasted {result['wasted_tokens']}, {loss}")
