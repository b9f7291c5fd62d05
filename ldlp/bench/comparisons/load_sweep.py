"""The concurrency sweep behind ``scripts/bench_batch.py``: tokens/s and latencies of batched AR, static γ
and adaptive policies at concurrency C, on a continuous-batching workload, with greedy losslessness.

For every round, every temperature T, every C and every block of the prompts (``blocks`` workloads, fewer
when a block would hold fewer prompts than C), every contender runs the block through
:func:`~ldlp.bench.harness.workload.run_workload` with C streams in flight, in turns (the order rotating
between rounds, T, C and blocks, so that a slow phase of a shared machine hits all alike). Every contender
runs on the one engine (:class:`~eagle_backbone.batched_engine.BatchedSpeculativeEngine`) with one candidate
generator. Rows report each round's blocks summed, medians over rounds.

Each (round, block) is one paired measurement: per (C, T) every adaptive contender's ratio of tokens/s to
the baselines (batched AR, the best static γ at that (C, T) in hindsight, the static γ best at C=1 used at
every C, the oracle at T=0) comes with a paired bootstrap 95% interval over those pairs
(:func:`ldlp.bench.harness.stats.paired_ratio`; the rows: :mod:`ldlp.bench.comparisons.load_aggregate`). The oracle replays the engine with one slot
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

This module checks the settings and runs the sweep; it takes built models, prompts and policy factories (loading
them from configs is the script's). :mod:`ldlp.bench.comparisons.load_aggregate` turns its runs into rows and
``ldlp.report.load_sweep`` writes the results folder, page and plots.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from eagle_backbone.cost import table_record
from eagle_backbone.policy import as_draft_policy
from eagle_backbone.errors import ConfigError
from eagle_backbone.sampling import SamplingConfig
from eagle_backbone.step_cost import OnlineCostModel, StepRecord
from eagle_backbone.timing import interleaved
from ldlp.bench.harness.contender import ENGINE_DEFAULTS, draft_cap
from ldlp.bench.harness.engines import EngineFactory
from ldlp.bench.harness.identity import GreedyReference
from ldlp.bench.comparisons.load_aggregate import aggregate_runs
from ldlp.bench.harness.memory import release_freed_memory
from ldlp.bench.comparisons.step_costs import hindsight_model, run_step_costs, step_cost_rows
from ldlp.bench.harness.workload import run_workload
from ldlp.policies.goodput import adopt
from ldlp.policies.learned import adopt_calibration


@dataclass
class Contender:
    label: str  # "ar", "static γ=3", "heuristic", ...
    policy: str  # "ar", "static" or the policy's name
    gamma: int | None  # static γ; None when adaptive (and 0 for AR)
    make: Callable | None  # zero-argument policy factory (one instance per slot); None: AR
    # a peer engine's runner (vLLM; ldlp/bench/comparisons/peer_rows.py); None: this engine
    runner: object | None = None
    engine: dict = field(default_factory=dict)  # this engine's settings for it (prefill, max_batched_tokens)


def split_blocks(n: int, concurrency: int, blocks: int) -> list[list[int]]:
    """Prompt indices of the workloads at one C: ``blocks`` parts (prompt i in part i mod k), fewer when a part
    would hold fewer prompts than C streams (k = min(blocks, n // C), at least 1): a workload of fewer
    prompts than C never has C sequences in flight."""
    k = max(1, min(blocks, n // concurrency))
    return [list(range(b, n, k)) for b in range(k)]


# -- the oracles: policies that know what the target accepts --------------------------------------------------


def replayed_labels(contenders: list[Contender]) -> set[str]:
    """The contenders whose policy is ``greedy_only`` (the oracles: they replay the engine with one slot in
    ``begin`` to know what the target accepts); the sweep warms their replays before the clocks start
    (:func:`warm_replays`) and runs them at T=0 only."""
    return {c.label for c in contenders if c.make is not None and as_draft_policy(c.make).greedy_only}


def warm_replays(c: Contender, target, candidates, prompts, max_new_tokens, sampling) -> Contender:
    """Run an oracle's ``begin`` on every prompt once, untimed, with a one-slot engine: its replays are shared by
    every instance (:class:`~ldlp.policies.oracles.KnownAcceptance`), so the engines' slots only look them up."""
    engine = EngineFactory(target, candidates)(1, c.make(), sampling)
    for p in prompts:
        engine.policy.begin(0, p, max_new_tokens)
    return c


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def prompts_meta(prompt_set, concurrency, blocks: int) -> dict:
    """What a result's header says about its prompts: the file, its SHA-256, the prompts dropped for length and the
    malformed records skipped (as evaluate.py records them), and the blocks the run makes at each C (:func:`split_blocks`: fewer than asked
    where a block would hold fewer prompts than C), so the header agrees with the rows' ``blocks``."""
    info = dict(getattr(prompt_set, "info", {}) or {})
    n = len(prompt_set)
    return {"data_path": info.get("data_path"), "data_sha256": info.get("data_sha256"),
            "n_dropped": int(info.get("n_dropped") or 0), "dropped_reason": info.get("dropped_reason"),
            **skipped_records(prompt_set),
            "blocks_asked": int(blocks), "blocks": {int(c): len(split_blocks(n, int(c), int(blocks))) for c in concurrency}}


def skipped_records(prompt_set) -> dict:
    """``{"n_skipped_records": N}`` where the prompt file was read with ``data.on_error=skip`` and N malformed records
    were skipped (the page says so, not only the log); empty otherwise."""
    k = int((getattr(prompt_set, "info", None) or {}).get("n_skipped_records") or 0)
    return {"n_skipped_records": k} if k else {}


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


def check_token_budgets(contenders: list, concurrency, max_new_tokens: int) -> None:
    """One ConfigError line for a chunked-prefill budget below one decode step at the largest C: C rows scoring
    their drafts and a token each (the engine would exceed the budget, which the label says it keeps)."""
    cap = draft_cap(max_new_tokens)
    for c in contenders:
        eng = getattr(c, "engine", None) or {}
        budget = eng.get("max_batched_tokens", ENGINE_DEFAULTS["max_batched_tokens"])
        gamma = cap if c.gamma is None else min(int(c.gamma), cap)  # an adaptive policy may draft to the cap
        need = max(concurrency) * (gamma + 1)
        if c.runner is None and eng.get("prefill", ENGINE_DEFAULTS["prefill"]) == "chunked" and budget < need:
            raise ConfigError(f"contender {c.label}: max_batched_tokens={budget} is below one decode step at "
                              f"C={max(concurrency)} ({need} tokens: C rows x (γ {gamma} + 1)); raise it or lower "
                              "the concurrency")


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



def _check_inputs(prompts, contenders: list[Contender]) -> None:
    if not prompts:
        raise ValueError("no prompts to benchmark")
    if not contenders or contenders[0].policy != "ar":
        raise ValueError("the first contender must be batched AR (policy 'ar')")


@dataclass
class _Run:
    """One sweep in progress: what every run shares (the models, prompts, settings) and what the runs gather."""

    target: object
    candidates: object
    prompts: list[list[int]]
    max_new_tokens: int
    attn: str
    log: Callable[[str], None]
    categories: list | None  # one per prompt; None: no per-category counters
    seed: int  # prompt i samples with seed + i
    seeds: list[int] = field(init=False)
    engines: EngineFactory = field(init=False)  # every engine of the sweep: caches for its longest prompt
    runs: list[dict] = field(default_factory=list)
    diffs: dict = field(default_factory=dict)  # (contender, C, prompt) -> its first greedy difference
    skipped: list[dict] = field(default_factory=list)
    cost_tables: dict = field(default_factory=dict)  # contender -> the cost table its policy planned with
    profiles: list[dict] = field(default_factory=list)  # the untimed profiled pass (profile_steps)
    # each contender's online step-cost model, kept across its runs as a server's engine keeps learning (a
    # cost-driven policy warm-starts it from its table and plans with it; for the others it only predicts)
    cost_models: dict[str, OnlineCostModel] = field(default_factory=dict)
    records: list[StepRecord] = field(default_factory=list)  # every timed step, for the costs in hindsight
    # each contender's goodput learner per T (ldlp/policies/goodput.py), kept across its runs like the costs
    learners: dict = field(default_factory=dict)
    calibrations: dict = field(default_factory=dict)  # the learned policy's hazard correction per T, likewise

    def __post_init__(self):
        self.seeds = [self.seed + i for i in range(len(self.prompts))]
        self.engines = EngineFactory.for_prompts(self.target, self.candidates, self.prompts, self.max_new_tokens, self.attn)

    # -- before the clocks: each temperature's contenders, greedy references and warm-up --

    def prepare(self, contenders: list[Contender], replayed: set[str], samp: SamplingConfig) -> tuple:
        """(sampling, the contenders that run at this T, the greedy references or None), kernels warmed up."""
        cs = [c if c.label not in replayed else self._replayed(c, samp) for c in contenders]
        cs = [c for c in cs if c is not None]
        ref = GreedyReference.of_target(self.target, self.prompts, self.max_new_tokens, self.log) if samp.greedy else None
        for c in cs:  # warm up kernels and allocators once per contender (a peer warms up its own engine at each C)
            if c.runner is None:
                e = self.engines(2, c.make, samp, **c.engine)
                run_workload(e, self.prompts[:2], 2, min(8, self.max_new_tokens), self.seeds[:2])
        release_freed_memory()  # the replays' and warm-ups' engines are gone
        return samp, cs, ref

    def _replayed(self, c: Contender, samp: SamplingConfig) -> Contender | None:
        """A replaying contender prepared for this T, or None (skipped, and said so)."""
        T = samp.temperature
        if not samp.greedy:
            self.skipped.append({"contender": c.label, "temperature": T, "why": "defined for greedy decoding only"})
            self.log(f"skipping {c.label} at T={T}: it is defined for greedy decoding (T=0) only")
            return None
        if self.candidates is None:
            self.skipped.append({"contender": c.label, "temperature": T, "why": "needs a candidate generator"})
            self.log(f"skipping {c.label}: its policy replays speculative decoding and no candidate generator was given")
            return None
        self.log(f"{c.label}: replaying the engine with one slot on {len(self.prompts)} prompts (untimed)")
        return warm_replays(c, self.target, self.candidates, self.prompts, self.max_new_tokens, samp)

    # -- the timed runs --

    def run_cell(self, at: tuple, r: int, turn: int, C: int, blocks: int) -> None:
        """Every block at one (round, T, C), each run by every contender in turn (the order rotating by ``turn``)."""
        samp, cs, ref = at
        parts = split_blocks(len(self.prompts), C, blocks)
        if r == 0 and len(parts) < blocks:
            self.log(f"C={C}: {len(parts)} block(s) of >= {C} prompts (of {blocks} asked): "
                     f"{len(self.prompts)} prompts cannot fill more")
        # block bi starts with contender (turn + bi) mod n
        interleaved(cs, parts, 1, lambda c, idx, bi, _: self._run_block(c, C, samp, ref, idx, r, bi), order="rotate",
                    offset=turn)

    def _run_block(self, c: Contender, C: int, samp: SamplingConfig, ref, idx: list[int], r: int, bi: int) -> None:
        ps, sd = [self.prompts[i] for i in idx], [self.seeds[i] for i in idx]
        if c.runner is not None:  # a peer engine: the same block, budget, seeds, sampling, stops
            outs, summ = c.runner.run(ps, C, self.max_new_tokens, sd, samp, self.target.eos_token_ids)
        else:
            outs, summ = self._engine_run(c, C, samp, idx)
            release_freed_memory()  # the run's engine is gone: its pages back to the system, outside the clock
        same = self._greedy_check(c, C, idx, outs, ref)
        T = samp.temperature
        self.runs.append({"round": r, "block": bi, "contender": c.label, "policy": c.policy, "gamma": c.gamma,
                          "concurrency": C, "temperature": T, "n_prompts": len(idx), **summ,
                          "identical": None if same is None else sum(same)})
        self.log(f"round {r} T={T:g} C={C:>2} block {bi} {c.label:<14} {summ['tokens_per_s']:7.1f} tok/s "
                 f"tau {summ['tau']:.2f}" + ("" if same is None else f" identical {sum(same)}/{len(same)}"))

    def _engine_run(self, c: Contender, C: int, samp: SamplingConfig, idx: list[int]) -> tuple[list, dict]:
        """One block on this engine: the outputs, and the summary with the step costs, the policy's own seconds,
        the step counters, and the per-category counters where the prompts have categories."""
        model = self.cost_models.setdefault(c.label, OnlineCostModel())
        age = model.seen
        eng = self.engines(C, c.make, samp, cost_model=model, **c.engine)
        key = (c.label, samp.temperature)
        learner = adopt(eng.policy, self.learners.get(key))
        if learner is not None:
            self.learners[key] = learner
        # the learned policy's hazard correction lives across its runs too (as a server's policy would)
        if (cal := adopt_calibration(eng.policy, self.calibrations.get(key))) is not None:
            self.calibrations[key] = cal
        res = run_workload(eng, [self.prompts[i] for i in idx], C, self.max_new_tokens, [self.seeds[i] for i in idx])
        summ = res.summary()
        summ["step_costs"] = run_step_costs(eng.step_log, age)
        self.records.extend(eng.step_log)
        summ["policy_s"] = eng.policy_s  # the policy's own seconds in the run
        if learnt := eng.policy.report():  # what it learnt in the run (the learned policy's correction)
            summ["policy_report"] = learnt
        summ.update(step_counters(res.outputs, eng.steps))
        used = table_record(eng.policy.pricing)
        if used is not None and c.label not in self.cost_tables:
            self.cost_tables[c.label] = used
        if self.categories is not None:
            summ["by_category"] = res.by_category([self.categories[i] for i in idx])
        return [o.tokens for o in res.outputs], summ

    def _greedy_check(self, c: Contender, C: int, idx: list[int], outs: list,
                      ref: GreedyReference | None) -> list[bool] | None:
        """Each output against its prompt's greedy reference (None without references); a first difference per
        (contender, C, prompt) is kept with its near-tie check."""
        if ref is None:
            return None
        same = ref.same(outs, idx)
        for o, i, ok in zip(outs, idx, same):
            if not ok and (c.label, C, i) not in self.diffs:
                self.diffs[(c.label, C, i)] = {"contender": c.label, "concurrency": C, "prompt": i,
                                               **ref.difference(i, o)}
        return same

    # -- after the timed rounds --

    def profile_cell(self, at: tuple, C: int, blocks: int) -> None:
        """The untimed profiled pass of every contender of this engine at one (C, T), on the first block."""
        samp, cs, _ = at
        idx = split_blocks(len(self.prompts), C, blocks)[0]
        for c in cs:
            if c.runner is not None:  # a peer engine has no profiled mode here
                continue
            self.profiles.append({"contender": c.label, "policy": c.policy, "concurrency": C,
                                  "temperature": samp.temperature, **profile_pass(
                                      self.engines, [self.prompts[i] for i in idx], c.make, C, self.max_new_tokens,
                                      samp, [self.seeds[i] for i in idx], c.engine)})
            self.log(f"profiled T={samp.temperature:g} C={C:>2} {c.label:<14} " + ", ".join(
                f"{k} {v:.2f}" for k, v in self.profiles[-1]["ms_per_step"].items()) + " ms/step")

    def result(self, rows: list[dict], rounds_done: float, rounds: int) -> dict:
        return {"rows": rows, "differences": list(self.diffs.values()), "runs": self.runs, "skipped": self.skipped,
                "rounds_done": rounds_done, "rounds": rounds, "complete": False, "cost_tables": self.cost_tables,
                "profiles": self.profiles, "step_costs": step_cost_rows(self.runs),
                "learners": {f"{lab} T={T:g}": {**ln.summary(), "schedule": {str(k): v for k, v in ln.schedule().items()}}
                             for (lab, T), ln in self.learners.items()}}


def sweep(target, candidates, prompts: list[list[int]], contenders: list[Contender],
          concurrency: list[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
          rounds: int = 2, seed: int = 0, attn: str = "eager",
          checkpoint: Callable[[dict], None] | None = None, log: Callable[[str], None] = print,
          categories: list | None = None, temperatures: list[float] | None = None, blocks: int = 1,
          bootstrap: int = 2000, profile_steps: bool = False, cost_key: dict | None = None) -> dict:
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
    replays the engine (the oracles: :func:`replayed_labels`) runs at T=0 only, bound to ``candidates``.
    ``attn``: the target's attention math in the engine (a generator keeps its own).

    Every row carries the timed runs' step counters (first round): target-scored tokens per engine step
    (``scored_per_step``: all rows; ``scored_per_row_step``: per running sequence, d + 1 for d drafts scored)
    and running rows per step. ``profile_steps``: after the timed rounds, one untimed pass of the engine's
    profiled mode per contender at every (C, T) on the first block (:func:`profile_pass`), whose component
    seconds per engine step give ``verify_ms_per_step``, ``draft_ms_per_step`` and ``profile`` (``profiles``
    in the result). ``cost_key``: the setup's cost key (``ldlp.bench.harness.loaders.engine_cost_key``), recorded by the
    costs measured in hindsight (``hindsight``, step_costs.json) even where no contender read a cost table, so a
    policy on another setup refuses the file (None: the key of a contender's table, if any)."""
    if categories is not None and len(categories) != len(prompts):
        raise ValueError(f"{len(categories)} categories for {len(prompts)} prompts: give one per prompt")
    sampling = sampling or SamplingConfig()
    temps = check_sweep_args(concurrency, temperatures, blocks, rounds, max_new_tokens, bootstrap) or [
        float(sampling.temperature)]
    check_contenders(contenders, max_new_tokens)
    _check_inputs(prompts, contenders)
    with_cats = categories is not None and any(c is not None for c in categories)
    run = _Run(target, candidates, prompts, max_new_tokens, attn, log, categories if with_cats else None, seed)
    replayed = replayed_labels(contenders)
    per_t = {T: run.prepare(contenders, replayed, replace(sampling, temperature=T)) for T in temps}

    def aggregate(profiles=None):
        return aggregate_runs(run.runs, sampling.temperature, len(prompts), bootstrap=bootstrap, seed=seed,
                              profiles=profiles)

    cells = [(ti, T, ci, C) for ti, T in enumerate(temps) for ci, C in enumerate(concurrency)]
    for r in range(rounds):
        for n, (ti, T, ci, C) in enumerate(cells, 1):
            run.run_cell(per_t[T], r, r + ti + ci, C, blocks)
            result = run.result(aggregate(), r + n / len(cells), rounds)
            if checkpoint:  # after every (T, C): a stopped run still leaves its measured rows, marked incomplete
                checkpoint(result)
    if profile_steps:  # untimed, after the timed rounds (never interleaved with them)
        for T, C in itertools.product(temps, concurrency):
            run.profile_cell(per_t[T], C, blocks)
            result = dict(result, rows=aggregate(run.profiles))
            if checkpoint:
                checkpoint(result)
    result["complete"] = True
    if run.records:
        keys = [t.get("key") for t in run.cost_tables.values() if t.get("key")]  # the setup the steps ran on
        result["hindsight"] = hindsight_model(run.records, cost_key or (keys[0] if keys else None))
    return result


def step_counters(outputs, engine_steps: int) -> dict:
    """A run's step counters from what the host already holds (no device read): ``engine_steps`` (the engine's
    speculative steps), ``row_steps`` (running sequences summed over those steps: one draft length each) and
    ``scored_tokens`` (what the target scored: each row-step's drafts, or scored tree nodes, plus its last token)."""
    lengths = [d for o in outputs for d in o.stats.draft_lengths]
    return {"engine_steps": int(engine_steps), "row_steps": len(lengths), "scored_tokens": sum(lengths) + len(lengths)}


@torch.inference_mode()
def profile_pass(engines: EngineFactory, prompts, make_policy, concurrency: int, max_new_tokens: int,
                 sampling: SamplingConfig, seeds: list[int], engine: dict | None = None) -> dict:
    """One untimed run of ``prompts`` in the engine's profiled mode (a clock reading, or on a GPU a CUDA event,
    at every phase; never in the timed runs): the seconds of each component (draft, policy, verify, prefill,
    read, host), the engine's steps, and the milliseconds per engine step of each component."""
    eng = engines(concurrency, make_policy, sampling, profile=True, **(engine or {}))
    res = run_workload(eng, prompts, concurrency, max_new_tokens, seeds)
    steps = eng.steps
    secs = dict(eng.prof.s)
    return {"n_prompts": len(prompts), "new_tokens": res.new_tokens, "steps": steps,
            "seconds": {k: round(v, 6) for k, v in secs.items()},
            "ms_per_step": {k: 1e3 * v / steps for k, v in secs.items()} if steps else {}}

