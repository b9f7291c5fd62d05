"""The load sweep of the batched benchmark (issue 16, evaluation): the paired bootstrap, the C x T sweep with
its baselines, and the oracle in a batch (CPU, tiny float32 models, seconds each)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_prompts
from ldlp.bench.comparisons.load_aggregate import (
    BASELINES,
    ROW_KEYS,
    greedy_identity,
    ratio_rows,
    rows_at,
    step_rows,
    temperatures_of,
)
from ldlp.bench.comparisons.load_sweep import Contender, split_blocks, sweep
from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.decoder import SpeculativeDecoder
from eagle_backbone.policy import StaticPolicy
from ldlp.bench.harness.stats import paired_ratio
from ldlp.policies.threshold import HeuristicPolicy
from ldlp.policies.oracles import OraclePolicy
from ldlp.report.load_sweep import plot_ratios, plot_tokens_per_s, write

torch.set_num_threads(1)


def contenders():
    return [Contender("ar", "ar", 0, None),
            Contender("static γ=1", "static", 1, lambda: StaticPolicy(1)),
            Contender("static γ=3", "static", 3, lambda: StaticPolicy(3)),
            Contender("heuristic", "heuristic", None, lambda: HeuristicPolicy(2)),
            Contender("oracle", "oracle", None, lambda: OraclePolicy(4))]


# ---- the paired bootstrap ------------------------------------------------------------------------------------


def test_paired_ratio_known_answers():
    # a contender exactly 1.25x faster on every pair: the ratio and both interval ends are 1.25
    secs = np.array([2.0, 3.0, 5.0, 1.5, 4.0])
    tok = np.array([100, 140, 260, 80, 190])
    out = paired_ratio(tok, secs / 1.25, tok, secs, bootstrap=500, seed=1)
    assert out["ratio"] == pytest.approx(1.25) and out["ci95"] == pytest.approx([1.25, 1.25])
    assert out["pairs"] == 5 and out["resolves_5pct"] is True
    # throughput, not seconds: different token counts (sampled outputs) enter as tokens per second over all pairs
    out = paired_ratio([30, 30], [1.0, 1.0], [20, 20], [1.0, 1.0])
    assert out["ratio"] == pytest.approx(1.5) and out["ci95"] == pytest.approx([1.5, 1.5])
    # one pair: a ratio, no interval
    one = paired_ratio([10], [1.0], [10], [2.0])
    assert one["ratio"] == pytest.approx(2.0) and one["ci95"] is None and one["resolves_5pct"] is False
    # two pairs with seconds ratios 1 and 2 (equal tokens and baseline seconds): the resamples are {1,1}, {1,2},
    # {2,2} with probabilities 1/4, 1/2, 1/4, giving ratios 1, 4/3 (2 s / 1.5 s), 2; the 95% interval spans 1 to 2
    two = paired_ratio([10, 10], [2.0, 1.0], [10, 10], [2.0, 2.0], bootstrap=4000, seed=0)
    assert two["ratio"] == pytest.approx(4 / 3) and two["ci95"] == pytest.approx([1.0, 2.0])


def test_paired_ratio_interval_covers_and_narrows_with_pairs():
    rng = np.random.default_rng(7)
    widths = []
    for n in (8, 128):
        base = rng.uniform(1.0, 3.0, n)  # workloads of different length: pairing removes that spread
        cont = base / 1.10 * np.exp(rng.normal(0, 0.03, n))
        out = paired_ratio(np.full(n, 100), cont, np.full(n, 100), base, bootstrap=2000, seed=3)
        lo, hi = out["ci95"]
        assert lo < 1.10 < hi
        widths.append(hi - lo)
        assert out["resolves_5pct"] is True
    assert widths[1] < widths[0] / 2  # about 1/sqrt(16)
    # seeded: the same interval twice
    a = paired_ratio([1, 2, 3], [1.0, 1.1, 0.9], [1, 2, 3], [1.2, 1.0, 1.1], seed=5)
    assert a == paired_ratio([1, 2, 3], [1.0, 1.1, 0.9], [1, 2, 3], [1.2, 1.0, 1.1], seed=5)


def test_paired_ratio_resamples_the_last_axis_and_pools_runs():
    """Seconds of shape (rounds, prompts) resample prompts, each with all its rounds; without tokens the ratio is
    one of seconds; runs=True pools the runs a contender ran in."""
    rng = np.random.default_rng(0)
    a, b = rng.random((3, 8)) + 0.5, rng.random((3, 8)) + 0.5
    out = paired_ratio(None, a, None, b, bootstrap=400, seed=2)
    assert out["ratio"] == pytest.approx(b.sum() / a.sum()) and out["pairs"] == 8
    assert out["ci95"][0] <= out["ratio"] <= out["ci95"][1]
    tokens = np.full(8, 10.0)  # the same tokens: the one-axis form gives the same ratio over prompts' seconds
    flat = paired_ratio(tokens, a.sum(0), tokens, b.sum(0), bootstrap=400, seed=2)
    assert flat["ratio"] == pytest.approx(out["ratio"]) and flat["ci95"] == pytest.approx(out["ci95"])
    runs = paired_ratio(None, [a, None, a], None, [b, b, b], bootstrap=400, seed=2, runs=True)
    assert runs["ratio"] == pytest.approx(b.sum() / a.sum()) and runs["pairs"] == 16
    with pytest.raises(ValueError, match="both token counts or neither"):
        paired_ratio(None, a, tokens, b)


def test_one_greedy_reference_compares_every_output():
    from ldlp.bench.harness.identity import GreedyReference

    ref = GreedyReference([[1, 2, 3], [4, 5]])
    assert ref.same([[1, 2, 3], (4, 6)]) == [True, False]
    assert ref.same([[4, 5]], [1]) == [True]
    assert ref.lossless([[[1, 2, 3], [4, 5]], [(1, 2, 3), (4, 5)]]) and not ref.lossless([[[1, 2], [4, 5]]])
    keyed = GreedyReference({"a": [1], "b": [2]})
    assert keyed.differing({"a": [1], "b": [3]}, {"a": [9], "b": [2]}) == ["a", "b"]
    assert keyed.differing({"a": [1]}, {"a": [1], "b": [2]}) == ["b"]  # a missing output is a difference


def test_paired_ratio_bad_input():
    with pytest.raises(ValueError, match="one length"):
        paired_ratio([1, 2], [1.0], [1, 2], [1.0, 1.0])
    with pytest.raises(ValueError, match="no pairs"):
        paired_ratio([], [], [], [])
    with pytest.raises(ValueError, match="> 0"):
        paired_ratio([1], [0.0], [1], [1.0])


def test_split_blocks_never_leaves_c_streams_unfilled():
    assert split_blocks(32, 1, 4) == [list(range(b, 32, 4)) for b in range(4)]
    assert len(split_blocks(32, 16, 4)) == 2 and len(split_blocks(32, 32, 4)) == 1 and len(split_blocks(5, 8, 4)) == 1
    assert sorted(i for part in split_blocks(30, 4, 4) for i in part) == list(range(30))


# ---- the C x T sweep -----------------------------------------------------------------------------------------


def test_sweep_over_concurrency_and_temperature(t32, eagle32, tmp_path):
    """Rows for every (C, T, contender), the oracle at T=0 only, ratios to every baseline with intervals over
    the (round, block) pairs; lossless at T=0; the same command twice gives the same counters at T > 0."""
    prompts = random_prompts(8)
    cand = EagleCandidateGenerator(eagle32, t32)
    logs = []
    kw = {"rounds": 2, "temperatures": [0.0, 1.0], "blocks": 2, "seed": 3}
    result = sweep(t32, cand, prompts, contenders(), [1, 2, 4], 10, log=logs.append, **kw)
    rows = result["rows"]
    cells = {(r["contender"], r["concurrency"], r["temperature"]) for r in rows}
    expected = {(c.label, C, T) for c in contenders() for C in (1, 2, 4) for T in (0.0, 1.0)}
    assert cells == expected - {("oracle", C, 1.0) for C in (1, 2, 4)}
    assert any("skipping oracle at T=1" in line for line in logs)
    assert result["skipped"] == [{"contender": "oracle", "temperature": 1.0, "why": "defined for greedy decoding only"}]
    for r in rows:
        assert r["rounds"] == 2 and r["blocks"] == 2 and r["n_prompts"] == 8
        assert r["lossless"] is (True if r["temperature"] == 0 else None)
        if r["policy"] not in ("ar", "static"):
            want = {"ar", "best_static", "batch1_static"} | ({"oracle"} if r["temperature"] == 0 and r["policy"] != "oracle"
                                                             else set())
            assert set(r["vs"]) == want
            for v in r["vs"].values():
                assert v["pairs"] == 4 and v["ci95"][0] <= v["ratio"] <= v["ci95"][1]
    # the baselines: batch-1 best static γ is the static γ fastest at C=1, at every C
    for T in (0.0, 1.0):
        st1 = [r for r in rows if r["temperature"] == T and r["concurrency"] == 1 and r["policy"] == "static"]
        g1 = max(st1, key=lambda r: r["tokens_per_s"])["gamma"]
        for r in rows:
            if r["temperature"] == T and r.get("vs"):
                assert r["vs"]["batch1_static"]["gamma"] == g1
                best = max((x for x in rows if x["temperature"] == T and x["concurrency"] == r["concurrency"]
                            and x["policy"] == "static"), key=lambda x: x["tokens_per_s"])
                assert r["vs"]["best_static"]["contender"] == best["contender"]
    # sampled runs are seeded per sequence: the same command twice gives the same counters
    again = sweep(t32, cand, prompts, contenders(), [1, 2, 4], 10, log=lambda _: None, **kw)
    counters = lambda res: sorted((r["contender"], r["concurrency"], r["temperature"], r["new_tokens"], r["tau"])
                                  for r in res["rows"])
    assert counters(again) == counters(result)
    # the page's rows: a section per temperature, the paired-ratio table at T=1 without the oracle; the plots draw
    assert temperatures_of(rows) == [0.0, 1.0]
    assert [(r["contender"], r["concurrency"]) for r in ratio_rows(rows_at(rows, 1.0))] == [("heuristic", C) for C in (1, 2, 4)]
    out = write(result, tmp_path)
    assert (out / "batch_bench.png").is_file() and (out / "batch_bench_ratio.png").is_file()
    saved = json.loads((out / "batch_bench.json").read_text())
    assert {tuple(sorted(r["vs"])) for r in saved if r["vs"]} >= {tuple(sorted(BASELINES))}
    # one engine: one row per (contender, C, T), no engine column, no batch-1 loop comparison
    assert len(saved) == len(cells) and "engine" not in ROW_KEYS and not any("engine" in r for r in saved)
    runs = json.loads((out / "batch_bench_runs.json").read_text())
    assert set(runs["findings"]) == {"0.0", "1.0"} and runs["findings"]["0.0"]["baselines"]
    assert not any("batch1_parity" in f for f in runs["findings"].values())
    assert not any("engine" in x for x in runs["runs"])


def test_one_temperature_stays_as_before(t32, eagle32, tmp_path):
    """No temperatures given: the generation's temperature alone, one block; the single-temperature plot still
    draws; no adaptive contender: no ratio plot."""
    prompts = random_prompts(4)
    cs = contenders()[:3]
    cand = EagleCandidateGenerator(eagle32, t32)
    result = sweep(t32, cand, prompts, cs, [1, 2], 6, rounds=1, log=lambda _: None)
    assert temperatures_of(result["rows"]) == [0.0] and {r["blocks"] for r in result["rows"]} == {1}
    assert plot_tokens_per_s(result, tmp_path / "p.png").is_file()
    assert plot_ratios(result, tmp_path / "r.png") is None
    with pytest.raises(ValueError, match="blocks"):
        sweep(t32, cand, prompts, cs, [1], 6, blocks=0)
    with pytest.raises(ValueError, match="temperatures"):
        sweep(t32, cand, prompts, cs, [1], 6, temperatures=[0.0, -1.0])


def test_step_metrics_from_the_timed_runs_and_a_profiled_pass_after_them(t32, eagle32, tmp_path):
    """Scored tokens per step come from the timed runs' counters (AR scores one token a row-step, static γ at most
    γ + 1); with profile_steps one untimed profiled pass per (contender, C, T) on the first block, after every timed
    run, gives verify and draft ms per step; the page's step table has every row and the JSON their keys."""
    prompts = random_prompts(6, seed=3)
    cs = contenders()[:3] + [contenders()[-1]]
    logs = []
    result = sweep(t32, EagleCandidateGenerator(eagle32, t32), prompts, cs, [1, 3], 8, rounds=1, blocks=2,
                   log=logs.append, bootstrap=10, profile_steps=True)
    rows = {(r["contender"], r["concurrency"]): r for r in result["rows"]}
    for (label, C), r in rows.items():
        runs = [x for x in result["runs"] if x["contender"] == label and x["concurrency"] == C]
        scored, steps, row_steps = (sum(x[k] for x in runs) for k in ("scored_tokens", "engine_steps", "row_steps"))
        assert r["scored_per_step"] == pytest.approx(scored / steps)
        assert r["scored_per_row_step"] == pytest.approx(scored / row_steps)
        assert r["scored_per_step"] == pytest.approx(r["scored_per_row_step"] * r["rows_per_step"])
        assert 1 <= r["rows_per_step"] <= C
        gamma = {"ar": 0, "static γ=1": 1, "static γ=3": 3}.get(label)
        if gamma is not None:
            assert 1 <= r["scored_per_row_step"] <= gamma + 1 and (gamma or r["scored_per_row_step"] == 1.0)
        # the engine's target forwards are the row-steps plus one prefill a prompt
        assert row_steps == sum(round(x["new_tokens"] / x["tau"]) for x in runs) - len(prompts)
        assert r["profile"]["steps"] > 0 and r["profile"]["n_prompts"] == len(split_blocks(6, C, 2)[0])
        assert r["verify_ms_per_step"] > 0 and r["draft_ms_per_step"] >= 0
        assert set(r["profile"]["ms_per_step"]) >= {"verify", "draft", "policy", "host"}
    assert rows[("static γ=3", 1)]["draft_ms_per_step"] > rows[("ar", 1)]["draft_ms_per_step"]
    # the profiled pass runs after every timed run, never between them
    first_profiled = next(i for i, line in enumerate(logs) if line.startswith("profiled"))
    assert not any(line.startswith("round") for line in logs[first_profiled:])
    assert len(result["profiles"]) == len(cs) * 2 and len(result["runs"]) == len(cs) * (2 + 2)
    order = [c.label for c in cs]
    assert [(r["contender"], r["concurrency"]) for r in step_rows(result["rows"])] == \
        sorted(rows, key=lambda k: (order.index(k[0]), k[1]))
    out = write(result, tmp_path)
    saved = json.loads((out / "batch_bench.json").read_text())
    assert all(r["verify_ms_per_step"] is not None and r["scored_per_step"] for r in saved)
    assert len(json.loads((out / "batch_bench_runs.json").read_text())["profiles"]) == len(cs) * 2
    # without the pass: the counters still, no milliseconds
    plain = sweep(t32, EagleCandidateGenerator(eagle32, t32), prompts, cs[:2], [2], 6, rounds=1, log=lambda _: None,
                  bootstrap=10)
    assert plain["profiles"] == [] and all(r["verify_ms_per_step"] is None and r["scored_per_step"] for r in plain["rows"])
    assert len(step_rows(plain["rows"])) == 2 and not any(r["profile"] for r in step_rows(plain["rows"]))


# ---- the oracle in a batch -----------------------------------------------------------------------------------


def test_oracle_in_a_batch_is_lossless_and_matches_its_batch1_counts(t32, eagle32):
    """Bound to the sweep's candidate generator, the oracle runs in the batched sweep at T=0: every sequence equals
    the target's own greedy output, and at every C it needs exactly the target forwards of the oracle with one
    slot (SpeculativeDecoder)."""
    prompts = random_prompts(6, seed=4)
    cand = EagleCandidateGenerator(eagle32, t32)
    cs = [contenders()[0], contenders()[-1]]
    result = sweep(t32, cand, prompts, cs, [1, 3, 6], 12, rounds=1, log=lambda _: None)
    want_tokens = sum(len(t32.reference_greedy(p, 12)) for p in prompts)
    batch1 = []
    for p in prompts:
        batch1.append(SpeculativeDecoder(t32, cand, OraclePolicy(4)).generate(p, 12).stats)
    tau1 = sum(s.new_tokens for s in batch1) / sum(s.target_forwards for s in batch1)
    oracle = [r for r in result["rows"] if r["policy"] == "oracle"]
    assert [r["concurrency"] for r in oracle] == [1, 3, 6]
    for r in oracle:
        assert r["lossless"] is True and r["identical"] == len(prompts) and r["new_tokens"] == want_tokens
        assert r["tau"] == pytest.approx(tau1)
    # without a candidate generator it is skipped with one line, not an error
    logs = []
    res = sweep(t32, None, prompts[:2], cs, [1], 4, rounds=1, log=logs.append)
    assert {r["policy"] for r in res["rows"]} == {"ar"} and any("skipping oracle" in line for line in logs)


def test_greedy_reference_is_the_targets_own_decoding(t32, eagle32, monkeypatch):
    """Greedy losslessness is judged against ``target.reference_greedy`` (transformers' forward, not the engine),
    once per prompt: a reference that differs for one prompt marks every row lossy at exactly that prompt."""
    from eagle_backbone.target import TargetModel

    prompts = random_prompts(3, seed=6)
    real, calls = TargetModel.reference_greedy, []

    def reference(self, prompt_ids, max_new_tokens):
        calls.append(list(prompt_ids))
        out = real(self, prompt_ids, max_new_tokens)
        if list(prompt_ids) == prompts[1]:  # one token off at position 2
            out[2] = (out[2] + 1) % self.vocab_size
        return out

    monkeypatch.setattr(TargetModel, "reference_greedy", reference)
    cs = contenders()[:2]
    result = sweep(t32, EagleCandidateGenerator(eagle32, t32), prompts, cs, [1, 3], 8, rounds=1, log=lambda _: None)
    assert calls == prompts
    assert sorted((r["contender"], r["concurrency"], r["lossless"], r["identical"]) for r in result["rows"]) == \
        sorted((c.label, C, False, 2) for C in (1, 3) for c in cs)
    assert sorted((d["contender"], d["concurrency"], d["prompt"], d["position"]) for d in result["differences"]) == \
        sorted((c.label, C, 1, 2) for C in (1, 3) for c in cs)
    identity = greedy_identity(result["rows"], result["differences"])
    assert (identity["identical"], identity["sequences"], identity["lossy_rows"], identity["differing"]) == (8, 12, 4, 4)


def test_sweep_runs_a_custom_candidate_generator(t32, eagle32):
    """The sweep drafts with the generator it is given (bound once per engine), whatever its kind."""
    class Counted(EagleCandidateGenerator):
        kind = "counted_eagle"
        kinds, starts = [], 0

        def bind(self, view):
            Counted.kinds.append(self.kind)
            super().bind(view)

        def start(self, slots, tlens):
            Counted.starts += 1
            return super().start(slots, tlens)

    prompts = random_prompts(4, seed=7)
    cs = contenders()[:3]
    result = sweep(t32, Counted(eagle32, t32), prompts, cs, [1, 2], 8, rounds=1, log=lambda _: None)
    # one engine per contender for the warm-up and per (C, block) in the round, each drafting with this generator
    assert Counted.kinds == ["counted_eagle"] * (len(cs) * (1 + 2)) and Counted.starts > 0
    assert all(r["lossless"] for r in result["rows"])
    assert {r["tau"] for r in result["rows"] if r["policy"] == "ar"} == {1.0}


# ---- the script ----------------------------------------------------------------------------------------------


def test_bench_batch_script_sweeps_c_by_t(tmp_path):
    """scripts/bench_batch.py on a tiny float32 pair: temperatures and blocks from the command line, a row per
    (C, T, contender) with its baselines, the oracle at T=0 only; bad settings fail in one line before loading.
    The one test that renders the load sweep's page (what its sections state is checked on the rows behind them,
    ldlp.bench.comparisons.load_aggregate's), and renders it again from the JSON (render_only=true)."""
    import subprocess
    import sys

    from conftest import pair_overrides, save_tiny_pair

    save_tiny_pair(tmp_path / "models", 4096)
    prompts = tmp_path / "question.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "test", "turns": [q]}) + "\n" for i, q in
                               enumerate(["Explain `os.path.join`.", "What does `json.dumps` return?",
                                          "Reverse a list.", "Sort a dict by value."])))
    out = tmp_path / "out"
    cmd = [sys.executable, "scripts/bench_batch.py", *pair_overrides(tmp_path / "models", dtype="float32"),
           "data=mt_bench", f"data.path={prompts}", "data.limit=4", "generation.max_new_tokens=8", "rounds=1",
           "blocks=2", "concurrency=[1,2]", "temperatures=[0.0,1.0]", "threads=1", f"out_dir={out}",
           f"hydra.run.dir={tmp_path / 'run'}",
           # a contender as a node and as strings (ldlp/bench/harness/contender.py reads both)
           'contenders=[{policy:{name:static,gamma:2}},"policy=heuristic","policy=oracle",'
           f'"policy=ldlp policy.path={tmp_path / "no_ldlp"}"]']
    repo = Path(__file__).resolve().parent.parent
    res = subprocess.run(cmd, check=False, cwd=repo, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = json.loads((out / "batch_bench.json").read_text())
    cells = {(r["contender"], r["concurrency"], r["temperature"]) for r in rows}
    assert cells == {(c, C, T) for c in ("ar", "static γ=2", "heuristic", "oracle") for C in (1, 2)
                     for T in (0.0, 1.0)} - {("oracle", 1, 1.0), ("oracle", 2, 1.0)}
    assert all(r["lossless"] for r in rows if r["temperature"] == 0)
    heur = [r for r in rows if r["contender"] == "heuristic"]
    assert all({"ar", "best_static", "batch1_static"} <= set(r["vs"]) for r in heur)
    assert all("oracle" in r["vs"] for r in heur if r["temperature"] == 0)
    assert (out / "batch_bench_ratio.png").is_file()
    # profile_steps (on by default): verify and draft ms per step from the untimed profiled pass
    assert all(r["verify_ms_per_step"] is not None and r["scored_per_row_step"] >= 1 for r in rows)
    # a checkpoint this clone has not trained: skipped, and said so in the JSON and on the page
    runs = json.loads((out / "batch_bench_runs.json").read_text())
    assert {s["contender"] for s in runs["skipped"]} >= {f"policy=ldlp policy.path={tmp_path / 'no_ldlp'}"}
    assert runs["complete"] is True
    # the rows behind the page's sections: one per temperature, greedy identity at T=0 (the paired ratios, per
    # engine step, status, skipped contenders and step costs: above and below)
    assert temperatures_of(rows) == [0.0, 1.0]
    identity = greedy_identity(rows_at(rows, 0.0), runs.get("differences", []))
    assert identity["identical"] == identity["sequences"] > 0 and identity["lossy_rows"] == 0
    page = (out / "batch_bench.md").read_text()  # the page's render check
    assert page.startswith("# Batched speculative decoding: tokens/s against concurrency\n")
    assert res.stdout.strip().splitlines()[-1].endswith("batch_bench.png, batch_bench_ratio.png, step_costs.json, "
                                                         "step_costs.png, step_costs_by_gamma.png, memory.png")
    # the online step-cost model's accuracy per (contender, C, T), and the costs measured in hindsight
    acc = {(r["contender"], r["concurrency"], r["temperature"]) for r in runs["step_costs"]}
    assert ("static γ=2", 2, 0.0) in acc and ("ar", 1, 1.0) in acc
    from eagle_backbone.step_cost import OnlineCostModel
    assert OnlineCostModel.load(out / "step_costs.json").seen > 0
    # the page again from the folder's JSON (what render_only=true runs): the same page, the JSON untouched
    from ldlp.report.load_sweep import render

    (out / "batch_bench.md").unlink()
    json_before = {f: (out / f).read_bytes() for f in ("batch_bench.json", "batch_bench_runs.json", "step_costs.json")}
    render(out)
    assert (out / "batch_bench.md").read_text() == page
    assert {f: (out / f).read_bytes() for f in json_before} == json_before
    bad = subprocess.run(cmd[:-1] + ["blocks=0"], check=False, cwd=repo, capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "blocks must be an integer >= 1" in bad.stderr + bad.stdout


# ---- the main command's short version ------------------------------------------------------------------------


def test_pipeline_plans_the_short_load_sweep_and_publishes_its_page(tmp_path):
    from hydra import compose, initialize_config_dir

    from eagle_backbone.paths import CONF_DIR
    from ldlp.bench.harness.contender import parse_contender
    from ldlp.pipeline import force_level, plan
    from ldlp.report.publish import publish

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="pipeline", overrides=[f"paths.outputs={tmp_path / 'outputs'}",
                                                         f"paths.data_dir={tmp_path / 'data'}"])
    stage = next(s for s in plan(cfg) if s.name == "bench_batch")
    assert stage.out == Path(cfg.paths.results) / "load_sweep" and stage.script == "bench_batch.py"
    assert "concurrency=[1,4,16]" in stage.args and "temperatures=[0.0,1.0]" in stage.args  # conf/pipeline.yaml
    contenders = next(a for a in stage.args if a.startswith("contenders="))
    for node in cfg.bench_batch.contenders:  # a policy without its conf/policy/<name>.yaml is left out
        spec = parse_contender(node)  # the YAML's node, passed on in its string form
        assert (f'"{spec}"' in contenders) == (CONF_DIR / "policy" / f"{spec.policy.name}.yaml").is_file()
    assert "acceptance" in stage.after and "oracle" not in stage.after and stage.group in force_level(True)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        off = compose(config_name="pipeline", overrides=[f"paths.outputs={tmp_path}", "bench_batch.enabled=false"])
    assert "bench_batch" not in {s.name for s in plan(off)}
    # publish copies the load sweep's page and plots, and the results page shows them
    results, published = tmp_path / "res", tmp_path / "pub"
    (results / "load_sweep").mkdir(parents=True)
    (results / "results.md").write_text("## Static vs adaptive\n")
    for f in ("batch_bench.md", "batch_bench.json", "batch_bench.png", "batch_bench_ratio.png"):
        (results / "load_sweep" / f).write_text(f)
    publish(results, published, tmp_path / "README.md", {"headline": {}, "stage_seconds": {"bench_batch": 250.0}},
            "m", "python scripts/pipeline.py publish=true")
    # the page's links to them are checked with the rest of the page (tests/test_pipeline.py, publish)
    assert all((published / "load_sweep" / f).is_file()
               for f in ("batch_bench.md", "batch_bench.json", "batch_bench.png", "batch_bench_ratio.png"))


def test_a_batch_level_policy_runs_in_the_sweep(t32, eagle32):
    """A policy deciding for the whole batch (one instance per engine, as the load-aware policy) is passed as a
    factory like any other, runs at every (C, T), stays lossless at T=0 and gets its paired ratios."""
    from eagle_backbone.policy import DraftPolicy

    class HalfCap(DraftPolicy):
        name = "half_cap"
        engines = 0

        def bind(self, engine):
            HalfCap.engines += 1

        def plan(self, rows):
            return [min(2, c) if len(rows) > 1 else min(4, c) for c in rows.caps]

    cs = contenders()[:3] + [Contender("half_cap", "half_cap", None, HalfCap)]
    result = sweep(t32, EagleCandidateGenerator(eagle32, t32), random_prompts(6, seed=2), cs, [1, 3], 10, rounds=1,
                   temperatures=[0.0, 0.7], blocks=2, log=lambda _: None)
    rows = [r for r in result["rows"] if r["contender"] == "half_cap"]
    assert {(r["concurrency"], r["temperature"]) for r in rows} == {(1, 0.0), (3, 0.0), (1, 0.7), (3, 0.7)}
    assert all(r["lossless"] for r in rows if r["temperature"] == 0)
    assert all({"ar", "best_static", "batch1_static"} <= set(r["vs"]) for r in rows)
    assert HalfCap.engines >= 4  # a fresh instance per engine (per workload), never one shared across runs


def test_blocks_combine_back_to_the_whole_prompt_set(t32, eagle32):
    """Split into blocks, a round's counters (tokens, τ, per-category counts, greedy identity) equal the
    whole set's: blocks change how the timing is paired, not what is decoded."""
    prompts = random_prompts(8, seed=5)
    cats = ["a", "b"] * 4
    cs = contenders()[:3]
    cand = EagleCandidateGenerator(eagle32, t32)
    kw = {"rounds": 1, "categories": cats, "log": lambda _: None}
    one = sweep(t32, cand, prompts, cs, [1, 2], 9, blocks=1, **kw)["rows"]
    four = sweep(t32, cand, prompts, cs, [1, 2], 9, blocks=4, **kw)["rows"]
    key = lambda r: (r["contender"], r["concurrency"])
    assert [r["blocks"] for r in four] == [4, 4, 4, 4, 4, 4] and {r["blocks"] for r in one} == {1}
    for a, b in zip(sorted(one, key=key), sorted(four, key=key)):
        assert (a["new_tokens"], a["identical"], a["lossless"]) == (b["new_tokens"], b["identical"], b["lossless"])
        assert a["tau"] == pytest.approx(b["tau"])
        assert {c: (v["n_prompts"], v["new_tokens"], v["target_forwards"]) for c, v in a["by_category"].items()} == \
            {c: (v["n_prompts"], v["new_tokens"], v["target_forwards"]) for c, v in b["by_category"].items()}


def test_policy_interpolations_follow_the_running_config(tmp_path):
    """A policy node composed with the default model (as policy_config composes it) reads the running script's
    model and paths once bound with resolve_in."""
    from omegaconf import OmegaConf

    from ldlp.bench.harness.loaders import resolve_in

    composed = OmegaConf.create({"model": {"name": "embedded"}, "policy": {"_target_": "x", "model": "${model.name}",
                                                                           "dir": "${out}/${model.name}"}, "out": "/a"})
    running = OmegaConf.create({"model": {"name": "tiny"}, "out": str(tmp_path), "policy": {"gamma": 3}})
    node = resolve_in(running, composed.policy)
    assert node.model == "tiny" and node.dir == f"{tmp_path}/tiny" and "gamma" not in node


# ---- issue 25: sweep settings, skipped contenders, unfinished results, cost tables -----------------------------


def test_sweep_settings_are_checked_raw_before_anything_runs():
    from ldlp.bench.comparisons.load_sweep import check_contenders, check_sweep_args, draft_cap
    from eagle_backbone.errors import ConfigError

    bad = {"truncated": dict(concurrency=[1, 1.5]), "merged": dict(concurrency=[2, 2]),
           "no rounds": dict(concurrency=[1], rounds=0), "no tokens": dict(concurrency=[1], max_new_tokens=0),
           "a temperature twice": dict(concurrency=[1], temperatures=[0.7, 0.7]),
           "a string": dict(concurrency=["2"])}
    for case, kw in bad.items():
        with pytest.raises(ConfigError) as e:
            check_sweep_args(**kw)
        assert "\n" not in str(e.value), case
    with pytest.raises(ConfigError, match="repeats"):
        check_sweep_args([4, 1, 4])
    with pytest.raises(ConfigError, match="generation.max_new_tokens"):
        check_sweep_args([1], max_new_tokens=0)
    assert check_sweep_args([1, 2], [0, 1.0], 2, 1, 8, 10) == [0.0, 1.0]
    # a γ above the engine's draft cap would be a "best static γ" the engine never drafted
    assert draft_cap(8) == 7 and draft_cap(1000) == 32
    with pytest.raises(ConfigError, match=r"static γ=9 above the engine's draft cap γ=7"):
        check_contenders([Contender("ar", "ar", 0, None), Contender("static γ=9", "static", 9, lambda: StaticPolicy(9))], 8)
    twice = [Contender("ar", "ar", 0, None)] + [Contender("static γ=2", "static", 2, lambda: StaticPolicy(2))] * 2
    with pytest.raises(ConfigError, match="given twice"):
        check_contenders(twice, 8)


def test_a_stopped_sweep_says_so_and_a_reused_folder_keeps_no_older_file(t32, eagle32, tmp_path):
    from ldlp.report.load_sweep import written

    out = tmp_path / "out"
    out.mkdir()
    (out / "batch_bench.png").write_bytes(b"an older run's plot")
    (out / "batch_bench_ratio.png").write_bytes(b"an older run's plot")
    first = []

    def checkpoint(r):  # what a run killed after its first (T, C) leaves
        if not first:
            first.append(r)
            write(r, out, {"model": "tiny"}, with_plot=False)

    cs = [Contender("ar", "ar", 0, None), Contender("static γ=2", "static", 2, lambda: StaticPolicy(2))]
    result = sweep(t32, EagleCandidateGenerator(eagle32, t32), random_prompts(4), cs, [1, 2], 6, rounds=1,
                   checkpoint=checkpoint, log=lambda *_: None, bootstrap=10)
    # the checkpoint: incomplete everywhere, and no plot of another run next to it
    assert written(out) == ["batch_bench.json", "batch_bench_runs.json", "batch_bench.md"]
    rows = json.loads((out / "batch_bench.json").read_text())
    runs = json.loads((out / "batch_bench_runs.json").read_text())
    assert rows and all(r["complete"] is False for r in rows)
    assert runs["complete"] is False and runs["rounds_done"] == 0.5 and runs["rounds"] == 1
    # the finished run
    assert result["complete"] is True and result["rounds_done"] == 1
    write(result, out, {"model": "tiny"})
    assert {"batch_bench.png", "batch_bench.md"} <= set(written(out))
    assert json.loads((out / "batch_bench_runs.json").read_text())["complete"] is True
    assert (out / "batch_bench.png").read_bytes() != b"an older run's plot"


def test_only_a_missing_checkpoint_is_skipped_and_turns_left_out_are_refused(tmp_path):
    from omegaconf import OmegaConf

    from eagle_backbone.errors import ConfigError, MissingCheckpoint
    from ldlp.bench.harness.loaders import PromptSet, check_turns_kept, missing_checkpoint

    with pytest.raises(MissingCheckpoint, match=f"policy.path={tmp_path / 'none'}"):
        missing_checkpoint("ldlp", OmegaConf.create({"path": str(tmp_path / "none")}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingCheckpoint):
        missing_checkpoint("load_aware_head", OmegaConf.create({"estimator": str(tmp_path / "empty")}))
    missing_checkpoint("static", OmegaConf.create({"gamma": -1}))  # not a checkpoint problem: build_policy's to refuse
    missing_checkpoint("load_aware", OmegaConf.create({"estimator": "confidence"}))
    # MT-bench second turns need the model's own first answer: turns=all would silently drop them
    q = tmp_path / "question.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "turns": ["First?", "Second?"]}) + "\n" for i in range(3)))
    firsts = PromptSet((str(i), [1, 2, 3]) for i in range(3))
    firsts.info = {"n_dropped": 0}
    data = OmegaConf.create({"path": str(q), "format": "mt_bench", "turns": "all"})
    with pytest.raises(ConfigError, match=r"data.turns=all: 3 of 6 user turns"):
        check_turns_kept(data, firsts, "bench_batch")
    check_turns_kept(OmegaConf.create({"path": str(q), "turns": "first"}), firsts, "bench_batch")


def test_bench_batch_fails_on_a_bad_contender_in_one_line_before_loading(tmp_path):
    """Only a missing checkpoint skips a contender (test_bench_batch_script_sweeps_c_by_t): policy.gamma=-1 is one
    error line and exit 1, before any model loads (the target folder does not exist)."""
    import subprocess
    import sys

    from conftest import pair_overrides

    prompts = tmp_path / "question.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [q]}) + "\n"
                               for i, q in enumerate(["Reverse a list.", "Sort a dict by value."])))
    models = [o for o in pair_overrides(tmp_path / "gone", dtype="float32")]
    cmd = [sys.executable, "scripts/bench_batch.py", "data=mt_bench", f"data.path={prompts}", "data.limit=2",
           "generation.max_new_tokens=4", "rounds=1", "concurrency=[1]", "threads=1", f"out_dir={tmp_path / 'out'}",
           f"hydra.run.dir={tmp_path / 'run'}", *models, 'contenders=["policy=static policy.gamma=-1"]']
    repo = Path(__file__).resolve().parent.parent
    bad = subprocess.run(cmd, check=False, cwd=repo, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1
    err = [line for line in bad.stderr.splitlines() if line.strip()]
    assert err[-1].startswith("error: static policy: gamma must be an integer >= 0") and "Traceback" not in bad.stderr
    assert not (tmp_path / "out").exists()


def test_cost_tables_are_keyed_by_the_setup_and_profiled_for_the_slots_a_run_needs(t32, eagle32, tmp_path):
    from conftest import make_drafter

    from eagle_backbone.cost import (
        CostTable,
        cost_key,
        load_or_profile,
        processor_name,
        setup_key,
        slots_for,
        table_path,
    )
    from eagle_backbone.batched_engine import BatchedSpeculativeEngine
    from eagle_backbone.errors import ConfigError

    def factory_of(drafter, kind="eagle", attn="eager"):
        return lambda R, policy=None: BatchedSpeculativeEngine(t32, drafter, kind, slots=R, capacity=256, attn=attn,
                                                               policy=policy)

    base = cost_key("tiny", t32.dtype, t32.device, 1)
    assert base["cpu"] == processor_name("cpu") and base["cpu"]
    keys = {name: {**base, **setup_key(f(1))} for name, f in {
        "eagle": factory_of(eagle32), "draft LM": factory_of(t32.model, "draft_lm"),
        "other weights": factory_of(make_drafter(t32, seed=5, dtype=torch.float32)),
        "sdpa": factory_of(eagle32, attn="sdpa")}.items()}
    assert keys["draft LM"]["drafter_kind"] == "draft_lm" and keys["sdpa"]["attn"] == "sdpa"
    assert keys["eagle"]["drafter_sha256"] == setup_key(factory_of(eagle32)(2))["drafter_sha256"]
    assert len({table_path(tmp_path, k) for k in keys.values()}) == 4  # never the same file
    # profiled once, for the slot counts the run needs, with the dispersion of every cell
    logs = []
    table = load_or_profile(tmp_path, base, factory_of(eagle32), log=logs.append, slots=slots_for(2))
    assert table.slots == [1, 2] and table.key == keys["eagle"]
    assert len(table.dispersion["target"]) == 2 and all(v >= 0 for row in table.dispersion["target"] for v in row)
    assert table.meta["path"] == str(table_path(tmp_path, keys["eagle"])) and table.meta["profiled"][0]["slots"] == [1, 2]
    assert load_or_profile(tmp_path, base, factory_of(eagle32), slots=[1, 2]).target == table.target  # cached
    wider = load_or_profile(tmp_path, base, factory_of(eagle32), log=logs.append, slots=slots_for(3))
    assert wider.slots == [1, 2, 3] and wider.target[:2] == table.target
    assert sum("profiling" in line for line in logs) == 2
    # another drafter's table is refused by name, in one line
    with pytest.raises(ConfigError, match="drafter_kind") as e:
        CostTable.load(table.meta["path"], keys["draft LM"])
    assert "\n" not in str(e.value)
    # bench_batch checks a table given to a load-aware contender (cost_table=) against the run's setup first

    from eagle_backbone.kinds.draft_lm import DraftModelCandidateGenerator
    from ldlp.policies.load_aware import LoadAwareMarginal

    from ldlp.bench.harness.loaders import prepare_cost_tables

    given = LoadAwareMarginal({"cost_dir": str(tmp_path), "model": "tiny", "cost_table": table.meta["path"]})
    torch.set_num_threads(1)
    prepare_cost_tables([given], t32, EagleCandidateGenerator(eagle32, t32), "eager", 2)  # its own setup: fine
    with pytest.raises(ConfigError, match="drafter_kind"):
        prepare_cost_tables([given], t32, DraftModelCandidateGenerator(t32.model, t32), "eager", 2)
    # at batch 1 (evaluate, the head to head) a missing table is profiled for one slot only
    prepare_cost_tables([LoadAwareMarginal({"cost_dir": str(tmp_path / "b1"), "model": "tiny"})], t32,
                        EagleCandidateGenerator(eagle32, t32),
                        None, 1)
    assert [json.loads(f.read_text())["slots"] for f in (tmp_path / "b1").glob("*.json")] == [[1]]


def test_results_record_the_cost_table_a_load_aware_contender_planned_with(t32, eagle32, tmp_path):
    from eagle_backbone.cost import cost_key, load_or_profile
    from eagle_backbone.batched_engine import BatchedSpeculativeEngine
    from ldlp.policies.load_aware import LoadAwareMarginal

    cand = EagleCandidateGenerator(eagle32, t32)
    torch.set_num_threads(1)
    key = cost_key("tiny", t32.dtype, t32.device, 1)
    table = load_or_profile(tmp_path, key, lambda R, policy=None: BatchedSpeculativeEngine(
        t32, cand, slots=R, capacity=256, attn="eager", policy=policy), log=lambda *_: None, slots=[1, 2])
    cs = [Contender("ar", "ar", 0, None),
          Contender("load_aware", "load_aware", None, lambda: LoadAwareMarginal(
              {"cost_dir": str(tmp_path), "model": "tiny", "profile_if_missing": False}, max_gamma=3))]
    result = sweep(t32, cand, random_prompts(4), cs, [2], 6, rounds=1, log=lambda *_: None, bootstrap=10)
    used = result["cost_tables"]["load_aware"]  # the online model's prior table, and what it learned
    assert (used["key"], used["path"], used["online"]) == (table.key, table.meta["path"], True)
    assert used["records"] > 0 and set(used["costs_ms"]) >= {"fixed", "per_token", "per_draft_row"}
    write(result, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "batch_bench_runs.json").read_text())["cost_tables"]["load_aware"]["path"] \
        == table.meta["path"]


def test_each_adaptive_contender_states_its_share_of_the_batched_oracles_headroom():
    """(contender − best static γ) / (oracle_budget − best static γ) at each C where the batched oracle gains;
    static γ, AR and the oracles themselves get none."""
    from ldlp.bench.comparisons.load_aggregate import findings

    def row(contender, policy, gamma, C, tps):
        return {"contender": contender, "policy": policy, "gamma": gamma, "concurrency": C, "temperature": 0.0,
                "tokens_per_s": tps}

    rows = [row("ar", "ar", 0, 1, 100.0), row("static γ=3", "static", 3, 1, 150.0),
            row("static γ=4", "static", 4, 1, 160.0), row("oracle_budget", "oracle_budget", None, 1, 200.0),
            row("tree_budget", "tree_budget", None, 1, 170.0), row("load_aware", "load_aware", None, 1, 150.0),
            row("ar", "ar", 0, 4, 300.0), row("static γ=3", "static", 3, 4, 320.0),
            row("oracle_budget", "oracle_budget", None, 4, 310.0), row("tree_budget", "tree_budget", None, 4, 330.0)]
    share = findings(rows)["headroom_share"]
    assert share == {"tree_budget": {1: pytest.approx(0.25)}, "load_aware": {1: pytest.approx(-0.25)}}  # C=4: no headroom


def test_the_load_sweep_header_names_its_prompts_and_the_blocks_it_made(tmp_path):
    """bench_batch's results record the prompt file, its SHA-256 and the prompts dropped for length (as evaluate.py's
    do), and per C the blocks the run made: 4 asked of 16 prompts is 1 block at C=16, not 4; read back from the
    folder as the page's header is written from it."""
    import hashlib

    from ldlp.bench.comparisons.load_aggregate import read_result
    from ldlp.bench.comparisons.load_sweep import prompts_meta
    from ldlp.bench.harness.loaders import PromptSet, prompt_set_info

    data = tmp_path / "prompts.json"
    data.write_text("[]")
    prompts = PromptSet((f"c{i}", [1, 2, 3]) for i in range(16))
    prompts.info = prompt_set_info({"path": str(data), "max_prompt_tokens": 64}, n_dropped=3)
    meta = prompts_meta(prompts, [1, 4, 16], 4)
    assert meta["data_path"] == str(data) and meta["data_sha256"] == hashlib.sha256(b"[]").hexdigest()
    assert meta["n_dropped"] == 3 and "max_prompt_tokens=64" in meta["dropped_reason"]
    assert meta["blocks_asked"] == 4 and meta["blocks"] == {1: 4, 4: 4, 16: 1}
    write({"rows": [], "runs": [], "skipped": []}, tmp_path / "out", meta)
    assert read_result(tmp_path / "out")[1] == meta


def test_the_page_says_where_a_block_drains():
    from ldlp.report.load_sweep import markdown

    result = {"rows": [], "runs": [], "complete": True, "rounds_done": 1, "rounds": 1}
    thin = markdown(result, {"prompts": 32, "blocks": {1: 4, 16: 2, 32: 1}})
    assert "Draining blocks: C=16: 16 prompts a block, C=32: 32 prompts a block" in thin
    # two waves still drain (the oracle lost there: results/embedded/load_sweep_blocks); eight do not
    assert "Draining blocks: C=32: 64 prompts a block" in markdown(result, {"prompts": 128, "blocks": {1: 2, 32: 2}})
    assert "Draining" not in markdown(result, {"prompts": 512, "blocks": {1: 2, 32: 2}})
