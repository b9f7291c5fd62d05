"""The open-loop serving workload (ldlp/bench/comparisons/serving.py, scripts/bench_batch.py serving=...): seeded
arrival traces of the asked shape, requests admitted when they arrive and queued while the slots are full, greedy
outputs identical to the target's own, the paired rows and the page. Tiny float32 models; no wall-clock threshold."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from conftest import ar, prompts_of, table

from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.cost import cost_key
from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.errors import ConfigError
from eagle_backbone.policy import StaticPolicy
from ldlp.bench.comparisons.load_sweep import Contender
from ldlp.bench.comparisons.serving import arrival_times, check_trace, run_serving, serve
from ldlp.bench.peers.vllm_schedule import learned_schedules, load_schedule, ranges_from_table
from ldlp.policies.load_aware import LoadAwareStep
from ldlp.report.serving import markdown, plot_learners, render, write
from ldlp.report.vllm_schedule import learned_lines

torch.set_num_threads(1)


def test_traces_are_seeded_and_have_the_asked_shape():
    ramp = check_trace("ramp", {"requests": 2001, "rate": [1.0, 20.0], "shape": "ramp", "seed": 3})
    t = arrival_times(ramp)
    assert t[0] == 0 and (np.diff(t) >= 0).all() and np.array_equal(t, arrival_times(ramp))
    gaps = np.diff(t)
    # the middle of a ramp arrives ~20x as fast as its ends
    assert gaps[:200].mean() > 5 * gaps[900:1100].mean() and gaps[-200:].mean() > 5 * gaps[900:1100].mean()
    poisson = arrival_times(check_trace("p", {"requests": 4000, "rate": 5.0}))
    bursty = arrival_times(check_trace("b", {"requests": 4000, "rate": 5.0, "burstiness": 0.2}))
    for x in (poisson, bursty):  # the same mean rate
        assert np.diff(x).mean() == pytest.approx(0.2, rel=0.1)
    cv = lambda x: np.diff(x).std() / np.diff(x).mean()  # noqa: E731
    assert cv(poisson) == pytest.approx(1.0, abs=0.1) and cv(bursty) > 1.8  # burstier: gaps vary more


@pytest.mark.parametrize("spec, match", [
    ({"requests": 0, "rate": 1.0}, "traces.x.requests must be an integer >= 1"),
    ({"requests": 4, "rate": 1.0, "shape": "ramp"}, r"traces.x.rate must be \[low, peak\]"),
    ({"requests": 4, "rate": -1.0}, "traces.x.rate must be a number > 0"),
    ({"requests": 4, "rate": 1.0, "burstiness": 0}, "traces.x.burstiness must be a number > 0"),
    ({"requests": 4, "rate": 1.0, "sahpe": "ramp"}, r"traces.x: unknown keys \['sahpe'\]"),
])
def test_bad_traces_are_one_line_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        check_trace("x", spec)


def test_requests_wait_for_their_arrival_and_for_a_free_slot(t32, eagle32):
    prompts = prompts_of((4, 7, 5, 9, 6), seed=4)
    slept = []  # a clock that a sleep moves on at once
    clock = lambda: time.perf_counter() + sum(slept)  # noqa: E731
    eng = BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=2, policy=StaticPolicy(3))
    # three at once (two slots: one queues), then two after a pause with nothing running
    res = run_serving(eng, prompts, [0.0, 0.0, 0.0, 30.0, 30.0], 10, clock=clock, sleep=slept.append)
    assert [o.tokens for o in res.outputs] == ar(t32, prompts, 10)
    assert len(slept) == 1 and res.idle_s > 0  # it waited for the last two instead of spinning
    assert max(n for _, n, _ in res.timeline) == 2 and max(q for _, _, q in res.timeline) == 1
    s = res.summary()
    assert len(res.ttft_s) == len(res.e2e_s) == 5 and s["tpot_ms_median"] > 0 and s["ttft_ms_p99"] >= s["ttft_ms_median"]
    assert 0 < min(res.ttft_s) and max(res.e2e_s) < 30  # latencies from arrival, the pause not in them
    assert res.wall_s > 30
    with pytest.raises(ValueError, match="nondecreasing"):
        run_serving(eng, prompts[:2], [1.0, 0.0], 4)


def test_contenders_serve_the_same_trace_in_turns_losslessly(tmp_path, t32, eagle32):
    key = cost_key("tiny", t32.dtype, t32.device, torch.get_num_threads())
    path = tmp_path / "cost.json"
    table(0.05, 0.5, key=key).save(path)
    contenders = [Contender("ar", "ar", 0, None),
                  Contender("static γ=2", "static", 2, lambda: StaticPolicy(2)),
                  Contender("static γ=4", "static", 4, lambda: StaticPolicy(4)),
                  Contender("load_aware_step", "load_aware", None, lambda: LoadAwareStep(
                      {"cost_dir": str(tmp_path), "model": "tiny", "cost_table": str(path), "online_costs": False},
                      max_gamma=4, goodput=True))]
    prompts = prompts_of((3, 8, 5, 6, 4, 7), seed=9)
    traces = {"ramp": {"requests": 6, "rate": [50.0, 400.0], "shape": "ramp"}}
    result = serve(t32, EagleCandidateGenerator(eagle32, t32), prompts, contenders, traces, 12, rounds=2,
                   warmup_rounds=1, slots=3, log=lambda m: None, bootstrap=50)
    assert len(result["runs"]) == 3 * 4 and all(r["identical"] == 6 for r in result["runs"])
    rows = {r["contender"]: r for r in result["rows"]}
    assert set(rows) == {c.label for c in contenders} and all(r["rounds"] == 2 for r in rows.values())
    best = rows["ar"]["best_static"]
    assert best in ("static γ=2", "static γ=4") and rows[best]["vs_best_static"]["ratio"] == 1.0
    assert rows["load_aware_step"]["vs_ar"]["pairs"] == 2
    # the learner lived across the runs: its history spans them all, each run's span inside it
    learner = result["learners"]["load_aware_step"]
    spans = [r["learner_span"] for r in result["runs"] if r["contender"] == "load_aware_step"]
    assert spans[0][0] == 0 and spans[-1][1] == len(learner["history"]) and learner["buckets"]
    page = markdown(result, {"model": "tiny", "command": "python scripts/bench_batch.py serving=ramp"})
    assert page.startswith("# Serving: requests on arrival traces\n")  # the page's render check (its rows: above)
    assert plot_learners(result, tmp_path / "learner.png").is_file()
    # what the learner learned, as a vLLM Dynamic-SD schedule that the vLLM contender loads as it is
    write(result, tmp_path / "out", {"model": "tiny"})
    assert render(tmp_path / "out") == tmp_path / "out"  # again from serving.json alone
    assert (tmp_path / "out" / "serving.md").is_file()
    assert all("vs_best_static_busy" in r for r in rows.values())  # the row behind the page's busy-second column
    # drafts and tokens a running row, counted over every step's rows; only a policy's rows are set beside the chains
    assert rows["ar"]["drafts_per_row_step"] == 0 and rows["static γ=4"]["drafts_per_row_step"] > \
        rows["static γ=2"]["drafts_per_row_step"] > 0 and "vs_chains" not in rows["static γ=2"]
    assert "vs_chains" in rows["load_aware_step"]
    (f,) = (tmp_path / "out").glob("learned_schedule_*.json")
    sched = load_schedule(f)
    assert sched["ranges"][0][0] == 1 and sched["ranges"] == learned_schedules(tmp_path / "out")["load_aware_step"]["ranges"]
    rec = {"max_batch": 4, "k_max": 3, "schedule": [(1, 2, 3), (3, 4, 1)]}
    assert "| tuned here (`1-2:3,3-4:1`) | 3 | 3 | 1 | 1 |" in "\n".join(learned_lines(rec, learned_schedules(
        tmp_path / "out")))


class _ServingPeer:
    """A peer runner without vLLM: the target's own greedy outputs (one token changed with ``wrong``), every
    token out at its arrival plus fixed seconds, as VllmRunner.serve reports a run."""

    def __init__(self, target, wrong=False):
        self.target, self.wrong, self.calls = target, wrong, []

    def serve(self, prompts, arrivals, max_new_tokens, seeds, slots, sampling=None, stop_ids=()):
        from ldlp.bench.comparisons.serving import ServingResult

        self.calls.append((len(prompts), list(arrivals), slots, sorted(stop_ids)))
        outs = [self.target.reference_greedy(p, max_new_tokens) for p in prompts]
        if self.wrong:
            outs[0] = [(outs[0][0] + 1) % self.target.vocab_size] + outs[0][1:]
        res = ServingResult([], float(arrivals[-1]) + 0.5, ttft_s=[0.1] * len(outs), tpot_s=[0.01] * len(outs),
                            e2e_s=[0.2] * len(outs), timeline=[(0.1, 2, 0), (0.2, 1, 0)], steps=2, idle_s=0.1)
        tok = sum(map(len, outs))
        return outs, {**res.summary(new_tokens=tok, drafted=0, accepted=0, tau=1.0), "timeline": res.timeline}


def test_a_peer_engine_serves_the_same_trace_in_the_turns(t32, eagle32):
    """A peer (vLLM's runner) serves every trace in the same turns, with the same arrivals, slots and stop
    tokens; its outputs are checked against the target's, and its row sits beside this engine's."""
    ok, wrong = _ServingPeer(t32), _ServingPeer(t32, wrong=True)
    contenders = [Contender("ar", "ar", 0, None), Contender("static γ=2", "static", 2, lambda: StaticPolicy(2)),
                  Contender("vllm ar", "vllm", 0, None, ok), Contender("vllm eagle k=2", "vllm", 2, None, wrong)]
    prompts = prompts_of((3, 8, 5, 6), seed=2)
    traces = {"flat": {"requests": 4, "rate": 200.0}}
    result = serve(t32, EagleCandidateGenerator(eagle32, t32), prompts, contenders, traces, 8, rounds=2,
                   warmup_rounds=1, slots=3, log=lambda m: None, bootstrap=50)
    arrivals = list(arrival_times(check_trace("flat", traces["flat"])))
    assert ok.calls == [(4, arrivals, 3, sorted(t32.eos_token_ids))] * 3  # warm-up and 2 measured rounds
    runs = {(r["contender"], r["round"]): r for r in result["runs"]}
    assert runs[("vllm ar", 1)]["identical"] == 4 and runs[("vllm eagle k=2", 1)]["identical"] == 3
    assert runs[("vllm ar", 1)]["timeline"] == [[0.1, 2, 0], [0.2, 1, 0]] and runs[("vllm ar", 1)]["policy_s"] == 0.0
    rows = {r["contender"]: r for r in result["rows"]}
    assert rows["vllm ar"]["ttft_ms_median"] == pytest.approx(100.0) and rows["vllm ar"]["tau"] == 1.0
    # vLLM's rows are neither the best static γ nor AR, and are paired against them
    assert rows["vllm ar"]["best_static"] == "static γ=2" and rows["vllm ar"]["vs_best_static"]["pairs"] == 2
    assert "| vllm eagle k=2 |" in markdown(result, {"model": "tiny"})


def test_a_learned_table_becomes_ranges():
    assert ranges_from_table({1: 4, 2: 4, 4: 3, 8: 1, 16: 1}) == [(1, 2, 4), (3, 4, 3), (5, 16, 1)]
    assert ranges_from_table({"1": 0}) == [(1, 1, 0)]


def test_a_policys_drafts_are_set_beside_the_chains_line_at_its_drafts():
    """vs chains: tokens a row-step over the line between the two static chains that bracket the policy's drafts
    a row-step (drafting either at random, uninformed); below 1 its γ wanders, above 1 it knows something."""
    from ldlp.bench.comparisons.serving import per_row_step, vs_chains

    chains = [(0.95, 1.8), (1.9, 2.5), (2.8, 3.0)]  # γ = 1, 2, 3: concave, drafts capped near the end
    assert vs_chains(chains, 1.9, 2.5) == pytest.approx(1.0)  # a chain's own point
    assert vs_chains(chains, 2.35, 2.75) == pytest.approx(1.0)  # halfway between γ = 2 and 3: their average
    assert vs_chains(chains, 2.35, 2.6) == pytest.approx(2.6 / 2.75)  # γ wandering further than 2 and 3 lose
    assert vs_chains(chains, 2.35, 3.3) == pytest.approx(3.3 / 2.75)  # an oracle's drafts keep more
    assert vs_chains(chains, 3.5, 3.1) is None and vs_chains([], 1.0, 1.5) is None  # outside the chains' range
    runs = [{"timeline": [[0.0, 2, 0], [0.1, 3, 0]], "drafted_tokens": 10, "new_tokens": 15},
            {"timeline": [], "rows_mean": 2.0, "steps": 5, "drafted_tokens": 0, "new_tokens": 10}]
    assert per_row_step(runs) == pytest.approx((10 / 15, 25 / 15))  # 2 + 3 row-steps, then 2 x 5
