"""The concurrency sweep behind ``scripts/bench_batch.py``: tokens/s and latencies of batched AR, static γ
and adaptive policies at concurrency C, on a continuous-batching workload, with greedy losslessness.

For every round, every temperature T, every C and every block of the prompts (``blocks`` workloads, fewer
when a block would hold fewer prompts than C), every contender runs the block through
:func:`~ldlp.bench.workload.run_workload` with C streams in flight, in turns (the order rotating
between rounds, T, C and blocks, so that a slow phase of a shared machine hits all alike). Every contender
runs on the one engine (:class:`~eagle_backbone.engine.BatchedSpeculativeEngine`) with one candidate
generator. Rows report each round's blocks summed, medians over rounds.

Each (round, block) is one paired measurement: per (C, T) every adaptive contender's ratio of tokens/s to
the baselines (batched AR, the best static γ at that (C, T) in hindsight, the static γ best at C=1 used at
every C, the oracle at T=0) comes with a paired bootstrap 95% interval over those pairs
(:func:`eagle_backbone.timing.paired_ratio`). The oracle replays the engine with one slot
(``SpeculativeDecoder``) per prompt before the clocks start and runs at T=0 only; so does the batched oracle
(``policy=oracle_budget``, :mod:`ldlp.policies.oracles`), whose gain over the best static γ at each C the findings
report as the headroom (``oracle_headroom``).

Per step: target-scored tokens per engine step (all rows, and per running row) from the timed runs' host
counters (:func:`step_counters`), and with ``profile_steps`` verify and draft milliseconds per step from one
untimed profiled pass per contender at every (C, T) after the timed rounds (:func:`profile_pass`).

Greedy losslessness is checked against each prompt's own greedy output from the target through transformers'
forward (:meth:`~eagle_backbone.target.TargetModel.reference_greedy`, independent of the engine). In bfloat16
a batched matrix product may round differently from a one-row one; every differing sequence is then
reported with the target's top-2 logit gap at the first differing position (on the reference prefix),
next to bfloat16's spacing at that logit's magnitude: a difference is a near-tie when the gap is within it.

This module takes built models, prompts and policy factories; loading them from configs is the script's.
matplotlib is imported only to draw the plots.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ldlp.bench.peer_rows import PEER_POLICIES, peer_lines
from ldlp.bench.stats import headroom_captured
from eagle_backbone.cost import table_record
from ldlp.bench.workload import run_workload
from eagle_backbone.engine import BatchedSpeculativeEngine
from eagle_backbone.errors import ConfigError
from eagle_backbone.io import atomic_path, atomic_write_json, atomic_write_text
from eagle_backbone.policy import DraftPolicy, Rows
from eagle_backbone.runtime import set_threads
from eagle_backbone.sampling import SamplingConfig
from eagle_backbone.step_cost import OnlineCostModel, StepRecord
from ldlp.bench import step_costs as step_cost_page
from ldlp.bench.step_costs import hindsight_model, run_step_costs, step_cost_rows

ROW_KEYS = ("contender", "policy", "gamma", "concurrency", "temperature", "tokens_per_s", "tokens_per_cpu_s",
            "token_latency_ms_mean", "token_latency_ms_p90", "request_latency_ms_mean", "request_latency_ms_p90",
            "tau", "lossless", "identical", "n_prompts", "new_tokens", "rounds", "blocks", "speedup_vs_ar", "vs", "policy_share",
            "by_category", "scored_per_step", "scored_per_row_step", "rows_per_step", "verify_ms_per_step",
            "draft_ms_per_step", "profile")
# the timed runs' step counters (this engine only; summed over a round's blocks): engine steps (speculative steps,
# a prefill-only step not counted), row-steps (a running sequence's share of a step) and target-scored tokens
STEP_COUNTERS = ("engine_steps", "row_steps", "scored_tokens")


@dataclass
class Contender:
    label: str  # "ar", "static γ=3", "heuristic", ...
    policy: str  # "ar", "static" or the policy's name
    gamma: int | None  # static γ; None when adaptive (and 0 for AR)
    make: Callable | None  # zero-argument policy factory (one instance per slot); None: AR
    runner: object | None = None  # a peer engine's runner (vLLM; ldlp/bench/peer_rows.py); None: this engine


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def near_tie(target, prompt, ref, got) -> dict:
    """The target's top-2 logit gap at the first position where ``got`` leaves ``ref`` (one forward of
    the reference prefix, as plain decoding computes it), and the dtype's spacing at the top logit."""
    i = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    if i >= len(ref) or i >= len(got):
        return {"position": i, "gap": None, "spacing": None, "near_tie": False, "note": "length differs only"}
    with torch.inference_mode():
        logits, _ = target(torch.tensor([prompt + ref[:i]], device=target.device))
    top = torch.topk(logits[0, -1].float(), 2)
    gap = float(top.values[0] - top.values[1])
    eps = torch.finfo(target.dtype).eps  # 2^-mantissa bits: 2^-7 for bfloat16, 2^-23 for float32
    spacing = 2.0 ** math.floor(math.log2(max(abs(float(top.values[0])), 1e-30))) * eps
    return {"position": i, "ref_token": ref[i], "got_token": got[i], "gap": gap, "spacing": spacing,
            "near_tie": gap <= 2 * spacing}


def split_blocks(n: int, concurrency: int, blocks: int) -> list[list[int]]:
    """Prompt indices of the workloads at one C: ``blocks`` parts (prompt i in part i mod k), fewer when a part
    would hold fewer prompts than C streams (k = min(blocks, n // C), at least 1): a workload of fewer
    prompts than C never has C sequences in flight."""
    k = max(1, min(blocks, n // concurrency))
    return [list(range(b, n, k)) for b in range(k)]


class _ReplayedOracle(DraftPolicy):
    """A bound policy (the oracle) whose ``begin`` replays the engine with one slot: the replays run once per
    prompt before any clock starts (:func:`_prepare_bound`), and each slot only looks its prompt up, as the
    batch-1 evaluation leaves the replay out of the timing.

    ``planner``: a fresh instance of the contender's policy that turns the rows' looked-up accepted lengths into
    the step's γ (its ``plan_lengths(rows, lengths)``: the batched oracle, ``policy=oracle_budget``, spends them by
    its cost table); it is bound to each engine and observes its steps. None: γ = the accepted length (the
    chain oracle)."""

    name = "oracle"

    def __init__(self, done: dict, make: Callable, planner: DraftPolicy | None = None):
        self.done, self.make, self.by_slot, self.planner = done, make, {}, planner
        if planner is not None:
            self.name = planner.name

    @property
    def costs(self):
        """The planner's cost table (what :func:`~eagle_backbone.cost.table_record` reports), if any."""
        return getattr(self.planner, "costs", None)

    def bind_engine(self, engine) -> None:
        if self.planner is not None:
            self.planner.bind_engine(engine)

    def begin(self, slot: int, prompt_ids) -> None:
        key = tuple(prompt_ids)
        if key not in self.done:  # a prompt not prepared (e.g. a warm-up's shorter budget): replay it now
            self.done[key] = self.make(prompt_ids)
        self.by_slot[slot] = self.done[key]

    def plan(self, rows: Rows) -> list[int]:
        lengths = [self.by_slot[b].drafts_at(0, p) for b, p in zip(rows.slots, rows.positions)]
        return lengths if self.planner is None else self.planner.plan_lengths(rows, lengths)

    def observe(self, rows: Rows, drafted: list[int], accepted: list[int], extra=None) -> None:
        if self.planner is not None:
            self.planner.observe(rows, drafted, accepted, extra)


def _prepare_bound(c: Contender, target, candidates, prompts, max_new_tokens, sampling) -> Contender:
    """A contender whose policy needs ``bind`` (the oracles): bind one instance per prompt to the candidate
    generator and run its ``begin`` now; the slots' policies share the results. A policy with
    ``plan_lengths`` (the batched oracle) also plans each engine's steps from them (:class:`_ReplayedOracle`)."""
    def one(prompt):
        pol = c.make()
        pol.bind(target, candidates, max_new_tokens, sampling)
        pol.begin(0, prompt)  # its counts for this prompt, kept under slot 0
        return pol

    done = {}
    for p in prompts:
        if tuple(p) not in done:
            done[tuple(p)] = one(p)
    plans = hasattr(next(iter(done.values())), "plan_lengths")
    return Contender(c.label, c.policy, c.gamma,
                     lambda: _ReplayedOracle(done, one, c.make() if plans else None))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def prompts_meta(prompt_set, concurrency, blocks: int) -> dict:
    """What a result's header says about its prompts: the file, its SHA-256 and the prompts dropped for length (as
    evaluate.py records them), and the blocks the run makes at each C (:func:`split_blocks`: fewer than asked
    where a block would hold fewer prompts than C), so the header agrees with the rows' ``blocks``."""
    info = dict(getattr(prompt_set, "info", {}) or {})
    n = len(prompt_set)
    return {"data_path": info.get("data_path"), "data_sha256": info.get("data_sha256"),
            "n_dropped": int(info.get("n_dropped") or 0), "dropped_reason": info.get("dropped_reason"),
            "blocks_asked": int(blocks), "blocks": {int(c): len(split_blocks(n, int(c), int(blocks))) for c in concurrency}}


def check_sweep_args(concurrency, temperatures=None, blocks: int = 1, rounds: int = 1, max_new_tokens: int = 1,
                     bootstrap: int = 0) -> list[float] | None:
    """One ConfigError line for a bad sweep setting, checked on the raw values (a 1.5 is refused, not
    truncated; a repeated value is refused, not merged) before any model loads; returns the temperatures
    as floats (None when none are given: the generation's own)."""
    concurrency = list(concurrency)
    if not concurrency or any(not _is_int(c) or c < 1 for c in concurrency):
        raise ConfigError(f"concurrency values must be integers >= 1, got {concurrency}")
    if len(set(concurrency)) != len(concurrency):
        raise ConfigError(f"concurrency={concurrency} repeats a value: give each C once")
    if not _is_int(blocks) or blocks < 1:
        raise ConfigError(f"blocks must be an integer >= 1, got {blocks!r}")
    if not _is_int(rounds) or rounds < 1:
        raise ConfigError(f"rounds must be an integer >= 1, got {rounds!r} (a run of no rounds measures nothing)")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ConfigError(f"generation.max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not _is_int(bootstrap) or bootstrap < 0:
        raise ConfigError(f"bootstrap must be an integer >= 0, got {bootstrap!r}")
    if temperatures is None or len(temperatures) == 0:
        return None
    if any(isinstance(t, bool) or not isinstance(t, (int, float)) for t in temperatures):
        raise ConfigError(f"temperatures must be numbers >= 0, got {list(temperatures)}")
    temps = [float(t) for t in temperatures]
    if any(not t >= 0 for t in temps) or len(set(temps)) != len(temps):
        raise ConfigError(f"temperatures must be distinct numbers >= 0, got {temps}")
    return temps


def draft_cap(max_new_tokens: int) -> int:
    """The most drafts the engine scores in one step with this budget: the engine's ``max_draft`` and the
    tokens left after the one the target adds (``max_new_tokens - 1``)."""
    import inspect

    max_draft = inspect.signature(BatchedSpeculativeEngine.__init__).parameters["max_draft"].default
    return max(0, min(int(max_draft), int(max_new_tokens) - 1))


def check_contenders(contenders: list[Contender], max_new_tokens: int) -> None:
    """One ConfigError line for contenders that cannot be told apart (the same label twice) or a static γ the
    engine never drafts that far (above :func:`draft_cap`): such a row would be reported as measured."""
    seen = set()
    for c in contenders:
        if c.label in seen:
            raise ConfigError(f"contenders: {c.label} is given twice; give each contender once")
        seen.add(c.label)
    cap = draft_cap(max_new_tokens)
    over = [c.label for c in contenders if c.policy == "static" and c.gamma is not None and c.gamma > cap]
    if over:
        raise ConfigError(f"contenders: {', '.join(over)} above the engine's draft cap γ={cap} with "
                          f"generation.max_new_tokens={max_new_tokens} (the engine never drafts that far): "
                          "drop them or raise generation.max_new_tokens")


def sweep(target, candidates, prompts: list[list[int]], contenders: list[Contender],
          concurrency: list[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
          rounds: int = 2, seed: int = 0, attn: str = "eager",
          checkpoint: Callable[[dict], None] | None = None, log: Callable[[str], None] = print,
          categories: list | None = None, temperatures: list[float] | None = None, blocks: int = 1,
          bootstrap: int = 2000, profile_steps: bool = False) -> dict:
    """Run the sweep over temperature T and concurrency C on ``target`` with ``candidates`` (a
    :class:`~eagle_backbone.candidates.CandidateGenerator`, e.g. ``pair.candidates``; None: no drafts, every
    contender then decodes as batched AR); returns {"rows": [...], "differences": [...],
    "runs": [...], "skipped": [...]} (``checkpoint`` gets the partial result after every (T, C)).

    ``temperatures``: the T to sweep (default: ``sampling``'s alone; top-k and top-p stay ``sampling``'s).
    ``blocks``: at each C the prompts are split into this many workloads (:func:`split_blocks`), each run by
    every contender in turn, so each (round, block) gives one paired ratio of tokens/s between contenders;
    rows carry ratios to the baselines with paired bootstrap intervals over those pairs (``bootstrap``
    draws). ``categories`` (one per prompt, None where a prompt has none) adds each
    batched run's per-category counters and request latency (``by_category``). A contender whose policy
    needs ``bind`` (the oracle) runs at T=0 only, bound to ``candidates``. ``attn``: the target's attention math
    in the engine (a generator keeps its own).

    Every row carries the timed runs' step counters (first round): target-scored tokens per engine step
    (``scored_per_step``: all rows; ``scored_per_row_step``: per running sequence, d + 1 for d drafts scored)
    and running rows per step. ``profile_steps``: after the timed rounds, one untimed pass of the engine's
    profiled mode per contender at every (C, T) on the first block (:func:`profile_pass`), whose component
    seconds per engine step give ``verify_ms_per_step``, ``draft_ms_per_step`` and ``profile`` (``profiles``
    in the result)."""
    if categories is not None and len(categories) != len(prompts):
        raise ValueError(f"{len(categories)} categories for {len(prompts)} prompts: give one per prompt")
    sampling = sampling or SamplingConfig()
    temps = check_sweep_args(concurrency, temperatures, blocks, rounds, max_new_tokens, bootstrap) or [
        float(sampling.temperature)]
    check_contenders(contenders, max_new_tokens)
    if not prompts:
        raise ValueError("no prompts to benchmark")
    if not contenders or contenders[0].policy != "ar":
        raise ValueError("the first contender must be batched AR (policy 'ar')")
    capacity = max(len(p) for p in prompts) + max_new_tokens + 2
    seeds = [seed + i for i in range(len(prompts))]
    # policies that replay the engine with one slot in begin() (the oracle): bind(target, candidates, ...) first;
    # a batch-level policy (one instance deciding for all slots) is the engine's to handle
    probes = {c.label: c.make() for c in contenders if c.make is not None}
    bound = {k for k, p in probes.items() if hasattr(p, "bind") and not getattr(p, "batch_level", False)}
    skipped = []
    per_t = {}  # T -> (sampling, contenders, reference outputs)
    for T in temps:
        samp = replace(sampling, temperature=T)
        cs = []
        for c in contenders:
            if c.label in bound and not samp.greedy:
                skipped.append({"contender": c.label, "temperature": T, "why": "defined for greedy decoding only"})
                log(f"skipping {c.label} at T={T}: it is defined for greedy decoding (T=0) only")
            elif c.label in bound and candidates is None:
                skipped.append({"contender": c.label, "temperature": T, "why": "needs a candidate generator"})
                log(f"skipping {c.label}: its policy replays speculative decoding and no candidate generator was given")
            elif c.label in bound:
                log(f"{c.label}: replaying the engine with one slot on {len(prompts)} prompts (untimed)")
                cs.append(_prepare_bound(c, target, candidates, prompts, max_new_tokens, samp))
            else:
                cs.append(c)
        ref = None
        if samp.greedy:
            log(f"reference: the target's own greedy outputs of {len(prompts)} prompts (transformers' forward)")
            ref = [target.reference_greedy(p, max_new_tokens) for p in prompts]
        per_t[T] = (samp, cs, ref)
        # warm up kernels and allocators once per contender
        for c in cs:
            if c.runner is not None:  # a peer warms up its own engine at each C
                continue
            e = BatchedSpeculativeEngine(target, candidates, slots=2, policy=c.make, sampling=samp,
                                         capacity=capacity, attn=attn)
            run_workload(e, prompts[:2], 2, min(8, max_new_tokens), seeds[:2])
    runs = []
    diffs = {}
    with_cats = categories is not None and any(c is not None for c in categories)
    cost_tables = {}  # contender -> the cost table its batch policy planned with (key and path)
    profiles: list[dict] = []  # the untimed profiled pass (profile_steps), after every timed round
    # each contender's online step-cost model, kept across its runs as a server's engine keeps learning (a
    # cost-driven policy warm-starts it from its table and plans with it; for the others it only predicts)
    cost_models: dict[str, OnlineCostModel] = {}
    records: list[StepRecord] = []  # every timed step of this engine, for the costs measured in hindsight
    result = {"rows": [], "differences": [], "runs": runs, "skipped": skipped, "rounds_done": 0, "rounds": rounds,
              "complete": False, "cost_tables": cost_tables, "profiles": profiles}
    for r in range(rounds):
        for ti, T in enumerate(temps):
            samp, cs, ref = per_t[T]
            for ci, C in enumerate(concurrency):
                parts = split_blocks(len(prompts), C, blocks)
                if r == 0 and len(parts) < blocks:
                    log(f"C={C}: {len(parts)} block(s) of >= {C} prompts (of {blocks} asked): "
                        f"{len(prompts)} prompts cannot fill more")
                for bi, idx in enumerate(parts):
                    ps, sd = [prompts[i] for i in idx], [seeds[i] for i in idx]
                    k = (r + ti + ci + bi) % len(cs)
                    for c in cs[k:] + cs[:k]:
                        if c.runner is not None:  # a peer engine: the same block, budget, seeds, sampling, stops
                            outs, summ = c.runner.run(ps, C, max_new_tokens, sd, samp, target.eos_token_ids)
                        else:
                            model = cost_models.setdefault(c.label, OnlineCostModel())
                            age = model.seen
                            eng = BatchedSpeculativeEngine(target, candidates, slots=C, policy=c.make,
                                                           sampling=samp, capacity=capacity, attn=attn,
                                                           cost_model=model)
                            res = run_workload(eng, ps, C, max_new_tokens, sd)
                            outs, summ = [o.tokens for o in res.outputs], res.summary()
                            summ["step_costs"] = run_step_costs(eng.step_log, age)
                            records.extend(eng.step_log)
                            summ["policy_s"] = eng.policy_s  # the policy's own seconds in the run
                            summ.update(step_counters(res.outputs, eng.steps))
                            used = table_record(eng.policy)
                            if used is not None and c.label not in cost_tables:
                                cost_tables[c.label] = used
                            if with_cats:
                                summ["by_category"] = res.by_category([categories[i] for i in idx])
                        same = None
                        if ref is not None:
                            same = [o == ref[i] for o, i in zip(outs, idx)]
                            for o, i, ok in zip(outs, idx, same):
                                if not ok and (c.label, C, i) not in diffs:
                                    diffs[(c.label, C, i)] = {
                                        "contender": c.label, "concurrency": C, "prompt": i,
                                        **near_tie(target, prompts[i], ref[i], o)}
                        runs.append({"round": r, "block": bi, "contender": c.label,
                                     "policy": c.policy, "gamma": c.gamma, "concurrency": C, "temperature": T,
                                     "n_prompts": len(idx), **summ, "identical": None if same is None else sum(same)})
                        log(f"round {r} T={T:g} C={C:>2} block {bi} {c.label:<14} "
                            f"{summ['tokens_per_s']:7.1f} tok/s tau {summ['tau']:.2f}"
                            + ("" if same is None else f" identical {sum(same)}/{len(same)}"))
                result = {"rows": aggregate_runs(runs, contenders, sampling, len(prompts), bootstrap=bootstrap,
                                                 seed=seed),
                          "differences": list(diffs.values()), "runs": runs, "skipped": skipped,
                          "rounds_done": r + (ti * len(concurrency) + ci + 1) / (len(temps) * len(concurrency)),
                          "rounds": rounds, "complete": False, "cost_tables": cost_tables, "profiles": profiles,
                          "step_costs": step_cost_rows(runs)}
                if checkpoint:  # after every (T, C): a stopped run still leaves its measured rows, marked incomplete
                    checkpoint(result)
    if profile_steps:  # untimed, after the timed rounds (never interleaved with them)
        for T in temps:
            samp, cs, _ = per_t[T]
            for C in concurrency:
                idx = split_blocks(len(prompts), C, blocks)[0]
                for c in cs:
                    if c.runner is not None:  # a peer engine has no profiled mode here
                        continue
                    profiles.append({"contender": c.label, "policy": c.policy, "concurrency": C, "temperature": T,
                                     **profile_pass(target, candidates, [prompts[i] for i in idx], c.make, C,
                                                    max_new_tokens, samp, [seeds[i] for i in idx], capacity, attn)})
                    log(f"profiled T={T:g} C={C:>2} {c.label:<14} " + ", ".join(
                        f"{k} {v:.2f}" for k, v in profiles[-1]["ms_per_step"].items()) + " ms/step")
                result = dict(result, rows=aggregate_runs(runs, contenders, sampling, len(prompts), bootstrap=bootstrap,
                                                          seed=seed, profiles=profiles))
                if checkpoint:
                    checkpoint(result)
    result["complete"] = True
    result["step_costs"] = step_cost_rows(runs)
    if records:
        result["hindsight"] = hindsight_model(records)
    return result


def step_counters(outputs, engine_steps: int) -> dict:
    """A run's step counters from what the host already holds (no device read): ``engine_steps`` (the engine's
    speculative steps), ``row_steps`` (running sequences summed over those steps: one draft length each) and
    ``scored_tokens`` (what the target scored: each row-step's drafts, or scored tree nodes, plus its last token)."""
    lengths = [d for o in outputs for d in o.stats.draft_lengths]
    return {"engine_steps": int(engine_steps), "row_steps": len(lengths), "scored_tokens": sum(lengths) + len(lengths)}


@torch.inference_mode()
def profile_pass(target, candidates, prompts, make_policy, concurrency: int, max_new_tokens: int,
                 sampling: SamplingConfig, seeds: list[int], capacity: int, attn: str = "eager") -> dict:
    """One untimed run of ``prompts`` in the engine's profiled mode (a clock reading, or on a GPU a CUDA event,
    at every phase; never in the timed runs): the seconds of each component (draft, policy, verify, prefill,
    read, host), the engine's steps, and the milliseconds per engine step of each component."""
    eng = BatchedSpeculativeEngine(target, candidates, slots=concurrency, policy=make_policy, sampling=sampling,
                                   capacity=capacity, attn=attn, profile=True)
    res = run_workload(eng, prompts, concurrency, max_new_tokens, seeds)
    steps = eng.steps
    secs = dict(eng.prof.s)
    return {"n_prompts": len(prompts), "new_tokens": res.new_tokens, "steps": steps,
            "seconds": {k: round(v, 6) for k, v in secs.items()},
            "ms_per_step": {k: 1e3 * v / steps for k, v in secs.items()} if steps else {}}


def _combine(xs: list[dict]) -> dict:
    """One round's blocks as one run: tokens, seconds and counters summed, τ and tokens/s recomputed,
    latencies averaged over the blocks weighted by their prompts (p90s: the blocks' median)."""
    tok = sum(x["new_tokens"] for x in xs)
    n = sum(x.get("n_prompts", 1) for x in xs)
    out = {"new_tokens": tok, "n_prompts": n}
    wall = sum(x.get("wall_s", 0.0) or 0.0 for x in xs)
    cpu = sum(x.get("cpu_s", 0.0) or 0.0 for x in xs)
    out["wall_s"] = wall
    own = [x["policy_s"] for x in xs if x.get("policy_s") is not None]
    out["policy_share"] = sum(own) / wall if own and wall > 0 else None  # the policy's own time / the run's
    out["tokens_per_s"] = tok / wall if wall > 0 else _median([x["tokens_per_s"] for x in xs])
    out["tokens_per_cpu_s"] = tok / cpu if cpu > 0 else _median([x.get("tokens_per_cpu_s") for x in xs])
    forwards = sum(x["new_tokens"] / x["tau"] for x in xs if x.get("tau"))
    out["tau"] = tok / forwards if forwards else None
    for m in ("token_latency_ms_mean", "request_latency_ms_mean"):
        vals = [(x.get(m), x.get("n_prompts", 1)) for x in xs if x.get(m) is not None]
        out[m] = sum(v * w for v, w in vals) / sum(w for _, w in vals) if vals else None
    for m in ("token_latency_ms_p90", "request_latency_ms_p90"):
        out[m] = _median([x.get(m) for x in xs])
    ident = [x.get("identical") for x in xs]
    out["identical"] = None if None in ident else sum(ident)
    for k in STEP_COUNTERS:  # this engine's rows only (a peer has none)
        out[k] = sum(x[k] for x in xs) if all(x.get(k) is not None for x in xs) else None
    cats = [x["by_category"] for x in xs if x.get("by_category")]
    if cats:
        merged: dict[str, dict] = {}
        for bc in cats:
            for cat, v in bc.items():
                m = merged.setdefault(cat, {"n_prompts": 0, "new_tokens": 0, "target_forwards": 0, "_lat": 0.0})
                m["n_prompts"] += v["n_prompts"]
                m["new_tokens"] += v["new_tokens"]
                m["target_forwards"] += v["target_forwards"]
                m["_lat"] += v["request_latency_ms_mean"] * v["n_prompts"]
        out["by_category"] = {cat: {"n_prompts": m["n_prompts"], "new_tokens": m["new_tokens"],
                                    "target_forwards": m["target_forwards"],
                                    "tau": m["new_tokens"] / m["target_forwards"] if m["target_forwards"] else 0.0,
                                    "request_latency_ms_mean": m["_lat"] / m["n_prompts"] if m["n_prompts"] else 0.0}
                              for cat, m in merged.items()}
    return out


BASELINES = ("ar", "best_static", "batch1_static", "oracle")
ORACLES = {"oracle": "chain oracle", "oracle_budget": "batched oracle"}  # policy -> what the findings call it
BASELINE_TITLES = {"ar": "batched AR", "best_static": "best static γ at (C, T)",
                   "batch1_static": "batch-1 best static γ", "oracle": "oracle"}


def aggregate_runs(runs: list[dict], contenders: list[Contender], sampling: SamplingConfig, n_prompts: int,
                   bootstrap: int = 2000, seed: int = 0, profiles: list[dict] | None = None) -> list[dict]:
    """One row per (contender, C, T): each round's blocks combined (:func:`_combine`), then the median
    over rounds (counters: the first round's, with the scored tokens per step); the profiled pass's milliseconds
    per step where ``profiles`` has the cell; and for adaptive contenders the paired ratios to the
    baselines (:func:`baselines`, :func:`eagle_backbone.timing.paired_ratio`)."""
    keys = []
    for x in runs:
        k = (x["contender"], x["concurrency"], x.get("temperature", sampling.temperature))
        if k not in keys:
            keys.append(k)
    rows = []
    for label, C, T in keys:
        xs = [x for x in runs if (x["contender"], x["concurrency"], x.get("temperature", sampling.temperature))
              == (label, C, T)]
        by_round = {}
        for x in xs:
            by_round.setdefault(x["round"], []).append(x)
        per_round = [_combine(v) for v in by_round.values()]
        first = per_round[0]
        ident = [x["identical"] for x in per_round]
        n = first["n_prompts"] if all("n_prompts" in x for x in xs) else n_prompts
        row = {"contender": label, "policy": xs[0]["policy"], "gamma": xs[0]["gamma"], "concurrency": C, "temperature": T,
               "n_prompts": n, "rounds": len(per_round), "blocks": len({x.get("block", 0) for x in xs}),
               "tau": first["tau"], "new_tokens": first["new_tokens"],
               "identical": None if None in ident else min(ident),
               "lossless": None if None in ident else all(i == n for i in ident)}
        for m in ("tokens_per_s", "tokens_per_cpu_s", "token_latency_ms_mean", "token_latency_ms_p90", "request_latency_ms_mean",
                  "request_latency_ms_p90", "policy_share"):
            row[m] = _median([x.get(m) for x in per_round])
        steps, row_steps, scored = (first.get(k) for k in STEP_COUNTERS)  # deterministic: the first round's
        row["scored_per_step"] = scored / steps if steps else None
        row["scored_per_row_step"] = scored / row_steps if row_steps else None
        row["rows_per_step"] = row_steps / steps if steps else None
        prof = next((p for p in profiles or [] if (p["contender"], p["concurrency"], p["temperature"]) == (label, C, T)),
                    None)
        row["profile"] = None if prof is None else {k: prof[k] for k in ("n_prompts", "steps", "ms_per_step")}
        row["verify_ms_per_step"] = None if prof is None else prof["ms_per_step"].get("verify")
        row["draft_ms_per_step"] = None if prof is None else prof["ms_per_step"].get("draft", 0.0)
        if first.get("by_category"):  # counters are the first round's (deterministic), latency the rounds' median
            row["by_category"] = {cat: dict(v, request_latency_ms_mean=_median(
                [x["by_category"][cat]["request_latency_ms_mean"] for x in per_round if cat in x.get("by_category", {})]))
                for cat, v in first["by_category"].items()}
        rows.append(row)
    for row in rows:
        ar = next((r for r in rows if r["policy"] == "ar"
                   and r["concurrency"] == row["concurrency"] and r["temperature"] == row["temperature"]), None)
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar["tokens_per_s"] if ar and ar["tokens_per_s"] else None
    # the one paired bootstrap of the project's comparisons
    from eagle_backbone.timing import paired_ratio

    base = baselines(rows)
    for row in rows:
        if row["policy"] in ("ar", "static", *PEER_POLICIES):
            continue
        b = base.get((row["temperature"], row["concurrency"]), {})
        vs = {}
        for name in BASELINES:
            ref = b.get(name)
            if ref is None or ref["contender"] == row["contender"]:
                continue
            mine, theirs = _pairs(runs, row["contender"], row), _pairs(runs, ref["contender"], row)
            common = sorted(set(mine) & set(theirs))
            if not common:
                continue
            stat = paired_ratio([mine[k][0] for k in common], [mine[k][1] for k in common],
                                [theirs[k][0] for k in common], [theirs[k][1] for k in common],
                                bootstrap=bootstrap, seed=seed)
            vs[name] = {"contender": ref["contender"], "gamma": ref.get("gamma"), **stat}
        row["vs"] = vs
    return rows


def _pairs(runs: list[dict], label: str, at: dict) -> dict:
    """{(round, block): (new tokens, wall seconds)} of a contender at ``at``'s C and T."""
    return {(x["round"], x.get("block", 0)): (x["new_tokens"], x["wall_s"]) for x in runs
            if x["contender"] == label and x["concurrency"] == at["concurrency"]
            and x.get("temperature", at["temperature"]) == at["temperature"] and x.get("wall_s")}


def baselines(rows: list[dict]) -> dict:
    """{(T, C): {"ar", "best_static", "batch1_static", "oracle": the baseline's row}} among the rows:
    batched AR; the static γ fastest at that (C, T), chosen in hindsight; the static γ fastest at C=1 for that
    T, at this C (what a user tuned at batch 1 deploys; absent without C=1); the oracle (T=0 only)."""
    measured = [r for r in rows if r.get("tokens_per_s") is not None]
    out = {}
    for T in dict.fromkeys(r["temperature"] for r in measured):
        at_t = [r for r in measured if r["temperature"] == T]
        st1 = [r for r in at_t if r["concurrency"] == 1 and r["policy"] == "static"]
        g1 = max(st1, key=lambda r: r["tokens_per_s"])["gamma"] if st1 else None
        for C in dict.fromkeys(r["concurrency"] for r in at_t):
            here = [r for r in at_t if r["concurrency"] == C]
            st = [r for r in here if r["policy"] == "static"]
            out[(T, C)] = {
                "ar": next((r for r in here if r["policy"] == "ar"), None),
                "best_static": max(st, key=lambda r: r["tokens_per_s"]) if st else None,
                "batch1_static": next((r for r in st if r["gamma"] == g1), None),
                "oracle": next((r for r in here if r["policy"] == "oracle"), None)}
    return out


def temperatures_of(rows: list[dict]) -> list[float]:
    """The temperatures of ``rows``, in the order they first appear."""
    return list(dict.fromkeys(r.get("temperature", 0.0) for r in rows))


def _at(rows: list[dict], temperature) -> list[dict]:
    """The rows at ``temperature`` (None: the first temperature in ``rows``)."""
    ts = temperatures_of(rows)
    t = ts[0] if temperature is None and ts else temperature
    return [r for r in rows if r.get("temperature", 0.0) == t]


def findings(rows: list[dict], metric: str = "tokens_per_s", temperature: float | None = None) -> dict:
    """The numbers the issues ask for at one temperature (None: the rows' first): AR scaling, best static γ
    per C and its gain, on ``metric`` (tokens_per_s, or tokens_per_cpu_s: tokens per
    CPU-second of this process, which other jobs on a shared machine disturb far less than wall time); and,
    on tokens/s, the baselines per C and every adaptive contender's paired ratios to them."""
    rows = _at(rows, temperature)
    base_rows = rows
    rows = [dict(r, tokens_per_s=r.get(metric)) for r in rows if r.get(metric) is not None]
    Cs = sorted({r["concurrency"] for r in rows})
    ar = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["policy"] == "ar"}
    out = {"temperature": rows[0]["temperature"] if rows else temperature, "ar_tokens_per_s": ar, "best_static": {}}
    if 1 in ar and 16 in ar:
        out["ar_c16_over_c1"] = ar[16] / ar[1]
    for C in Cs:
        st = [r for r in rows if r["concurrency"] == C and r["policy"] == "static"]
        if st:
            b = max(st, key=lambda r: r["tokens_per_s"])
            out["best_static"][C] = {"gamma": b["gamma"], "tokens_per_s": b["tokens_per_s"],
                                     "gain_over_ar": b["tokens_per_s"] / ar[C] - 1 if C in ar else None}
    # the oracles' headroom: each one's gain over the best static γ at its C (on tokens/s also the paired ratio)
    headroom: dict = {}
    for r in rows:
        b = out["best_static"].get(r["concurrency"])
        if r["policy"] in ORACLES and b and b["tokens_per_s"]:
            h = {"policy": r["policy"], "tokens_per_s": r["tokens_per_s"], "best_static_gamma": b["gamma"],
                 "best_static_tokens_per_s": b["tokens_per_s"], "gain_over_best_static": r["tokens_per_s"] / b["tokens_per_s"] - 1}
            v = (r.get("vs") or {}).get("best_static") if metric == "tokens_per_s" else None
            if v:
                h["paired"] = {k: v.get(k) for k in ("ratio", "ci95", "pairs", "half_width", "resolves_5pct")}
            headroom.setdefault(r["contender"], {})[r["concurrency"]] = h
    if headroom:
        out["oracle_headroom"] = headroom
        # each adaptive contender's share of the batched oracle's headroom at its C: (it - best) / (oracle - best)
        bound = headroom.get(next((lab for lab, per_c in headroom.items()
                                   if next(iter(per_c.values()))["policy"] == "oracle_budget"), None), {})
        share: dict = {}
        for r in rows:
            b, h = out["best_static"].get(r["concurrency"]), bound.get(r["concurrency"])
            if r["policy"] in ORACLES or r["policy"] in ("static", "ar") or r["policy"] in PEER_POLICIES or not (b and h):
                continue
            v = headroom_captured(r["tokens_per_s"], b["tokens_per_s"], h["tokens_per_s"])
            if v is not None:
                share.setdefault(r["contender"], {})[r["concurrency"]] = v
        if share:
            out["headroom_share"] = share
    if metric == "tokens_per_s":
        out["baselines"] = {C: {name: {"contender": b["contender"], "gamma": b["gamma"], "tokens_per_s": b["tokens_per_s"]}
                                for name, b in v.items() if b is not None}
                            for (_, C), v in sorted(baselines(base_rows).items(), key=lambda kv: kv[0][1])}
        out["ratios"] = {}
        for r in base_rows:
            if r.get("vs"):
                out["ratios"].setdefault(r["contender"], {})[r["concurrency"]] = r["vs"]
    return out


def _throughput_table(rows: list[dict], metric: str) -> list[str]:
    """One line per contender, one column per C: ``metric`` and its ratio to batched AR; best static γ bold
    (``rows``: one temperature's)."""
    f = findings(rows, metric)
    measured = [dict(r, value=r.get(metric)) for r in rows if r.get(metric) is not None]
    Cs = sorted({r["concurrency"] for r in measured})
    ar = f["ar_tokens_per_s"]
    labels = list(dict.fromkeys(r["contender"] for r in measured))
    lines = ["| contender | " + " | ".join(f"C={C}" for C in Cs) + " |", "|---|" + "---:|" * len(Cs)]
    for lab in labels:
        cells = []
        for C in Cs:
            r = next((x for x in measured if x["contender"] == lab and x["concurrency"] == C), None)
            if r is None:
                cells.append("–")
                continue
            cell = f"{r['value']:.1f}" + (f" (×{r['value'] / ar[C]:.2f})" if ar.get(C) else "")
            best = f["best_static"].get(C, {})
            cells.append(f"**{cell}**" if r["policy"] == "static" and r["gamma"] == best.get("gamma") else cell)
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    return lines


def _findings_lines(rows: list[dict], metric: str, unit: str) -> list[str]:
    f = findings(rows, metric)
    lines = []
    if "ar_c16_over_c1" in f:
        lines.append(f"Batched AR at C=16 gives {f['ar_c16_over_c1']:.2f}× the {unit} of C=1.")
    best = ", ".join(f"C={C}: γ={b['gamma']} ({100 * b['gain_over_ar']:+.0f}%)" for C, b in f["best_static"].items()
                     if b["gain_over_ar"] is not None)
    if best:
        lines.append(f"Best static γ per C and its gain over batched AR: {best}.")
    for lab, per_c in f.get("oracle_headroom", {}).items():
        cells = []
        for C, h in sorted(per_c.items()):
            paired = h.get("paired")
            cells.append(f"C={C}: {100 * h['gain_over_best_static']:+.0f}% over γ={h['best_static_gamma']}"
                         + (f" (paired {ratio_cell(paired)})" if paired else ""))
        kind = ORACLES[next(iter(per_c.values()))["policy"]]
        lines.append(f"Headroom: the {kind} ({lab}) over the best static γ per C, in {unit}: {'; '.join(cells)}.")
    if f.get("headroom_share"):
        lines.append("Share of that headroom each adaptive contender captures, (contender − best static γ) / "
                     "(batched oracle − best static γ), per C where the oracle gains: " + "; ".join(
                         f"{lab} " + ", ".join(f"C={C}: {100 * v:+.0f}%" for C, v in sorted(per_c.items()))
                         for lab, per_c in f["headroom_share"].items()) + ".")
    return lines


def ratio_cell(v: dict | None) -> str:
    """A paired ratio as "1.052 (0.981–1.123)", with * when its interval does not resolve 5% (half-width
    above 0.05), or the ratio alone and its pair count when there are too few pairs for an interval."""
    if not v:
        return "–"
    if v.get("ci95") is None:
        return f"{v['ratio']:.3f} ({v['pairs']} pair)"
    lo, hi = v["ci95"]
    return f"{v['ratio']:.3f} ({lo:.3f}–{hi:.3f})" + ("" if v["resolves_5pct"] else "*")


def verdict_counts(values: list[dict | None]) -> str:
    """How many paired ratios are faster (interval above 1), slower (below 1), tied (containing 1) and
    without an interval, and how many intervals resolve 5%: "2 faster, 1 tied, 1 without interval; 2/3 resolve 5%"."""
    vs = [v for v in values if v]
    with_ci = [v for v in vs if v.get("ci95")]
    n = {"faster": sum(v["ci95"][0] > 1 for v in with_ci), "slower": sum(v["ci95"][1] < 1 for v in with_ci)}
    n["tied"] = len(with_ci) - n["faster"] - n["slower"]
    n["without interval"] = len(vs) - len(with_ci)
    text = ", ".join(f"{k} {v}" if k == "without interval" else f"{v} {k}" for k, v in n.items() if v)
    return (text or "none") + (f"; {sum(v['resolves_5pct'] for v in with_ci)}/{len(with_ci)} resolve 5%" if with_ci else "")


def _baseline_lines(rows: list[dict]) -> list[str]:
    """The baselines per C and every adaptive contender's paired ratios to them (``rows``: one temperature's)."""
    f = findings(rows)
    adaptive = [r for r in rows if r.get("vs")]
    if not f.get("baselines"):
        return []
    g = lambda b: f" γ={b['gamma']}" if b.get("gamma") is not None else ""
    lines = ["", "Baselines per C (tokens/s; the static γ each picks):", "",
             "| C | " + " | ".join(BASELINE_TITLES[k] for k in BASELINES) + " |", "|---:|" + "---:|" * len(BASELINES)]
    for C, v in f["baselines"].items():
        lines.append(f"| {C} | " + " | ".join(
            f"{v[k]['tokens_per_s']:.1f}" + (f" (γ={v[k]['gamma']})" if v[k].get("gamma") not in (None, 0) else "")
            if k in v else "–" for k in BASELINES) + " |")
    if not adaptive:
        return lines
    pairs = sorted({v["pairs"] for r in adaptive for v in r["vs"].values()})
    lines += ["", (f"Paired ratios of tokens/s (contender / baseline; > 1: faster) over the (round, block) workloads "
                   f"each ran in turns ({', '.join(map(str, pairs))} pairs), with the paired bootstrap 95% interval; "
                   "*: the interval's half-width exceeds 0.05, so it does not resolve a 5% difference. The best "
                   "static γ is chosen in hindsight on these same runs (the strictest baseline)."), "",
              "| contender | C | tokens/s | τ | vs " + " | vs ".join(BASELINE_TITLES[k] for k in BASELINES) + " |",
              "|---|---:|---:|---:|" + "---:|" * len(BASELINES)]
    for r in sorted(adaptive, key=lambda r: (r["contender"], r["concurrency"])):
        cells = []
        for k in BASELINES:
            v = r["vs"].get(k)
            cells.append(ratio_cell(v) + (g(v) if v and k in ("best_static", "batch1_static") else ""))
        lines.append(f"| {r['contender']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['tau']:.2f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Against the best static γ at each C (95% interval): " + "; ".join(
        f"{lab}: " + verdict_counts([r["vs"].get("best_static") for r in adaptive if r["contender"] == lab])
        for lab in dict.fromkeys(r["contender"] for r in adaptive)) + "."]
    return lines


def _fmt(x, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def _step_lines(rows: list[dict]) -> list[str]:
    """Per contender and C: tokens/s, τ, target-scored tokens per engine step (all rows, and per running row)
    and running rows per step from the timed runs; verify and draft milliseconds per step from the profiled
    pass (``rows``: one temperature's)."""
    have = [r for r in rows if r.get("scored_per_step") is not None or r.get("profile")]
    if not have:
        return []
    prof = next((r["profile"] for r in have if r.get("profile")), None)
    order = list(dict.fromkeys(r["contender"] for r in rows))
    lines = ["", ("Per engine step: target-scored tokens (each running sequence's drafts, or scored tree nodes, "
                  "plus its last token) per step over all rows and per running row, and running rows per step, "
                  "from the timed runs (first round); verify and draft milliseconds per step from "
                  + (f"an untimed profiled pass on one block ({prof['n_prompts']} prompts) after the timed rounds "
                     "(verify: the target's forward, joined prompts' prefill rows included, acceptance and "
                     "bookkeeping up to the step's read)." if prof else "a profiled pass (profile_steps=true; not run).")),
             "", "| contender | C | tokens/s | τ | scored / step | scored / row-step | rows / step | verify ms / step "
                 "| draft ms / step |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(have, key=lambda r: (order.index(r["contender"]), r["concurrency"])):
        lines.append(f"| {r['contender']} | {r['concurrency']} | {_fmt(r.get('tokens_per_s'), '.1f')} | "
                     f"{_fmt(r.get('tau'))} | {_fmt(r.get('scored_per_step'), '.1f')} | "
                     f"{_fmt(r.get('scored_per_row_step'))} | {_fmt(r.get('rows_per_step'), '.1f')} | "
                     f"{_fmt(r.get('verify_ms_per_step'))} | {_fmt(r.get('draft_ms_per_step'))} |")
    return lines


def _category_lines(rows: list[dict]) -> list[str]:
    """τ and mean request latency per prompt category, one row per (contender, C), when there are two or more."""
    rows = [r for r in rows if r.get("by_category")]
    cats = list(dict.fromkeys(c for r in rows for c in r["by_category"]))
    if len(cats) < 2:
        return []
    n = rows[0]["by_category"]
    lines = ["", ("Per prompt category (prompts in each): τ and mean request latency in ms. Every category's "
                  "sequences share the batch's steps, so tokens/s is the batch's, above."), "",
             "| contender | C | " + " | ".join(f"{c} ({n[c]['n_prompts']})" for c in cats) + " |",
             "|---|---:|" + "---:|" * len(cats)]
    for r in rows:
        cells = [(f"{v['tau']:.2f} / {v['request_latency_ms_mean']:.0f}" if (v := r["by_category"].get(c)) else "–")
                 for c in cats]
        lines.append(f"| {r['contender']} | {r['concurrency']} | " + " | ".join(cells) + " |")
    return lines


def _temperature_section(result: dict, rows: list[dict]) -> list[str]:
    Cs = sorted({r["concurrency"] for r in rows})
    f = findings(rows)
    lines = [("Generated tokens per wall-clock second (median over rounds; each round's blocks summed); **bold**: "
              "the best static γ at that C; (×N): ratio to batched AR at the same C."), ""]
    lines += _throughput_table(rows, "tokens_per_s") + [""] + _findings_lines(rows, "tokens_per_s", "tokens/s")
    lines += _baseline_lines(rows)
    lines += _step_lines(rows)
    lines += peer_lines(result, rows)
    if any(r.get("tokens_per_cpu_s") for r in rows):
        lines += ["", ("The same runs in generated tokens per CPU-second of the benchmark process (one thread): other "
                       "jobs on a shared machine stretch wall time far more than they stretch this."), ""]
        lines += _throughput_table(rows, "tokens_per_cpu_s") + [""] + _findings_lines(rows, "tokens_per_cpu_s",
                                                                                          "tokens per CPU-second")
    lines += ["", "Latencies (wall clock, median over rounds) of batched AR and of the best static γ (tokens/s):", "",
              ("| C | best static γ | AR token gap ms (mean/p90) | best-γ token gap ms (mean/p90) | "
               "AR request ms (mean/p90) | best-γ request ms (mean/p90) |"), "|---:|---:|---:|---:|---:|---:|"]
    for C in Cs:
        b = f["best_static"].get(C)
        ar = next((x for x in rows if x["concurrency"] == C and x["policy"] == "ar"), None)
        br = next((x for x in rows if x["concurrency"] == C and x["policy"] == "static"
                   and b and x["gamma"] == b["gamma"]), None)
        if b and ar and br:
            lines.append(f"| {C} | {b['gamma']} | {ar['token_latency_ms_mean']:.1f} / {ar['token_latency_ms_p90']:.1f} | "
                         f"{br['token_latency_ms_mean']:.1f} / {br['token_latency_ms_p90']:.1f} | "
                         f"{ar['request_latency_ms_mean']:.0f} / {ar['request_latency_ms_p90']:.0f} | "
                         f"{br['request_latency_ms_mean']:.0f} / {br['request_latency_ms_p90']:.0f} |")
    lossy = [r for r in rows if r["lossless"] is False]
    if rows and rows[0]["lossless"] is not None:
        total = sum(r["n_prompts"] for r in rows)
        same = sum(r["identical"] for r in rows)
        lines += ["", (f"Greedy identity with each prompt's own greedy output from the target (transformers' "
                       f"forward): {same}/{total} sequences "
                       f"(worst round per row); rows not fully identical: {len(lossy)}.")]
        d = result.get("differences", [])
        if d:
            ties = sum(bool(x["near_tie"]) for x in d)
            lines += [(f"Differing sequences: {len(d)}, of which near-ties (top-2 gap within 2 spacings of the "
                       f"dtype at the first difference): {ties}. Largest gap: "
                       f"{max((x['gap'] or 0) for x in d):.4g}.")]
    lines += _category_lines(rows)
    return lines


def status_line(result: dict) -> str:
    """The page header's first line: whether the run finished every round, or how far a stopped one got."""
    done, total = result.get("rounds_done", 0), result.get("rounds")
    of = f" of {total}" if total is not None else ""
    if result.get("complete"):
        return f"Status: complete ({done:g}{of} rounds)."
    return (f"Status: **incomplete**: {done:.2f}{of} rounds done (a checkpoint of a run that stopped or is still "
            "running; rows cover only the (T, C) cells measured so far).")


def markdown(result: dict, meta: dict | None = None) -> str:
    rows = result["rows"]
    ts = temperatures_of(rows)
    lines = ["# Batched speculative decoding: tokens/s against concurrency", "", status_line(result), ""]
    if meta:
        lines += [", ".join(f"{k}: {v}" for k, v in meta.items()), ""]
    for s in result.get("skipped", []):
        at = "" if s.get("temperature") is None else f" at T={s['temperature']:g}"
        lines += [f"Skipped {s['contender']}{at}: {s['why']}.", ""]
    for lab, t in (result.get("cost_tables") or {}).items():
        lines += [f"Cost table of {lab}: {t.get('path')} (key: {t.get('key')}).", ""]
    if len(ts) == 1:
        lines += _temperature_section(result, rows)
    for t in ts if len(ts) > 1 else []:
        lines += ["", f"## Temperature {t:g}" + (" (greedy)" if t == 0 else ""), ""]
        lines += _temperature_section(result, _at(rows, t))
    shares = [r for r in rows if r.get("policy_share") is not None]
    if shares:
        lines += ["", "## The policies' own time", "",
                  "Seconds inside the policy's own calls (plan, stop codes after each draft depth, observation; timed "
                  "by the engine around each call) over the run's wall seconds, worst (C, T) per contender:", ""]
        for lab in dict.fromkeys(r["contender"] for r in shares):
            worst = max((r for r in shares if r["contender"] == lab), key=lambda r: r["policy_share"])
            lines.append(f"- {lab}: {100 * worst['policy_share']:.2f}% (C={worst['concurrency']}, "
                         f"T={worst['temperature']:g})")
    lines += step_cost_page.markdown_lines(result)
    lines += step_cost_page.decomposition_lines(rows)
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return matplotlib, plt


def _log2_axis(ax, matplotlib, Cs):
    ax.set_xscale("log", base=2)
    ax.set_xticks(Cs)
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrency C (sequences in flight)")
    ax.grid(alpha=0.3)


def _save(fig, plt, path) -> Path:
    fig.tight_layout()
    with atomic_path(path, keep_suffix=True) as tmp:  # keeps the suffix: matplotlib picks the format by it
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_tokens_per_s(result: dict, path: str | Path) -> Path:
    """Tokens/s against C, one line per contender, one panel per temperature (side by side, one y scale
    each), the best static γ at each C marked with a red star."""
    matplotlib, plt = _pyplot()
    ts = temperatures_of(result["rows"])
    fig, axes = plt.subplots(1, len(ts), figsize=(7.5 if len(ts) == 1 else 5.6 * len(ts), 4.8), squeeze=False)
    for ax, t in zip(axes[0], ts):
        at = _at(result["rows"], t)
        rows = at
        f = findings(at)
        for lab in dict.fromkeys(r["contender"] for r in rows):
            xs = sorted((r["concurrency"], r["tokens_per_s"]) for r in rows if r["contender"] == lab)
            style = {"lw": 2.2, "color": "black"} if lab == "ar" else {"lw": 1.2, "alpha": 0.85}
            ax.plot([x for x, _ in xs], [y for _, y in xs], marker="o", ms=3, label=lab, **style)
        for C, b in f["best_static"].items():
            ax.scatter([C], [b["tokens_per_s"]], marker="*", s=160, color="red", zorder=5)
            ax.annotate(f"γ={b['gamma']}", (C, b["tokens_per_s"]), textcoords="offset points", xytext=(4, 6), fontsize=8)
        _log2_axis(ax, matplotlib, sorted({r["concurrency"] for r in rows}))
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"T={t:g}" + (" (greedy)" if t == 0 else "") if len(ts) > 1 else
                     "Batched speculative decoding (red star: best static γ at each C)", fontsize=10)
        ax.legend(fontsize=7, ncol=2)
    if len(ts) > 1:
        fig.suptitle("Batched speculative decoding against concurrency (red star: best static γ at each C)", fontsize=11)
    return _save(fig, plt, path)


def plot_ratios(result: dict, path: str | Path, baseline: str = "best_static") -> Path | None:
    """Each adaptive contender's paired ratio of tokens/s to ``baseline`` (default the best static γ at that
    (C, T)) against C, with its bootstrap 95% interval, one panel per temperature; None when no row has one."""
    rows = [r for r in result["rows"] if (r.get("vs") or {}).get(baseline)]
    if not rows:
        return None
    matplotlib, plt = _pyplot()
    ts = [t for t in temperatures_of(result["rows"]) if any(r["temperature"] == t for r in rows)]
    fig, axes = plt.subplots(1, len(ts), figsize=(5.6 * len(ts), 4.4), squeeze=False, sharey=True)
    labels = list(dict.fromkeys(r["contender"] for r in rows))
    for ax, t in zip(axes[0], ts):
        for k, lab in enumerate(labels):
            pts = sorted((r["concurrency"], r["vs"][baseline]) for r in rows if r["temperature"] == t and r["contender"] == lab)
            if not pts:
                continue
            shift = 2 ** (0.04 * (k - (len(labels) - 1) / 2))  # side by side, so the intervals do not overlap
            x = [C * shift for C, _ in pts]
            y = [v["ratio"] for _, v in pts]
            err = [[v["ratio"] - v["ci95"][0] if v["ci95"] else 0 for _, v in pts],
                   [v["ci95"][1] - v["ratio"] if v["ci95"] else 0 for _, v in pts]]
            ax.errorbar(x, y, yerr=err, marker="o", ms=3, capsize=3, lw=1.2, label=lab)
        ax.axhline(1.0, color="black", lw=1)
        ax.axhspan(0.95, 1.05, color="grey", alpha=0.12, lw=0)
        _log2_axis(ax, matplotlib, sorted({r["concurrency"] for r in rows}))
        ax.set_title(f"T={t:g}" + (" (greedy)" if t == 0 else ""), fontsize=10)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(f"tokens/s / {BASELINE_TITLES[baseline]} (paired, 95% interval)")
    fig.suptitle(f"Adaptive policies against the {BASELINE_TITLES[baseline]} (grey: ±5%)", fontsize=11)
    return _save(fig, plt, path)


def check_markdown(rows: list[dict]) -> str:
    """The cost check's table (:func:`eagle_backbone.cost.check_costs`'s rows): measured against predicted step ms."""
    lines = ["| slots | γ | measured ms | predicted ms | error | tokens a row | tokens/ms measured | tokens/ms predicted |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['slots']} | {r['gamma']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
                     f"{100 * (r['predicted_ms'] / r['measured_ms'] - 1):+.0f}% | {r['tokens_per_row']:.2f} | "
                     f"{r['measured_tokens_per_ms']:.2f} | {r['predicted_tokens_per_ms']:.2f} |")
    return "\n".join(lines) + "\n"


OUTPUT_FILES = ("batch_bench.json", "batch_bench_runs.json", "batch_bench.md", "batch_bench.png",
                "batch_bench_ratio.png", "step_costs.json", "step_costs.png")


def write(result: dict, out_dir: str | Path, meta: dict | None = None, with_plot: bool = True) -> Path:
    """batch_bench.json (the rows, each with ``complete``), batch_bench_runs.json (meta, ``complete``,
    ``rounds_done``, ``rounds``, the cost tables used, findings per temperature, greedy differences, skipped
    contenders, every (round, block) run, the profiled pass's ``profiles``), batch_bench.md (its header says complete or not), and with
    ``with_plot`` batch_bench.png and batch_bench_ratio.png (when a row has a ratio to the best static γ).
    Every file of :data:`OUTPUT_FILES` is rewritten or removed, so that a reused folder never keeps an older
    run's plot next to this run's tables; returns ``out_dir`` (:func:`written` lists what is there)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    complete = bool(result.get("complete", False))
    status = {"complete": complete, "rounds_done": result.get("rounds_done", 0), "rounds": result.get("rounds")}
    rows = [{**{k: r.get(k) for k in ROW_KEYS}, "complete": complete} for r in result["rows"]]
    written = [atomic_write_json(out / "batch_bench.json", rows, indent=2)]
    by_t = {str(t): findings(result["rows"], temperature=t) for t in temperatures_of(result["rows"])}
    written.append(atomic_write_json(out / "batch_bench_runs.json", {
        "meta": meta or {}, **status, "cost_tables": result.get("cost_tables") or {}, "findings": by_t,
        "differences": result.get("differences", []), "skipped": result.get("skipped", []),
        "runs": result["runs"], "profiles": result.get("profiles") or [], "step_costs": result.get("step_costs") or []},
        indent=2, default=str))
    written.append(atomic_write_text(out / "batch_bench.md", markdown(result, meta)))
    if result.get("hindsight"):  # the costs measured in hindsight: rerun a policy with policy.cost_model=this file
        written.append(atomic_write_json(out / "step_costs.json", result["hindsight"], indent=2))
    if with_plot and result["rows"]:
        written.append(plot_tokens_per_s(result, out / "batch_bench.png"))
        ratio = plot_ratios(result, out / "batch_bench_ratio.png")
        if ratio is not None:
            written.append(ratio)
        costs_png = step_cost_page.plot(result, out / "step_costs.png")
        if costs_png is not None:
            written.append(costs_png)
    for name in OUTPUT_FILES:  # an older run's file this write did not replace
        if out / name not in written:
            (out / name).unlink(missing_ok=True)
    return out


def written(out_dir: str | Path) -> list[str]:
    """The files of :data:`OUTPUT_FILES` that the last :func:`write` to ``out_dir`` left (it removes the rest)."""
    return [n for n in OUTPUT_FILES if (Path(out_dir) / n).is_file()]


@torch.inference_mode()
def prefill_join_cost(target, concurrency=(2, 4, 8, 16, 32), prompt_len: int = 40, context: int = 96, gamma: int = 3,
                      reps: int = 15, seed: int = 0) -> list[dict]:
    """When one sequence finishes and its slot takes a new prompt: is the prompt's prefill cheaper as its own
    target forward (then the C-1 running slots' verification forward), or joined to that step's forward
    (one ragged batch: projections and MLPs over all tokens at once, attention per row)? Median
    process-CPU ms of each, interleaved, per C."""
    from eagle_backbone.llama import BatchedLlama, RaggedBatch

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
        for i in range(reps + 2):
            for how in ("separate", "joined") if i % 2 else ("joined", "separate"):
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
    capacity = max(len(p) for p in prompts) + max_new_tokens + 2
    for C in concurrency:
        eng = BatchedSpeculativeEngine(target, candidates, slots=C, policy=make_policy, capacity=capacity,
                                       attn=attn, profile=True)
        run_workload(eng, prompts[:C], C, 8)  # warm-up
        eng.prof.s = {}
        res = run_workload(eng, prompts, C, max_new_tokens)
        total = sum(eng.prof.s.values())
        out.append({"concurrency": C, "tokens": res.new_tokens, "steps": res.steps,
                    "seconds": {k: round(v, 4) for k, v in eng.prof.s.items()},
                    "share": {k: round(v / total, 3) for k, v in eng.prof.s.items()}})
    return out


if __name__ == "__main__":
    # python -m ldlp.bench.load_sweep OUT_DIR: the prefill-join measurement and a profiled breakdown
    # of static γ=3 on the embedded pair (dtype auto, eager), written to OUT_DIR/prefill_join.json and profile.json
    import sys

    from eagle_backbone.loading import load_pair
    from eagle_backbone.paths import REPO_ROOT
    from eagle_backbone.policy import StaticPolicy

    set_threads(1)
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/bench_batch")
    e = REPO_ROOT / "data" / "embedded"
    pair = load_pair({"target": str(e / "target"), "drafter": str(e / "drafter"), "drafter_kind": "eagle",
                      "dtype": "auto", "device": "cpu", "attn_implementation": "eager", "tokenizer": str(e / "target")})
    join = {f"prompt_len={n}": prefill_join_cost(pair.target, prompt_len=n) for n in (40, 200)}
    atomic_write_json(out_dir / "prefill_join.json", join)
    for n, rows in join.items():
        for r in rows:
            print(n, f"C={r['concurrency']:>2} separate {r['separate_ms']:.1f} ms, joined {r['joined_ms']:.1f} ms "
                     f"({r['joined_over_separate']:.2f}x)")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, pair.target.vocab_size, (40,), generator=g).tolist() for _ in range(16)]
    prof = profile_components(pair.target, pair.candidates, prompts, lambda: StaticPolicy(3))
    atomic_write_json(out_dir / "profile.json", prof)
    for r in prof:
        print(f"C={r['concurrency']}: " + ", ".join(f"{k} {v:.0%}" for k, v in r["share"].items()))
