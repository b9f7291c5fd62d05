"""Evaluate one draft-length policy on one prompt set, next to the autoregressive baseline.

``evaluate(cfg)`` (the library behind ``scripts/evaluate.py``):

1. loads the pair (``cfg.model``) and the prompts (``cfg.data``), both cached per process: a Hydra
   multirun evaluates many policies in one process, so each is loaded once;
2. builds the policy (``cfg.policy`` via ``hydra.utils.instantiate``) and hands it the models if it
   wants them (``bind``: the oracle); a config may instead build a peer (:class:`ldlp.bench.harness.peer.PeerSpec`,
   recognised by its ``kind``), another implementation that runs in place of this engine;
3. warms up, then picks the autoregressive (AR) baseline: the faster of this project's
   ``autoregressive_generate`` and transformers' ``model.generate`` (both are timed on the first prompts
   once per process and model; the faster is kept);
4. runs ``repeats`` rounds over the prompts, the AR baseline and the speculative run interleaved prompt
   by prompt (their order alternating), so slow phases of a noisy machine hit both alike;
5. reports medians over the rounds of the timings, and the (deterministic) counters of the first round;
   under greedy decoding checks that every speculative output equals the target's own greedy decoding
   through transformers (lossless): AR's outputs when transformers' ``generate`` is the baseline, else one
   untimed run of :meth:`~eagle_backbone.target.TargetModel.reference_greedy` (this project's AR is the
   engine with γ = 0, not an independent reference).

The result is a flat dict (see :data:`RESULT_KEYS`) written as ``results.json``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle_backbone.cost import table_record
from eagle_backbone.errors import accepted_mismatches
from eagle_backbone.io import atomic_write_json
from eagle_backbone.metrics import total
from eagle_backbone.runtime import resolve_dtype, set_threads
from eagle_backbone.timing import interleaved
from ldlp.bench.harness.loaders import (
    apply_tuned,
    build_policy,
    check_tuned,
    config_key,
    load_pair_cached,
    load_tokenizer_cached,
    machine_info,
    prepare_cost_tables,
    run_setup,
    sampling_config,
)
from ldlp.bench.harness.runners import (
    ar_runner,
    choose_ar_baseline,
    engine_runner,
    peer_runner,
    progress_bar,
    reference_runner,
)
from ldlp.bench.harness.peer import is_peer
from ldlp.bench.comparisons.answers import model_id, write_answers
from ldlp.bench.comparisons.categories import category_rows, specbench_tasks
from ldlp.bench.comparisons.conversation import Dialogue, load_questions, question_rows
from ldlp.bench.harness.engines import EngineFactory
from ldlp.bench.harness.identity import GreedyReference
from ldlp.bench.harness.stats import median
from ldlp.policies.pricing import flat_pricing

log = logging.getLogger(__name__)

# the reference greedy decodings per (pair, prompts, generation, seed), kept for the process (see evaluate)
_REFERENCE: dict = {}

RESULT_KEYS = ("policy", "gamma", "dataset", "n_prompts", "temperature", "new_tokens", "wall_s", "tokens_per_s",
               "ar_tokens_per_s", "speedup", "tau", "target_forwards", "drafted_tokens", "wasted_tokens", "draft_s",
               "target_s", "policy_s", "lossless")


def evaluate(cfg, policy_name: str | None = None, out_dir: str | Path | None = None) -> dict:
    """Run the evaluation described by ``cfg`` (model, data, policy, generation, evaluation, seed)."""
    ev = cfg.evaluation
    set_threads(cfg.get("threads"))
    torch.manual_seed(int(cfg.seed))
    max_new_tokens = int(cfg.generation.max_new_tokens)
    if max_new_tokens < 1:
        raise ValueError(f"generation.max_new_tokens must be >= 1, got {max_new_tokens}")
    repeats = int(ev.repeats)
    if repeats < 1:
        raise ValueError(f"evaluation.repeats must be >= 1, got {repeats}")
    sampling = sampling_config(cfg.generation)

    # cheap inputs first: the prompt file (read, parsed and tokenized: the tokenizer has no weights), the
    # policy and its checkpoints' configs; only then the weights, so a bad input fails in seconds, not after
    # minutes of loading a 7B target
    # questions: one fixed prompt each, or (data.turns=all on MT-bench-format files) conversations whose later
    # turns carry the model's own earlier answers (ldlp/bench/comparisons/conversation.py)
    questions = load_questions(cfg.data, load_tokenizer_cached(cfg.model))
    prompts = questions.first_prompts()
    prompt_info = dict(questions.info)
    # a tuned file made for another model, dtype or drafter kind is refused here, before any weights load
    # a peer (peer=NAME, conf/peer/: another implementation) runs instead of this engine's policy
    chosen = cfg.peer if cfg.get("peer") is not None else cfg.policy
    policy_cfg, tuned = apply_tuned(chosen, cfg.get("tuned_from"), policy_name, run_setup(cfg.model))
    policy = build_policy(policy_cfg, cfg.model)
    policy_name = policy_name or getattr(policy, "name", type(policy).__name__)
    pair = load_pair_cached(cfg.model)
    if tuned:  # and one tuned with other drafter weights, once they are loaded
        check_tuned(cfg.tuned_from, {"drafter_sha256": run_setup(cfg.model, pair)["drafter_sha256"]})

    if is_peer(policy):  # another implementation runs in place of this engine (ldlp.bench.harness.peer.PeerSpec)
        policy.check(str(cfg.model.drafter_kind), sampling.greedy, policy_name)
        spec_runner = peer_runner(policy, pair)
        engine = policy.engine
    else:
        prepare_cost_tables([policy], pair.target, pair.candidates, None, 1)  # batch 1: one slot's costs
        decoder = EngineFactory(pair.target, pair.candidates).decoder(policy, profile=bool(ev.get("profile", False)))
        spec_runner = engine_runner(policy_name, decoder, sampling)
        engine = "ours"

    ar_key = config_key(cfg.model) + config_key(cfg.data) + f"{max_new_tokens}{sampling}"
    ar_info = choose_ar_baseline(pair.target, prompts, max_new_tokens, sampling, str(ev.ar_baseline),
                                 int(ev.calibration_prompts), ar_key)
    baseline = ar_runner(ar_info["impl"], pair.target, sampling)

    seed = int(cfg.seed)
    for _, prompt in prompts[: int(ev.warmup)]:  # warm-up: first calls allocate, later ones are what we time
        spec_runner.run(prompt, min(16, max_new_tokens), seed)
        baseline.run(prompt, min(16, max_new_tokens), seed)

    progress = progress_bar(repeats * len(questions), policy_name, bool(ev.get("progress", True)))
    dialogue = Dialogue(load_tokenizer_cached(cfg.model), questions.chat_template, cfg.data.get("max_prompt_tokens"),
                        pair.target.max_length, set(pair.target.eos_token_ids), pair.target.device)
    # one seeded random stream per question (all its turns), the same in every round: sampled outputs repeat too
    ar_runs, spec_runs = interleaved((baseline, spec_runner), questions, repeats,
                                     lambda runner, q, k, r: dialogue.run(runner, q, max_new_tokens, seed + k),
                                     order="alternate", after_item=lambda: progress.update(1))
    progress.close()
    spec_stats = [[t.stats for turns in row for t in turns] for row in spec_runs]
    ar_stats = [[t.stats for turns in row for t in turns] for row in ar_runs]
    spec_out = {t.prompt_id: t.tokens for turns in spec_runs[0] for t in turns}
    check = sampling.greedy and bool(ev.check_lossless)
    ref_runs = ar_runs
    if check and ar_info["impl"] != "transformers":
        # the target's own greedy decoding of these prompts does not depend on the policy: a sweep's jobs in one
        # process (a multirun) decode it once, not once per policy (it cost a third of each job's time)
        ref_key = (ar_key, seed)
        if ref_key not in _REFERENCE:
            _REFERENCE[ref_key] = [[dialogue.run(reference_runner(pair.target), q, max_new_tokens, seed + k)
                                    for k, q in enumerate(questions)]]
        ref_runs = _REFERENCE[ref_key]
    qrows = question_rows(questions, spec_runs, ar_runs, check, ref_runs)
    late = sum(r["n_dropped"] for r in qrows)  # later turns whose prompt, own answers included, is too long
    if late:
        prompt_info["n_dropped"] = prompt_info.get("n_dropped", 0) + late
        prompt_info["dropped_reason"] = (f"longer than max_prompt_tokens={cfg.data.get('max_prompt_tokens')} or "
                                         "the target's context (later turns: with the history)")
    by_category, all_categories = category_rows(qrows, questions.dropped_by_category)

    lossless, mismatches = None, []
    if check:
        ref_out = GreedyReference({t.prompt_id: t.tokens for turns in ref_runs[0] for t in turns})
        mismatches = ref_out.differing(spec_out, {t.prompt_id: t.tokens for turns in ar_runs[0] for t in turns})
        lossless = not mismatches
        if mismatches:
            log.warning("policy %s: %d outputs (speculative or AR) differ from the target's own greedy decoding "
                        "(prompts %s)", policy_name, len(mismatches), mismatches[:5])

    rounds = [total(row) for row in spec_stats]
    profiled = engine != "ours" or bool(ev.get("profile", False))
    ar_rounds = [total(row) for row in ar_stats]
    first = rounds[0]
    steps = max(1, first.target_forwards - 1)
    gamma = None if is_peer(policy) else policy.fixed_gamma
    result = {
        "policy": policy_name,
        "gamma": gamma,
        "dataset": str(cfg.data.get("name", Path(str(cfg.data.path)).stem)),
        "n_prompts": len(spec_stats[0]),  # prompts decoded: turns, when a question has several
        "n_questions": len(questions),
        "n_dropped": prompt_info.get("n_dropped", 0),  # prompts of the set left out, and why (next to n_prompts)
        "dropped_reason": prompt_info.get("dropped_reason"),
        "temperature": sampling.temperature,
        "new_tokens": first.new_tokens,
        "wall_s": median([x.wall_s for x in rounds]),
        "tokens_per_s": median([x.tokens_per_s for x in rounds]),
        "ar_tokens_per_s": median([x.tokens_per_s for x in ar_rounds]),
        "speedup": median([x.tokens_per_s / y.tokens_per_s for x, y in zip(rounds, ar_rounds) if y.tokens_per_s]),
        "tau": first.tau,
        "target_forwards": first.target_forwards,
        "drafted_tokens": first.drafted_tokens,
        "wasted_tokens": first.wasted_tokens,
        # per-component seconds: the engine's profiled mode (evaluation.profile=true), a peer's forward hooks
        "draft_s": median([x.draft_s for x in rounds]) if profiled else None,
        "target_s": median([x.target_s for x in rounds]) if profiled else None,
        "policy_s": median([x.policy_s for x in rounds]) if engine == "ours" and profiled else None,
        "lossless": lossless,
        # context for the table and for reruns
        "engine": engine,
        "model": str(cfg.model.get("name", "")),
        "drafter_kind": str(cfg.model.drafter_kind),
        "dtype": resolve_dtype(cfg.model.get("dtype"), str(cfg.model.get("device") or "cpu")),  # as loaded
        "data_path": str(cfg.data.path),
        **prompt_info,  # the prompt set's identity: data_path, data_sha256, limit, sample_seed, turns
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
        "policy_config": flat_pricing(OmegaConf.to_container(policy_cfg, resolve=True)),  # pricing keys as before
        "cost_table": None if is_peer(policy) else table_record(policy.pricing),  # the costs it planned with, if any
        "tuned_from": str(cfg.tuned_from) if tuned else None,
        # learned files made for another setup that accept_mismatch=true let drive this run, each as refused
        "accepted_mismatches": accepted_mismatches(),
        "seed": seed,
        "machine": machine_info(),
        # data.turns=all on MT-bench-format files: own_answers (later turns prompted with the model's own answers)
        "turn_mode": questions.mode,
        "by_category": by_category,  # per category: τ, tokens/s, speedup, Spec-Bench's figures, turns dropped
        "all_categories": all_categories,  # the same figures over every question (categories sum to it)
        # a Spec-Bench question.jsonl: its tasks, MT-bench's eight categories pooled as "mt_bench"; else empty
        "by_task": specbench_tasks(qrows, questions.dropped_by_category),
        "model_id": model_id(str(cfg.model.get("name", "")), policy_name, gamma),
        "ar_model_id": model_id(str(cfg.model.get("name", "")), "ar"),
    }
    if out_dir is not None:
        # answer files (FastChat's judge, Spec-Bench's speed.py): ldlp/bench/comparisons/answers.py
        result["answers"] = write_answers(qrows, out_dir, result["model_id"], result["ar_model_id"])
        write_results(result, out_dir)  # the per-category page: ldlp.report.categories.write_categories
    return result


def write_results(result: dict, out_dir: str | Path) -> Path:
    """``results.json`` in ``out_dir``, written atomically."""
    return atomic_write_json(Path(out_dir) / "results.json", result)


def one_line(result: dict) -> str:
    g = "" if result["gamma"] is None else f" γ={result['gamma']}"
    loss = {True: "lossless", False: "NOT LOSSLESS", None: "unchecked"}[result["lossless"]]
    return (f"{result['policy']}{g} [{result['model']}] on {result['dataset']} ({result['n_prompts']} prompts): "
            f"{result['tokens_per_s']:.1f} tok/s vs AR {result['ar_tokens_per_s']:.1f} = {result['speedup']:.2f}x, "
            f"τ={result['tau']:.2f}, wasted {result['wasted_tokens']}, {loss}")
