"""Head to head: a few policies timed in one process, prompt by prompt, with a paired comparison.

A sweep times every policy in its own run, minutes apart; on a shared machine the speed drifts by
more than the few percent that separate good draft-length policies, and the best of eight noisy
static rows is itself biased upwards. Here the contenders (say the static γ around the sweep's best
and the best adaptive policies) and the AR baseline take turns on every prompt, in a rotating order,
for several rounds. Under greedy decoding they all emit the same tokens, so the ratio of two
contenders' seconds on the same prompt in the same round is a paired measurement; the report gives
each contender's tokens/s, its ratio to the best static contender with a bootstrap 95% interval, and
in how many rounds it was faster. The bootstrap resamples prompts, each with all its rounds: a policy
gains on some prompts and loses on others, and repeating a prompt does not average that away.

:func:`ldlp.bench.comparisons.pool.pool` combines several such runs of the same contenders
(``scripts/pool_head_to_head.py``): the machine's speed, and with it the price of a target pass against a drafted token,
drifts between runs by more than one run's interval shows, so its interval resamples runs as well as prompts.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from eagle_backbone.cost import table_record
from eagle_backbone.runtime import int_setting, resolve_dtype
from eagle_backbone.timing import interleaved
from ldlp.bench.harness.loaders import (
    apply_tuned,
    build_policy,
    load_pair_cached,
    load_prompts,
    machine_info,
    prepare_cost_tables,
    sampling_config,
)
from ldlp.bench.comparisons.categories import runs_by_category
from ldlp.bench.comparisons.conversation import prompt_categories
from ldlp.bench.harness.engines import EngineFactory
from ldlp.bench.harness.identity import GreedyReference
from ldlp.bench.harness.runners import ar_runner, engine_runner, progress_bar
from ldlp.bench.harness.stats import best_adaptive, headroom_captured, paired_ratio
from ldlp.policies.pricing import flat_pricing

log = logging.getLogger(__name__)


def _label(name: str, policy) -> str:
    return f"static γ={policy.fixed_gamma}" if policy.fixed_gamma is not None else name


def _short(value) -> str:
    """A setting's value in a label: a path by its last two parts."""
    text = str(value)
    return "/".join(text.rstrip("/").split("/")[-2:]) if "/" in text else text


def head_to_head(cfg, contenders: list[tuple[str, object]], rounds: int = 5, bootstrap: int = 2000) -> dict:
    """``contenders``: (policy name, policy config) pairs; ``cfg`` as for
    :func:`ldlp.bench.comparisons.evaluate.evaluate` (model, data, generation, evaluation, seed, tuned_from). Greedy
    decoding only."""
    sampling = sampling_config(cfg.generation)
    if not sampling.greedy:
        raise ValueError("head to head compares greedy runs (their outputs coincide): set generation.temperature=0")
    if rounds < 1 or len(contenders) < 2:
        raise ValueError(f"head to head needs at least 2 contenders and 1 round, got {len(contenders)} and {rounds}")
    int_setting("generation.max_new_tokens", cfg.generation.max_new_tokens, 1)  # no page of NaN from no tokens
    from ldlp.bench.harness.loaders import load_tokenizer_cached, run_setup

    # the replay-tuned settings, before anything loads: a file tuned for another model, dtype or drafter kind is refused
    run = run_setup(cfg.model)
    contenders = [(name, apply_tuned(pcfg, cfg.get("tuned_from"), name, run)[0]) for name, pcfg in contenders]
    prompt_set = load_prompts(cfg.data, load_tokenizer_cached(cfg.model))  # the prompt file before the weights
    pair = load_pair_cached(cfg.model)
    prompts = [ids for _, ids in prompt_set]
    categories = prompt_categories(cfg.data, [pid for pid, _ in prompt_set])  # the file's, None where it has none
    n, seed = int(cfg.generation.max_new_tokens), int(cfg.seed)
    runners, labels, settings, adaptive, policies = [], [], [], [], []
    for name, pcfg in contenders:
        policy = build_policy(pcfg, cfg.model)
        prepare_cost_tables([policy], pair.target, pair.candidates, None, 1)  # batch 1: one slot's costs
        label = _label(name, policy)
        # its settings as the page names them: the pricing node's keys among the others (as they stood before it)
        setting = {k: v for k, v in flat_pricing(dict(pcfg)).items() if k != "_target_"}
        if label in labels:  # the same policy with other settings: named by what differs
            first = settings[labels.index(label)]
            diff = [k for k in setting if setting[k] != first.get(k)]
            if not diff:
                raise ValueError(f"contender {label!r} is listed twice")
            label += " (" + ", ".join(f"{k}={_short(setting[k])}" for k in diff[:2]) + ")"
        runners.append(engine_runner(label, EngineFactory(pair.target, pair.candidates).decoder(policy), sampling))
        policies.append(policy)
        labels.append(label)
        settings.append(setting)
        adaptive.append(policy.adaptive)
    names = [name for name, _ in contenders]
    if cfg.get("scripted_twins", False):
        _add_scripted_twins(pair, sampling, prompts, n, seed, runners, labels, settings, adaptive, policies, names)
    n_policies = len(runners)
    runners.append(ar_runner("ours", pair.target, sampling))
    labels.append("AR")
    for r in runners:  # warm-up
        r.run(prompts[0], min(16, n), seed)

    secs = np.zeros((len(runners), rounds, len(prompts)))
    own = np.zeros(len(runners))  # each runner's policy's own seconds (its plan, stop and observe calls)
    tokens = np.zeros((len(runners), len(prompts)), dtype=int)
    counts = np.zeros((len(runners), 2), dtype=int)  # target forwards, drafted tokens (deterministic: round 0)
    timed = []  # every speculative generation's stats: what a target pass and a drafted token cost here
    outputs: list[list] = [[None] * len(prompts) for _ in runners]
    chosen: list[list] = [[None] * len(prompts) for _ in runners]  # γ per step, round 0
    progress = progress_bar(rounds * len(prompts), "head to head", bool(cfg.evaluation.get("progress", True)))

    def turn(i, prompt, k, r):
        out, stats = runners[i].run(prompt, n, seed + k)
        secs[i, r, k] = stats.wall_s
        own[i] += stats.policy_s
        if r == 0:
            outputs[i][k], tokens[i, k] = out, stats.new_tokens
            counts[i] += (stats.target_forwards, stats.drafted_tokens)
            chosen[i][k] = list(stats.draft_lengths)
        if i < n_policies:
            timed.append(stats)

    # every runner takes every place in the order
    interleaved(range(len(runners)), prompts, rounds, turn, order="rotate", after_item=lambda: progress.update(1))
    progress.close()
    lossless = None
    if sampling.greedy:
        # against the target's own greedy decoding through transformers (untimed), AR included
        lossless = GreedyReference.of_target(pair.target, prompts, n).lossless(outputs)
        if not lossless:
            log.warning("head to head: some greedy outputs differ from the target's own greedy decoding")

    per_round = tokens.sum(1)[:, None] / secs.sum(2)  # tokens/s of each runner in each round
    overall = rounds * tokens.sum(1) / secs.sum((1, 2))  # every round emits the same tokens
    static = [i for i in range(n_policies) if adaptive[i] is False]  # a scripted twin (None) is neither
    ref = max(static, key=lambda i: overall[i]) if static else None  # the fastest static γ over all pairs
    # seconds of one runner over another's on the same pairs, prompts drawn with replacement (each with all its rounds)
    vs = lambda i, j: paired_ratio(None, secs[i], None, secs[j], bootstrap, seed, tails=(0.025, 0.975))  # noqa: E731
    rows = []
    for i, label in enumerate(labels):
        row = {"contender": label, "policy": names[i] if i < n_policies else "ar",
               "adaptive": adaptive[i] if i < n_policies else None,
               "setting": settings[i] if i < n_policies else None,
               "tokens_per_s": float(overall[i]), "speedup": float(overall[i] / overall[-1]),
               "tokens_per_s_rounds": per_round[i].tolist(), "tau": float(tokens[i].sum() / counts[i, 0]),
               "policy_share": float(own[i] / secs[i].sum()),
               "drafted_tokens": int(counts[i, 1]),
               "wasted_tokens": int(counts[i, 1] - (tokens[i].sum() - counts[i, 0]))}
        if ref is not None and i != ref and i < n_policies:
            # seconds of the reference over seconds of this contender on the same pairs: > 1 means faster
            r = vs(i, ref)
            row.update(vs_best_static=r["ratio"], ci95=r["ci95"],
                       rounds_faster=int((secs[i].sum(1) < secs[ref].sum(1)).sum()))
        if i < n_policies and "twin_of" in (settings[i] or {}):
            j = labels.index(settings[i]["twin_of"])  # its policy's seconds over the twin's: its own calls' cost
            r = vs(i, j)
            row["twin"] = {"of": labels[j], "seconds_ratio": r["ratio"], "ci95": r["ci95"],
                           "same_choices": float(np.mean([chosen[j][k] == chosen[i][k] for k in range(len(prompts))]))}
        rows.append(row)
    for row, by in zip(rows, runs_by_category(categories, secs, tokens)):
        if by:  # per category: tokens, seconds per round, tokens/s, speedup over AR
            row["by_category"] = by
    result = {"rows": rows, "reference": labels[ref] if ref is not None else None, "rounds": rounds,
              "n_prompts": len(prompts), **dict(getattr(prompt_set, "info", {})), "max_new_tokens": n, "new_tokens": int(tokens[-1].sum()),
              "lossless": lossless, "tuned_from": str(cfg.get("tuned_from")) if cfg.get("tuned_from") else None,
              "dataset": str(cfg.data.get("name", Path(str(cfg.data.path)).stem)), "machine": machine_info(),
              "model": str(cfg.model.get("name", "")), "labels": labels,
              "dtype": resolve_dtype(cfg.model.get("dtype"), str(cfg.model.get("device") or "cpu")), "seconds": secs.tolist(),
              "tokens": tokens.tolist(), "categories": categories, "costs": _costs(timed),
              # per contender, the key and file of the step-cost table it planned with (load-aware policies)
              "cost_tables": {lab: t for lab, t in zip(labels, (table_record(p.pricing) for p in policies)) if t is not None}}
    result.update(verdict(result))
    return result


def _add_scripted_twins(pair, sampling, prompts, n, seed, runners, labels, settings, adaptive, policies, names):
    """Each adaptive contender's γ choices, recorded in an untimed pass over the prompts, replayed by a
    :class:`~ldlp.policies.scripted.ScriptedPolicy` that takes turns beside it: the pair splits its gain into
    what its choices earn and what its own time costs."""
    from ldlp.policies.scripted import ScriptedPolicy

    for i in [i for i in range(len(runners)) if adaptive[i]]:
        scripts = {tuple(int(t) for t in p): list(runners[i].run(p, n, seed + k)[1].draft_lengths)
                   for k, p in enumerate(prompts)}
        twin = ScriptedPolicy(scripts, max(max(g, default=0) for g in scripts.values()))
        label = f"{labels[i]}: its choices, scripted"
        runners.append(engine_runner(label, EngineFactory(pair.target, pair.candidates).decoder(twin), sampling))
        labels.append(label)
        settings.append({"twin_of": labels[i]})
        adaptive.append(None)  # a control: neither the best static nor the best adaptive
        policies.append(twin)
        names.append("scripted")


def _costs(stats) -> dict | None:
    """Milliseconds per target pass, drafted token and accepted token, fitted to the timed generations (a linear
    cost table, :func:`ldlp.bench.harness.replay.fit_costs`, in the comparison's own setting); None when they cannot
    separate."""
    from ldlp.bench.harness.replay import fit_costs

    try:
        return dict(fit_costs(stats).meta["linear"])
    except ValueError:
        return None


def verdict(result: dict) -> dict:
    """The best adaptive contender (the oracle is not one) against the best static one, and the share of
    the oracle's headroom over the best static contender that it captures (when the oracle ran)."""
    rows = result["rows"]
    best, out = best_adaptive(rows, "vs_best_static")
    if best is None:
        return {}
    ref = next(r for r in rows if r["contender"] == result["reference"])
    oracle = next((r for r in rows if r["policy"] == "oracle"), None)
    captured = headroom_captured(best["tokens_per_s"], ref["tokens_per_s"], oracle and oracle["tokens_per_s"])
    if captured is not None:
        out["headroom_captured"] = captured
    return out
