"""vLLM's Dynamic SD schedule (ldlp/bench/peers/vllm_schedule.py, vllm_tune.py, issue 36): the choice against brute
force on synthetic step costs and acceptances, the schedule file and its one-line refusals, the K per batch size as vLLM
resolves a schedule, the step model, the held-out comparison and its goals (all without vLLM); and one test that
runs vLLM with a schedule where a Python with vLLM is given (ADAEAGLE_VLLM_PYTHON, like tests/test_vllm_peer.py)."""

import itertools
import json
import math
import random

import numpy as np
import pytest
from conftest import needs_vllm, vllm_python

from eagle_backbone.paths import REPO_ROOT
from ldlp.bench.peers.vllm_schedule import (
    StepModel,
    acceptance_by_position,
    check_schedule,
    choose_schedule,
    decode_steps,
    dense_lookup,
    expected_tokens,
    load_schedule,
    snippet,
)

EMBEDDED = REPO_ROOT / "data" / "embedded"


def _synthetic(seed, max_batch, ks):
    """A decreasing acceptance by position and a step cost table with a per-K shape that changes with B."""
    rng = random.Random(seed)
    p, q = [], 1.0
    for _ in range(max(ks)):
        q *= rng.uniform(0.4, 0.95)
        p.append(q)
    base, row, tok, drf = rng.uniform(5, 10), rng.uniform(0.05, 0.6), rng.uniform(0.05, 0.5), rng.uniform(0.3, 2)
    table = {(B, K): base + row * B + tok * B * (K + 1) + drf * K * (1 + 0.1 * B) * rng.uniform(0.9, 1.1)
             for B in range(1, max_batch + 1) for K in ks}
    return p, lambda B, K: table[(B, K)]


@pytest.mark.parametrize("seed", range(12))
def test_the_choice_is_the_brute_force_best(seed):
    ks, max_batch = [1, 2, 3], 6
    p, cost = _synthetic(seed, max_batch, ks)
    got = choose_schedule(max_batch, ks, {K: expected_tokens(p, K) for K in ks}, cost)

    def rate(B, K):
        return 1e3 * B * (1 + sum(p[:K])) / cost(B, K)

    # every assignment of a K to each batch size: the best total expected tokens/s over the batch sizes
    best_total = max(sum(rate(B, K) for B, K in zip(range(1, max_batch + 1), combo))
                     for combo in itertools.product(ks, repeat=max_batch))
    lookup = dense_lookup(check_schedule(got["ranges"], max(ks)), max_batch, max(ks))
    assert sum(rate(B, K) for B, K in zip(range(1, max_batch + 1), lookup)) == pytest.approx(best_total)
    for B, K in zip(range(1, max_batch + 1), lookup):
        assert rate(B, K) == pytest.approx(max(rate(B, k) for k in ks))
        assert K == got["per_batch"][B - 1]["k"] == got["per_batch"][B - 1]["best_k"]
    # ranges are maximal: neighbours differ in K, and they cover 1..max_batch
    assert got["ranges"][0][0] == 1 and got["ranges"][-1][1] == max_batch
    assert all(a[2] != b[2] and a[1] + 1 == b[0] for a, b in zip(got["ranges"], got["ranges"][1:]))


@pytest.mark.parametrize("seed", range(8))
def test_a_margin_gives_the_fewest_ranges_within_it_as_brute_force_does(seed):
    ks, max_batch, margin = [1, 2, 3], 7, 0.04
    p, cost = _synthetic(100 + seed, max_batch, ks)
    tokens = {K: expected_tokens(p, K) for K in ks}
    got = choose_schedule(max_batch, ks, tokens, cost, margin=margin)
    rate = {(B, K): 1e3 * B * tokens[K] / cost(B, K) for B in range(1, max_batch + 1) for K in ks}
    best = {B: max(rate[(B, K)] for K in ks) for B in range(1, max_batch + 1)}

    def key(combo):  # fewest ranges, then most total rate
        return (1 + sum(a != b for a, b in zip(combo, combo[1:])), -sum(rate[(B, K)] for B, K in enumerate(combo, 1)))

    ok = [c for c in itertools.product(ks, repeat=max_batch)
          if all(rate[(B, K)] >= (1 - margin) * best[B] for B, K in enumerate(c, 1))]
    want = min(ok, key=key)
    path = tuple(row["k"] for row in got["per_batch"])
    assert key(path) == pytest.approx(key(want)) and len(got["ranges"]) == key(want)[0]
    plain = choose_schedule(max_batch, ks, tokens, cost)
    assert len(got["ranges"]) <= len(plain["ranges"])


def test_a_budget_prices_larger_k_lower():
    from ldlp.bench.peers.vllm_schedule import expected_steps, expected_tau, tokens_per_step

    p = [0.9, 0.8, 0.7, 0.6]
    assert expected_steps(p, 0, 5) == pytest.approx(5.0)  # no drafts: one token a step
    assert expected_steps([1.0, 1.0], 2, 7) == pytest.approx(3.0)  # 3 + 3 + the last token
    # at K = 1 with p = 0.5: S(1) = 1, S(2) = 1 + 0.5 S(1) + 0.5 S(0) = 1.5
    assert expected_steps([0.5], 1, 2) == pytest.approx(1.5)
    for K in (1, 2, 3, 4):
        steady = expected_tokens(p, K)
        assert tokens_per_step(p, K, None) == steady
        assert tokens_per_step(p, K, [10_000]) == pytest.approx(steady, rel=2e-3)
        assert tokens_per_step(p, K, [12]) < steady
    loss = [tokens_per_step(p, K, [20]) / expected_tokens(p, K) for K in (1, 2, 3, 4)]
    assert loss == sorted(loss, reverse=True)  # the budget costs a larger K more
    assert expected_tau(p, 2, [1, 1]) == pytest.approx(1.0)  # a one-token request: its prefill alone


def test_ties_go_to_the_smaller_k_and_bad_inputs_are_refused():
    got = choose_schedule(3, [1, 2], {1: 1.0, 2: 1.0}, lambda B, K: 10.0)
    assert got["ranges"] == [[1, 3, 1]]
    with pytest.raises(ValueError, match=r"no expected tokens per step for K = \[2\]"):
        choose_schedule(3, [1, 2], {1: 1.5}, lambda B, K: 10.0)


def test_vllms_resolution_of_a_schedule():
    # gaps carry the K before them forward, the tail the last K, every K clamped to num_speculative_tokens
    assert dense_lookup([(1, 16, 3), (32, 128, 2)], 40, 3) == [3] * 31 + [2] * 9
    assert dense_lookup([(1, 2, 5), (3, 4, 1)], 6, 3) == [3, 3, 1, 1, 1, 1]
    assert dense_lookup([[1, 1, 2]], 3, 4) == [2, 2, 2]


@pytest.mark.parametrize("ranges, k_max, why", [
    ([[2, 8, 3], [9, 32, 1]], None, "the first range starts at batch size 2; it must start at 1"),
    ([[1, 8, 3], [8, 32, 1]], None, r"ranges \[1, 8\] and \[8, 32\] overlap or are out of order"),
    ([[1, 8, 3], [4, 6, 1]], None, "overlap or are out of order"),
    ([[9, 32, 1], [1, 8, 3]], None, "overlap or are out of order"),
    ([[1, 8, 5], [9, 32, 1]], 3, r"K = 5 above the maximum 3 \(num_speculative_tokens"),
    ([[1, 8, 40]], None, "K = 40 above the maximum 32"),
    ([[1, 8]], None, "each range must be"),
    ([[1, 8, 2.5]], None, "each range must be"),
    ([[0, 8, 2]], None, "1 <= first batch size <= last batch size"),
    ([[1, 8, -1]], None, "K = -1 < 0"),
])
def test_bad_schedules_are_refused_in_one_line(ranges, k_max, why):
    with pytest.raises(ValueError, match=why) as e:
        check_schedule(ranges, k_max)
    assert "\n" not in str(e.value)


def test_schedule_files(tmp_path):
    snip = snippet([[1, 3, 3], [4, 32, 1]], 3, "eagle")
    (tmp_path / "s.json").write_text(json.dumps(snip))
    got = load_schedule(tmp_path / "s.json")
    assert got["ranges"] == [(1, 3, 3), (4, 32, 1)] and got["k"] == 3
    import yaml

    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"num_speculative_tokens_per_batch_size": [[1, 4, 2], [5, 8, 1]]}))
    assert load_schedule(tmp_path / "s.yaml") == {"ranges": [(1, 4, 2), (5, 8, 1)], "k": 2, "path": str(tmp_path / "s.yaml")}
    (tmp_path / "list.json").write_text("[[1, 4, 2]]")
    assert load_schedule(tmp_path / "list.json", k_max=3)["k"] == 3  # spec.k is num_speculative_tokens
    with pytest.raises(ValueError, match="differs from spec.k=2"):
        load_schedule(tmp_path / "s.json", k_max=2)
    for name, text, why in [("bad.json", "{", "cannot be read as JSON"),
                            ("nokey.json", '{"speculative_config": {"method": "eagle"}}', "no num_speculative_tokens"),
                            ("zero.json", "[[1, 4, 0]]", "every K is 0"),
                            ("late.json", "[[2, 4, 1]]", "must start at 1")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=why):
            load_schedule(tmp_path / name)
    with pytest.raises(ValueError, match="no such file"):
        load_schedule(tmp_path / "missing.json")


def test_the_contender_reads_its_schedule_before_vllm_starts(tmp_path):
    from ldlp.bench.harness.contender import PeerNode, parse_contender
    from ldlp.bench.peers.vllm_peer import contender_label, make_contender

    spec = parse_contender("engine=vllm spec.k=3 spec.schedule=FILE")
    assert spec.peer == PeerNode("vllm", 3, "eagle", "FILE")
    assert parse_contender("engine=vllm spec.schedule=F").peer == PeerNode("vllm", None, "eagle", "F")
    assert contender_label(3, "eagle", [(1, 3, 3), (4, 32, 1)]) == "vllm eagle schedule 1-3:3,4-32:1"
    with pytest.raises(ValueError, match="spec.schedule needs a file"):
        parse_contender("engine=vllm spec.schedule=")
    (tmp_path / "late.json").write_text("[[2, 8, 3], [9, 32, 1]]")
    (tmp_path / "over.json").write_text("[[1, 8, 4], [9, 32, 1]]")
    model = {"drafter_kind": "eagle", "target": str(EMBEDDED / "target"), "drafter": str(EMBEDDED / "drafter")}
    vllm = {"python": "/nonexistent/python"}  # never reached: the file is refused first
    for name, k, why in [("late.json", None, "must start at 1"), ("over.json", 3, "K = 4 above the maximum 3")]:
        with pytest.raises(ValueError, match=why):
            make_contender(PeerNode("vllm", k, "eagle", str(tmp_path / name)), model, [[5, 6]], 8, vllm, tmp_path)


def test_a_vllm_without_dynamic_sd_is_named_in_one_line(tmp_path):
    from ldlp.bench.peers.vllm_peer import check_dynamic_sd

    pkg = tmp_path / "vllm"
    (pkg / "config").mkdir(parents=True)
    (pkg / "config" / "speculative.py").write_text("class SpeculativeConfig:\n    num_speculative_tokens: int = 1\n")
    with pytest.raises(ValueError, match=r"^vLLM 0\.11\.0 at /some/python has no Dynamic SD") as e:
        check_dynamic_sd({"version": "0.11.0", "package": str(pkg)}, "/some/python")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="cannot import vllm"):
        check_dynamic_sd({}, "/some/python")
    (pkg / "config" / "speculative.py").write_text("num_speculative_tokens_per_batch_size: list | None = None\n")
    check_dynamic_sd({"version": "0.32.0", "package": str(pkg)}, "/some/python")


def test_acceptance_by_position_pools_the_k_that_reach_it():
    runs = [{"k": 1, "num_drafts": 100, "accepted_per_pos": [80]},
            {"k": 3, "num_drafts": 50, "accepted_per_pos": [45, 30, 20]}]
    acc = acceptance_by_position(runs)
    assert acc["drafts"] == [150, 50, 50] and acc["accepted"] == [125, 30, 20]
    assert acc["p"] == pytest.approx([125 / 150, 0.6, 0.4])
    assert expected_tokens(acc["p"], 2) == pytest.approx(1 + 125 / 150 + 0.6)


def test_the_step_model_recovers_a_linear_cost_and_meets_the_grid():
    coef = {"fixed": 6.0, "per_row": 0.3, "per_draft_forward": 0.8, "per_draft_token": 0.4}
    rng = np.random.default_rng(0)
    steps = []
    for B, K in itertools.product([1, 2, 4, 8, 16], [1, 2, 3]):
        ms = coef["fixed"] + coef["per_row"] * B + coef["per_draft_forward"] * K + coef["per_draft_token"] * B * K
        for _ in range(9):
            # [wall_s, cpu_s, batch, new_requests, scheduled_tokens, verified, next_k]
            steps.append([1.3 * ms / 1e3, ms * (1 + 0.01 * rng.standard_normal()) / 1e3, B, 0, B * (K + 1), B * K, K])
        steps.append([0.5, 0.5, B, B, 40 * B, 0, K])  # a prefill step: not a decode record
    m = StepModel.fit(decode_steps(steps, "cpu"), anchor_batches={1, 2, 4, 16}, min_anchor_steps=9)
    assert {(c["batch"], c["anchor"]) for c in m.cells} == {(1, True), (2, True), (4, True), (8, False), (16, True)}
    for k, v in coef.items():
        assert m.coef[k] == pytest.approx(v, abs=0.1)
    assert m(4, 2) == pytest.approx(next(c["median_ms"] for c in m.cells if (c["batch"], c["k"]) == (4, 2)))
    assert 6.0 < m(3, 2) < m(5, 2)
    wall = StepModel.fit(decode_steps(steps, "wall"), min_anchor_steps=9)
    assert wall(4, 2) == pytest.approx(1.3 * m.fit_ms(4, 2), rel=0.03)
    with pytest.raises(ValueError, match="cells with 5\\+ steps"):
        StepModel.fit(decode_steps(steps[:20], "cpu"))


def _sweep(tok_s: dict) -> tuple[dict, list[dict]]:
    """A load sweep's result and rows for contenders with the given tokens/s per C (two rounds x two blocks)."""
    runs, rows = [], []
    rng = random.Random(0)
    for (lab, C), v in tok_s.items():
        policy, gamma = (("static", int(lab.split("=")[1])) if lab.startswith("static") else
                         ("vllm", int(lab.split("=")[1])) if "k=" in lab else ("vllm" if lab.startswith("vllm") else lab, None))
        for r, b in itertools.product(range(2), range(2)):
            runs.append({"round": r, "block": b, "contender": lab, "concurrency": C, "temperature": 0.0,
                         "new_tokens": 100, "wall_s": 100 / v * rng.uniform(0.99, 1.01), "cpu_s": 100 / v})
        rows.append({"contender": lab, "policy": policy, "gamma": gamma, "concurrency": C, "temperature": 0.0,
                     "tokens_per_s": v, "lossless": True})
    return {"runs": runs, "rows": rows}, rows


def test_versus_static_and_the_goals():
    from ldlp.bench.comparisons.peer_rows import versus_static
    from ldlp.bench.peers.vllm_tune import goals

    sched = "vllm eagle schedule 1-2:3,3-32:1"
    tok = {("vllm eagle k=1", 1): 60, ("vllm eagle k=3", 1): 100, ("vllm eagle k=1", 16): 400, ("vllm eagle k=3", 16): 300,
           ("vllm eagle k=1", 32): 500, ("vllm eagle k=3", 32): 350,
           (sched, 1): 99, (sched, 16): 405, (sched, 32): 495}
    result, rows = _sweep(tok)
    vs = versus_static(result, rows, sched, ["vllm eagle k=1", "vllm eagle k=3"])
    assert vs["single"] == "vllm eagle k=1"  # the best geometric mean over C
    by_c = {r["concurrency"]: r for r in vs["rows"]}
    assert by_c[1]["best"]["contender"] == "vllm eagle k=3" and not by_c[1]["single_is_best"]
    assert by_c[1]["ratio_best_cpu"]["ratio"] == pytest.approx(0.99)
    assert by_c[1]["ratio_single_cpu"]["ratio"] == pytest.approx(99 / 60)
    g = goals(vs, "_cpu")
    assert g["floor_met"] and g["gain_met"] and g["never_below_met"] and g["single_wrong_at"] == [1]
    tok[(sched, 32)] = 480  # 0.96 of the best at C=32
    result, rows = _sweep(tok)
    g = goals(versus_static(result, rows, sched, ["vllm eagle k=1", "vllm eagle k=3"]), "_cpu")
    assert not g["floor_met"] and not g["never_below_met"] and g["gain_met"]
    assert versus_static(result, rows, "nobody", ["vllm eagle k=1"]) is None


def test_the_page_is_written_from_the_record(tmp_path):
    from ldlp.bench.peers.vllm_tune import grid_rows, why_rows
    from ldlp.report.vllm_schedule import markdown

    p = [0.8, 0.6, 0.4]
    m = StepModel({"fixed": 6, "per_row": 0.3, "per_draft_forward": 0.8, "per_draft_token": 0.4}, [])
    tokens = {K: expected_tokens(p, K) for K in (1, 2, 3)}
    choice = choose_schedule(8, [1, 2, 3], tokens, m, 0.02)
    calls = [{"k": K, "C": C, "prompts": list(range(C)), "new_tokens": 48 * C, "wall_s": 0.1 * C, "cpu_s": 0.1 * C,
              "num_drafts": 20 * C} for K in (1, 2, 3) for C in (1, 8)]
    rec = {"ks": [1, 2, 3], "concurrency": [1, 8], "rounds": 1, "max_batch": 8, "margin": 0.02, "step_time": "cpu",
           "prompts_per_cell": 8, "max_new_tokens": 48, "acceptance": {"p": p, "drafts": [10, 5, 5], "accepted": [8, 3, 2]},
           "step_model": m.to_dict(), "grid": grid_rows(calls, m, tokens), "choice": choice, "why": why_rows(choice, [1, 2, 3]),
           "schedule": choice["ranges"], "k_max": 3, "lossless": {"sequences": 6, "identical_across_k": True,
                                                                 "identical_to_greedy": 6, "differing": []},
           "workers_start_s": 30, "grid_s": 60, "tuning_s": 100, "meta": {"data": "embedded_validation"},
           "snippet": snippet(choice["ranges"], 3)}
    md = markdown(json.loads(json.dumps(rec)))  # as read back from tuning.json (string keys)
    assert "## Why each range got its K" in md and "num_speculative_tokens_per_batch_size" in md
    assert "identical to the target's greedy decoding: 6/6" in md


@needs_vllm
def test_vllm_runs_the_schedule_it_was_given_and_equals_greedy(tmp_path):
    """vLLM resolves the schedule as given (no fallback to static k), drafts K by the batch size it schedules
    (traced steps), and its outputs equal the target's greedy decoding."""
    import torch

    from eagle_backbone.loading import load_pair
    from eagle_backbone.paths import embedded_model_config
    from ldlp.bench.peers.vllm_peer import VllmRunner

    pair = load_pair(embedded_model_config(dtype="float32"))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, pair.target.vocab_size, (n,), generator=g).tolist() for n in (7, 12, 9)]
    ref = [pair.target.reference_greedy(p, 14) for p in prompts]
    runner = VllmRunner(3, EMBEDDED / "target", EMBEDDED / "drafter", tmp_path / "drafters", python=vllm_python(),
                        max_model_len=64, log_dir=tmp_path, schedule=[[1, 1, 3], [2, 4, 1]], trace_steps=True)
    try:
        info = runner.start(2)
        assert info["dynamic_sd"] == [3, 1]
        rep = runner.generate(prompts, 14, pair.target.eos_token_ids)
        outs, summ = runner.run(prompts[:1], 2, 14, [0], None, pair.target.eos_token_ids)
    finally:
        runner.close()
    assert rep["outputs"] == ref and outs == ref[:1]
    decode = [s for s in rep["steps"] if s[3] == 0]
    assert decode and all(s[6] == (3 if s[2] == 1 else 1) for s in decode)
    assert len(rep["accepted_per_pos"]) == 3 and summ["tau"] >= 1.0
    log = (tmp_path / next(p.name for p in tmp_path.iterdir() if p.name.startswith("vllm_worker_k3_sched"))).read_text()
    assert "Disabling num_speculative_tokens_per_batch_size" not in log
    assert math.isfinite(rep["wall_s"])


class _FakeVllm:
    """A vLLM runner without vLLM: the target's greedy outputs at a fixed tokens/s per C."""

    def __init__(self, target, speed):
        self.target, self.speed = target, speed

    def run(self, prompts, C, max_new_tokens, seeds, sampling=None, stop_ids=()):
        outs = [self.target.reference_greedy(p, max_new_tokens) for p in prompts]
        tok = sum(map(len, outs))
        v = self.speed[C]
        return outs, {"new_tokens": tok, "wall_s": tok / v, "tokens_per_s": v, "cpu_s": tok / v, "tokens_per_cpu_s": v,
                      "tau": 2.0, "token_latency_ms_mean": 1.0, "token_latency_ms_p90": None,
                      "request_latency_ms_mean": 5.0, "request_latency_ms_p90": 6.0}


def test_a_schedule_contender_in_the_sweep_and_on_its_page(t32, eagle32, tmp_path):
    from eagle_backbone.kinds.eagle import EagleCandidateGenerator
    from ldlp.bench.comparisons.load_sweep import Contender, sweep
    from ldlp.bench.comparisons.peer_rows import peer_table, versus_static
    from ldlp.report.load_sweep import write

    g = np.random.default_rng(0)
    prompts = [g.integers(4, 64, n).tolist() for n in (4, 7, 5, 9)]
    sched = "vllm eagle schedule 1-1:2,2-4:1"
    cs = [Contender("ar", "ar", 0, None),
          Contender("vllm eagle k=1", "vllm", 1, None, _FakeVllm(t32, {1: 50.0, 2: 120.0})),
          Contender("vllm eagle k=2", "vllm", 2, None, _FakeVllm(t32, {1: 70.0, 2: 100.0})),
          Contender(sched, "vllm", None, None, _FakeVllm(t32, {1: 70.0, 2: 121.0}))]
    result = sweep(t32, EagleCandidateGenerator(eagle32, t32), prompts, cs, [1, 2], 6, rounds=1, blocks=2,
                   log=lambda _: None)
    rows = {(r["contender"], r["concurrency"]): r for r in result["rows"]}
    assert rows[(sched, 2)]["lossless"] is True and rows[(sched, 2)]["gamma"] is None
    assert all(p["peer_best"]["contender"] != sched for p in peer_table(result, result["rows"]))
    # the rows behind the page's schedule section: against vLLM's static k of its method, per C
    vs = versus_static(result, result["rows"], sched, ["vllm eagle k=1", "vllm eagle k=2"])
    at2 = next(r for r in vs["rows"] if r["concurrency"] == 2)
    assert at2["mine"]["tokens_per_s"] == 121.0
    assert at2["best"]["contender"] == "vllm eagle k=1" and at2["best"]["tokens_per_s"] == 120.0
    assert at2["ratio_best"]["ratio"] == pytest.approx(121.0 / 120.0)
    write(result, tmp_path)  # the page and the plots take the schedule's row too
    assert (tmp_path / "batch_bench.md").is_file() and (tmp_path / "batch_bench.png").is_file()


def test_calibration_meets_the_grid_and_keeps_the_models_shape_between():
    from ldlp.bench.peers.vllm_schedule import calibrated

    model = StepModel({"fixed": 6.0, "per_row": 0.3, "per_draft_forward": 0.8, "per_draft_token": 0.4}, [])
    tokens = {1: 1.8, 4: 3.6}
    measured = {(1, 1): 150.0, (1, 16): 1500.0, (4, 1): 250.0, (4, 16): 1200.0}
    ms, scale = calibrated(model, tokens, measured)
    for (K, C), v in measured.items():
        assert 1e3 * C * tokens[K] / ms(C, K) == pytest.approx(v)
    r4 = 1e3 * 4 * tokens[4] / ms(4, 4) / (1e3 * 4 * tokens[4] / model(4, 4))
    assert r4 == pytest.approx(scale[(4, 1)] + (scale[(4, 16)] - scale[(4, 1)]) * 0.5)  # log 4 is halfway to log 16
    assert ms(32, 1) == pytest.approx(model(32, 1) / scale[(1, 16)])  # held at the ends
    got = choose_schedule(16, [1, 4], tokens, ms)
    assert got["ranges"][0][2] == 4 and got["ranges"][-1][2] == 1  # the grid's own ranking at its ends
