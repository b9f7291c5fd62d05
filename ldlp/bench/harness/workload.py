"""Continuous batching: keep C sequences in flight; a finished sequence's slot takes the next prompt.

All prompts are queued at the start (a closed workload). Reported: generated tokens/s over the run,
per-token latency (the gaps between a sequence's consecutive tokens: tokens accepted in one step arrive
together, so a gap is 0 inside a step and a step's length across steps), and per-request latency (from
admission to the last token; the time spent queued is reported apart).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from itertools import pairwise

from eagle_backbone.step_records import GenerationOutput
from eagle_backbone.metrics import GenerationStats, total


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) without numpy."""
    if not values:
        return 0.0
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


@dataclass
class WorkloadResult:
    outputs: list[GenerationOutput]  # in prompt order
    wall_s: float
    token_gaps_s: list[float] = field(default_factory=list)
    request_s: list[float] = field(default_factory=list)  # admission -> last token
    request_s_by_prompt: dict[int, float] = field(default_factory=dict)  # the same, keyed by prompt index
    queued_s: list[float] = field(default_factory=list)  # start -> admission
    first_token_s: list[float] = field(default_factory=list)  # admission -> first token
    steps: int = 0
    cpu_s: float = 0.0  # this process's CPU time over the run (one thread: the compute it spent)

    @property
    def stats(self) -> GenerationStats:
        return total([o.stats for o in self.outputs])

    @property
    def new_tokens(self) -> int:
        return sum(len(o.tokens) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def by_category(self, categories: list) -> dict[str, dict]:
        """Per category of the prompts (``categories[i]`` for prompt i; None: uncategorised, left out): prompts,
        new tokens, target forwards, τ and mean request latency. In a batch the sequences of all categories
        share every step, so a category has no seconds of its own: its τ and its requests' latency are what
        separate it."""
        out: dict[str, dict] = {}
        for cat in dict.fromkeys(c for c in categories if c is not None):
            idx = [i for i, c in enumerate(categories) if c == cat]
            s = total([self.outputs[i].stats for i in idx])
            lat = [self.request_s_by_prompt[i] for i in idx if i in self.request_s_by_prompt]
            out[str(cat)] = {"n_prompts": len(idx), "new_tokens": s.new_tokens, "target_forwards": s.target_forwards,
                             "tau": s.tau, "request_latency_ms_mean": 1e3 * statistics.fmean(lat) if lat else 0.0}
        return out

    def summary(self) -> dict:
        s = self.stats
        ms = 1e3
        return {"new_tokens": self.new_tokens, "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s,
                "cpu_s": self.cpu_s, "tokens_per_cpu_s": self.new_tokens / self.cpu_s if self.cpu_s > 0 else 0.0,
                "tau": s.tau, "steps": self.steps, "drafted_tokens": s.drafted_tokens,
                "accepted_tokens": s.accepted_tokens,
                "token_latency_ms_mean": ms * statistics.fmean(self.token_gaps_s) if self.token_gaps_s else 0.0,
                "token_latency_ms_p90": ms * percentile(self.token_gaps_s, 0.9),
                "request_latency_ms_mean": ms * statistics.fmean(self.request_s) if self.request_s else 0.0,
                "request_latency_ms_p90": ms * percentile(self.request_s, 0.9),
                "first_token_ms_mean": ms * statistics.fmean(self.first_token_s) if self.first_token_s else 0.0,
                "queued_ms_mean": ms * statistics.fmean(self.queued_s) if self.queued_s else 0.0}


def run_workload(engine, prompts: list[list[int]], concurrency: int, max_new_tokens: int,
                 seeds: list[int] | None = None) -> WorkloadResult:
    """Decode every prompt with at most ``concurrency`` in flight on ``engine`` (a BatchedSpeculativeEngine)."""
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
    if concurrency > engine.slots:
        raise ValueError(f"concurrency {concurrency} is more streams than the engine's {engine.slots} slots")
    if len(prompts) == 0:
        raise ValueError("no prompts: the workload needs at least one")
    seeds = list(range(len(prompts))) if seeds is None else list(seeds)
    queue = list(range(len(prompts)))[::-1]
    outputs: list[GenerationOutput | None] = [None] * len(prompts)
    res = WorkloadResult([], 0.0)
    t0, c0 = time.perf_counter(), time.process_time()
    in_flight: dict[int, int] = {}  # slot -> prompt index

    def collect(slot: int):
        s = engine.state[slot]
        outputs[s.request] = GenerationOutput(s.new, s.stats)
        times = s.token_times
        res.token_gaps_s.extend(b - a for a, b in pairwise(times))
        if times:
            res.request_s.append(times[-1] - s.t_admit)
            res.request_s_by_prompt[s.request] = times[-1] - s.t_admit
            res.first_token_s.append(times[0] - s.t_admit)
        in_flight.pop(slot, None)

    while queue or in_flight:
        for slot in range(concurrency):
            if slot not in in_flight and queue:
                i = queue.pop()
                engine.admit(slot, prompts[i], max_new_tokens, seeds[i], request=i)
                res.queued_s.append(engine.state[slot].t_admit - t0)
                in_flight[slot] = i
                if engine.state[slot].done:  # max_new_tokens == 0
                    collect(slot)
        if not in_flight:
            continue
        for slot in engine.step():
            collect(slot)
        res.steps += 1
    res.wall_s = time.perf_counter() - t0
    res.cpu_s = time.process_time() - c0
    res.outputs = outputs
    return res
