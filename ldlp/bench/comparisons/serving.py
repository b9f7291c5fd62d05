"""An open-loop serving workload: requests arrive on a trace, whatever the engine's pace (vLLM's serving benchmark).

A closed loop at fixed concurrency C hides where adaptivity pays: a server's load changes as requests arrive,
finish and burst, so one γ must compromise across loads. Here :func:`arrival_times` makes the trace: gaps drawn
from a gamma distribution of mean 1/rate and shape ``burstiness`` (1: Poisson; below 1: bursts and lulls), the
rate constant or ramping from ``rate[0]`` to ``rate[1]`` and back over the requests (``shape: ramp``), seeded.
:func:`run_serving` admits each request when its time has come into a free slot of the engine (queued while all
``slots`` are busy), steps the engine while anything runs, and waits for the next arrival when nothing does.

Reported per run (:class:`ServingResult`): output tokens/s over the run (first arrival to last token), and per
request, median and p99 of the time to first token (arrival to first token: queueing and prefill included), the
time per output token after the first ((last − first) / (n − 1)) and the end-to-end latency (arrival to last
token); the steps' running rows over time (the load the policies saw).

:func:`serve` runs every contender on the same trace in turns (the order rotating between rounds and traces),
checks greedy outputs against the target's own, and gives each contender's throughput ratio to the best static
γ on that trace with a paired bootstrap interval over rounds (``ldlp.bench.harness.stats.paired_ratio``). A
contender's policy object lives across its runs, as a server keeps running: its online state (acceptance rates,
the goodput learner, the step-cost model) is warm after the first ``warmup_rounds``, which are run in turns like
the others and reported apart, not in the ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from eagle_backbone.step_records import GenerationOutput
from eagle_backbone.errors import ConfigError
from eagle_backbone.step_cost import OnlineCostModel
from eagle_backbone.timing import interleaved
from ldlp.bench.harness.engines import EngineFactory
from ldlp.bench.harness.identity import GreedyReference
from ldlp.bench.harness.workload import percentile

SHAPES = ("constant", "ramp")


def check_trace(name: str, spec) -> dict:
    """A trace's settings as plain values, or one ConfigError line naming the trace and the key."""
    spec = dict(spec)
    known = {"requests", "rate", "shape", "burstiness", "seed"}
    bad = sorted(set(spec) - known)
    if bad:
        raise ConfigError(f"traces.{name}: unknown keys {bad}; known: {sorted(known)}")
    n, shape, b = spec.get("requests"), spec.get("shape", "constant"), spec.get("burstiness", 1.0)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"traces.{name}.requests must be an integer >= 1, got {n!r}")
    if shape not in SHAPES:
        raise ConfigError(f"traces.{name}.shape must be one of {list(SHAPES)}, got {shape!r}")
    rate = spec.get("rate")
    rates = list(rate) if isinstance(rate, (list, tuple)) or (hasattr(rate, "__iter__") and not isinstance(rate, str)) \
        else [rate]
    if len(rates) != (2 if shape == "ramp" else 1) or any(isinstance(r, bool) or not isinstance(r, (int, float))
                                                          or not r > 0 for r in rates):
        want = "[low, peak] requests/s (two numbers > 0)" if shape == "ramp" else "a number > 0 (requests/s)"
        raise ConfigError(f"traces.{name}.rate must be {want}, got {rate!r}")
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0:
        raise ConfigError(f"traces.{name}.burstiness must be a number > 0 (1: Poisson), got {b!r}")
    return {"requests": n, "rate": [float(r) for r in rates], "shape": shape, "burstiness": float(b),
            "seed": int(spec.get("seed", 0))}


def arrival_times(spec: dict) -> np.ndarray:
    """(requests,) arrival seconds from the start of the run (the first at 0), from :func:`check_trace`'s spec."""
    n, rates, b = spec["requests"], spec["rate"], spec["burstiness"]
    i = np.arange(n)
    if spec["shape"] == "ramp":  # low -> peak at the middle request -> low
        tri = 1 - np.abs(2 * i / max(n - 1, 1) - 1)
        rate = rates[0] + (rates[1] - rates[0]) * tri
    else:
        rate = np.full(n, rates[0])
    gaps = np.random.default_rng(spec["seed"]).gamma(b, 1.0 / (b * rate))
    gaps[0] = 0.0
    return np.cumsum(gaps)


@dataclass
class ServingResult:
    outputs: list[GenerationOutput]  # in request order
    wall_s: float  # first arrival to last token
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (seconds, running rows, queued) a step
    steps: int = 0
    idle_s: float = 0.0  # waiting for arrivals with nothing to run

    @property
    def new_tokens(self) -> int:
        return sum(len(o.tokens) for o in self.outputs)

    def summary(self, new_tokens: int | None = None, drafted: int | None = None, accepted: int | None = None,
                tau: float | None = None) -> dict:
        """The run's numbers; the counts come from the outputs' stats, or are given (a peer engine's outputs are
        token ids, its counters its own)."""
        ms = 1e3

        def stats(name, xs):
            return {f"{name}_ms_median": ms * statistics.median(xs) if xs else 0.0,
                    f"{name}_ms_p99": ms * percentile(xs, 0.99)}

        rows = [r for _, r, _ in self.timeline]
        if new_tokens is None:
            new_tokens = self.new_tokens
            drafted = sum(o.stats.drafted_tokens for o in self.outputs)
            accepted = sum(o.stats.accepted_tokens for o in self.outputs)
            forwards = sum(o.stats.target_forwards for o in self.outputs)
            tau = (accepted + forwards) / forwards if forwards else 0.0
        busy = self.wall_s - self.idle_s
        return {"new_tokens": new_tokens, "wall_s": self.wall_s,
                "tokens_per_s": new_tokens / self.wall_s if self.wall_s > 0 else 0.0,
                "tokens_per_busy_s": new_tokens / busy if busy > 0 else 0.0,
                "steps": self.steps, "idle_s": self.idle_s, "drafted_tokens": drafted, "accepted_tokens": accepted,
                "tau": tau,
                "rows_mean": float(np.mean(rows)) if rows else 0.0, "rows_max": max(rows, default=0),
                **stats("ttft", self.ttft_s), **stats("tpot", self.tpot_s), **stats("e2e", self.e2e_s)}


def run_serving(engine, prompts: list[list[int]], arrivals, max_new_tokens: int,
                seeds: list[int] | None = None, clock=time.perf_counter, sleep=time.sleep) -> ServingResult:
    """Serve ``prompts[i]`` arriving at ``arrivals[i]`` seconds (nondecreasing) on ``engine`` (a
    :class:`BatchedSpeculativeEngine`; its ``slots`` bound the requests in flight, the rest queue in arrival order).
    ``clock`` and ``sleep`` pace the arrivals (a test passes its own); a request's latencies are its wait for a
    slot on that clock plus its time in the engine on the engine's."""
    arrivals = [float(a) for a in arrivals]
    if len(arrivals) != len(prompts) or not prompts:
        raise ValueError(f"{len(arrivals)} arrival times for {len(prompts)} prompts: give one per prompt (at least one)")
    if any(b < a for a, b in zip(arrivals, arrivals[1:])):
        raise ValueError("arrival times must be nondecreasing")
    seeds = list(range(len(prompts))) if seeds is None else list(seeds)
    outputs: list[GenerationOutput | None] = [None] * len(prompts)
    res = ServingResult([], 0.0)
    nxt, waiting, in_flight = 0, [], {}  # next arrival; arrived and queued; slot -> request
    t0 = clock()
    free = list(range(engine.slots))[::-1]
    waited: dict[int, float] = {}  # request -> seconds from its arrival to its admission

    def collect(slot: int):
        s = engine.state[slot]
        i = s.request
        outputs[i] = GenerationOutput(s.new, s.stats)
        times, before = s.token_times, waited[i] - s.t_admit  # + an engine time: seconds since arrival
        if times:
            res.ttft_s.append(times[0] + before)
            res.e2e_s.append(times[-1] + before)
            if len(times) > 1:
                res.tpot_s.append((times[-1] - times[0]) / (len(times) - 1))
        in_flight.pop(slot, None)
        free.append(slot)

    while nxt < len(prompts) or waiting or in_flight:
        now = clock() - t0
        while nxt < len(prompts) and arrivals[nxt] <= now:
            waiting.append(nxt)
            nxt += 1
        while waiting and free:
            i, slot = waiting.pop(0), free.pop()
            engine.admit(slot, prompts[i], max_new_tokens, seeds[i], request=i)
            waited[i] = clock() - t0 - arrivals[i]
            in_flight[slot] = i
            if engine.state[slot].done:  # max_new_tokens == 0
                collect(slot)
        if not in_flight:
            if nxt < len(prompts):  # nothing to run until the next arrival
                wait = arrivals[nxt] - (clock() - t0)
                if wait > 0:
                    sleep(wait)
                    res.idle_s += wait
            continue
        for slot in engine.step():
            collect(slot)
        res.steps += 1
        res.timeline.append((clock() - t0, len(engine.running()), len(waiting)))
    res.wall_s = clock() - t0
    res.outputs = outputs
    return res


# ---- contenders in turns on the same traces ------------------------------------------------------------------


def _learner(policy) -> dict | None:
    fb = getattr(policy, "goodput", None)
    if fb is None:
        return None
    return {**fb.summary(), "schedule": {str(k): v for k, v in fb.schedule().items()},
            "history": [[s, r, a if isinstance(a, str) else int(a)] for s, r, a in (fb.history or [])]}


def serve(target, candidates, prompts: list[list[int]], contenders: list, traces: dict,
          max_new_tokens: int, sampling=None, rounds: int = 2, warmup_rounds: int = 1, slots: int = 32,
          seed: int = 0, attn: str = "eager", log: Callable[[str], None] = print,
          checkpoint: Callable[[dict], None] | None = None, bootstrap: int = 2000) -> dict:
    """Every contender (:class:`~ldlp.bench.comparisons.load_sweep.Contender` of this engine) on every trace
    (``traces``: {name: spec}), ``warmup_rounds`` + ``rounds`` times, in turns; returns {"runs", "rows", "learners",
    "skipped"} (``checkpoint``: the partial result after each run). The oracles replay every prompt first, untimed, and
    run only when decoding is greedy."""
    from eagle_backbone.sampling import SamplingConfig
    from ldlp.bench.comparisons.load_sweep import replayed_labels, warm_replays

    sampling = sampling or SamplingConfig()
    skipped = []
    replayed = replayed_labels(contenders)
    if replayed and not sampling.greedy:
        skipped += [{"contender": c, "why": "defined for greedy decoding only"} for c in sorted(replayed)]
        contenders = [c for c in contenders if c.label not in replayed]
    specs = {name: check_trace(name, spec) for name, spec in traces.items()}
    for name, spec in specs.items():
        if spec["requests"] > len(prompts):
            raise ConfigError(f"traces.{name}.requests={spec['requests']} but only {len(prompts)} prompts are loaded "
                              "(raise data.limit or lower requests)")
    engines = EngineFactory.for_prompts(target, candidates, prompts, max_new_tokens, attn)
    ref = GreedyReference.of_target(target, prompts, max_new_tokens, log) if sampling.greedy else None
    for c in contenders:
        if c.label in replayed:
            log(f"{c.label}: replaying the engine with one slot on {len(prompts)} prompts (untimed)")
            warm_replays(c, target, candidates, prompts, max_new_tokens, sampling)
    policies = {c.label: (c.make() if c.make is not None else None) for c in contenders}  # one server each
    models = {c.label: OnlineCostModel() for c in contenders}
    runs: list[dict] = []
    learners: dict = {}
    total = warmup_rounds + rounds
    arrivals = {name: arrival_times(spec) for name, spec in specs.items()}  # each trace's, the same every round

    def one_run(c, name: str, r: int) -> None:
        idx = list(range(specs[name]["requests"]))
        where = {"round": r, "warmup": r < warmup_rounds, "trace": name}
        if c.runner is not None:  # a peer engine (vLLM) serves the same trace on its own scheduler
            runs.append(_peer_run(c, [prompts[i] for i in idx], arrivals[name], max_new_tokens,
                                  [seed + i for i in idx], slots, sampling, target.eos_token_ids, ref, idx, where))
        else:
            eng = engines(slots, policies[c.label], sampling, cost_model=models[c.label])
            fb = getattr(policies[c.label], "goodput", None)
            start = len(fb.history) if fb is not None else None
            res = run_serving(eng, [prompts[i] for i in idx], arrivals[name], max_new_tokens,
                              [seed + i for i in idx])
            same = None if ref is None else sum(ref.same([o.tokens for o in res.outputs], idx))
            runs.append({**where, "contender": c.label, "policy": c.policy, "gamma": c.gamma,
                         "temperature": sampling.temperature, **res.summary(), "identical": same,
                         "n_requests": len(idx), "policy_s": eng.policy_s,
                         "timeline": [[round(t, 4), n, q] for t, n, q in res.timeline],
                         # this run's choices in the learner's history (it lives across runs, as a server)
                         "learner_span": None if fb is None else [start, len(fb.history)]})
            if fb is not None:
                learners[c.label] = _learner(policies[c.label])
        log(_run_line(runs[-1]))
        if checkpoint:
            checkpoint({"runs": runs, "rows": serving_rows(runs, bootstrap, seed), "learners": learners,
                        "traces": specs, "skipped": skipped, "complete": False})

    for r in range(total):  # in round r, trace ti starts with contender (r + ti) mod n
        interleaved(contenders, list(specs), 1, lambda c, name, ti, _: one_run(c, name, r), order="rotate", offset=r)
    return {"runs": runs, "rows": serving_rows(runs, bootstrap, seed), "learners": learners, "traces": specs,
            "skipped": skipped, "complete": True}


def _run_line(run: dict) -> str:
    same = run["identical"]
    return (f"round {run['round']}{' (warm-up)' if run['warmup'] else ''} {run['trace']:<8} {run['contender']:<24} "
            f"{run['tokens_per_s']:7.1f} tok/s  TPOT p50 {run['tpot_ms_median']:6.1f} ms  p99 {run['tpot_ms_p99']:6.1f} ms"
            + ("" if same is None else f"  identical {same}/{run['n_requests']}"))


def _peer_run(c, prompts, arrivals, max_new_tokens, seeds, slots, sampling, stop_ids, ref, idx, where: dict) -> dict:
    """One run of a peer contender (``c.runner``: :meth:`~ldlp.bench.peers.vllm_peer.VllmRunner.serve`) on a trace, as
    :func:`serve` records this engine's runs; its greedy outputs checked against the target's like every run."""
    outs, summ = c.runner.serve(prompts, arrivals, max_new_tokens, seeds, slots, sampling, stop_ids)
    same = None if ref is None else sum(ref.same(outs, idx))
    timeline = summ.pop("timeline", None) or []
    return {**where, "contender": c.label, "policy": c.policy, "gamma": c.gamma, "temperature": sampling.temperature,
            **summ, "identical": same, "n_requests": len(idx), "policy_s": 0.0,
            "timeline": [[round(t, 4), n, q] for t, n, q in timeline], "learner_span": None}


def serving_rows(runs: list[dict], bootstrap: int = 2000, seed: int = 0) -> list[dict]:
    """Per trace and contender, over the measured (not warm-up) rounds: medians of the run metrics, and the
    throughput ratio to the trace's best static γ (best by total tokens/s) with a paired bootstrap interval over
    rounds, and to batched AR; the same over busy seconds (the run's seconds less those with nothing in flight:
    open loop, a contender that keeps up serves what arrives, and the busy seconds are where it differs), against
    the static γ best by that measure."""
    from ldlp.bench.harness.stats import paired_ratio

    measured = [r for r in runs if not r["warmup"]]
    out = []
    for trace in dict.fromkeys(r["trace"] for r in measured):
        mine = [r for r in measured if r["trace"] == trace]
        by = {c: [r for r in mine if r["contender"] == c] for c in dict.fromkeys(r["contender"] for r in mine)}
        rounds = sorted({r["round"] for r in mine})
        complete = {c: rs for c, rs in by.items() if sorted(r["round"] for r in rs) == rounds}

        def rate(rs):
            return sum(r["new_tokens"] for r in rs) / sum(r["wall_s"] for r in rs)

        def busy(r):
            return r["wall_s"] - r["idle_s"]

        def busy_rate(rs):
            return sum(r["new_tokens"] for r in rs) / sum(busy(r) for r in rs)

        statics = [c for c, rs in complete.items() if rs[0]["policy"] == "static"]
        best = max(statics, key=lambda c: rate(complete[c])) if statics else None
        best_busy = max(statics, key=lambda c: busy_rate(complete[c])) if statics else None  # by its own measure
        ar = next((c for c, rs in complete.items() if rs[0]["policy"] == "ar"), None)
        for c, rs in by.items():
            row = {"trace": trace, "contender": c, "policy": rs[0]["policy"], "gamma": rs[0]["gamma"],
                   "rounds": len(rs), "tokens_per_s": rate(rs), "best_static": best, "best_static_busy": best_busy,
                   "tokens_per_busy_s": busy_rate(rs),
                   "identical": None if rs[0]["identical"] is None else sum(r["identical"] for r in rs),
                   "n_requests": sum(r["n_requests"] for r in rs),
                   "policy_share": sum(r["policy_s"] for r in rs) / sum(r["wall_s"] - r["idle_s"] for r in rs)}
            for k in ("ttft_ms_median", "ttft_ms_p99", "tpot_ms_median", "tpot_ms_p99", "e2e_ms_median",
                      "e2e_ms_p99", "tau", "rows_mean"):
                row[k] = statistics.median(r[k] for r in rs)
            row["drafts_per_row_step"], row["tokens_per_row_step"] = per_row_step(rs)
            for name, base, seconds in (("vs_best_static", best, "wall_s"), ("vs_ar", ar, "wall_s"),
                                        ("vs_best_static_busy", best_busy, busy), ("vs_ar_busy", ar, busy)):
                if base is None or c not in complete:
                    continue
                num, den = sorted(rs, key=lambda r: r["round"]), sorted(complete[base], key=lambda r: r["round"])
                secs = (lambda r: r[seconds]) if isinstance(seconds, str) else seconds
                row[name] = paired_ratio([r["new_tokens"] for r in num], [secs(r) for r in num],
                                         [r["new_tokens"] for r in den], [secs(r) for r in den],
                                         bootstrap=bootstrap, seed=seed)
            out.append(row)
        these = out[-len(by):]
        chains = [(r["drafts_per_row_step"], r["tokens_per_row_step"]) for r in these if r["policy"] == "static"]
        for r in these:
            if r["policy"] not in ("static", "vllm", "ar"):
                r["vs_chains"] = vs_chains(chains, r["drafts_per_row_step"], r["tokens_per_row_step"])
    return out


def per_row_step(runs: list[dict]) -> tuple[float, float]:
    """(drafts, tokens) a running row emits a step over ``runs``: their sums over the rows of every step (the
    timeline's, else the runs' mean rows × steps)."""
    row_steps = sum(sum(n for _, n, _ in r["timeline"]) if r.get("timeline") else r["rows_mean"] * r["steps"]
                    for r in runs)
    if not row_steps:
        return 0.0, 0.0
    return sum(r["drafted_tokens"] for r in runs) / row_steps, sum(r["new_tokens"] for r in runs) / row_steps


def vs_chains(chains: list[tuple[float, float]], drafts: float, tokens: float) -> float | None:
    """A policy's tokens a row-step over what the static chains give at its drafts a row-step: the line between
    the two chains whose drafts bracket it (their tokens are concave in γ, so the line is what drafting either of
    them at random, with no information, gives). Below 1: its drafts keep fewer tokens than an uninformed mix of
    neighbouring chains, so its γ wanders between steps; above 1: its choices know something (the oracle's).
    None outside the chains' range."""
    pts = sorted(chains)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= drafts <= x1 and x1 > x0:
            return tokens / (y0 + (y1 - y0) * (drafts - x0) / (x1 - x0))
    return None
