"""The batched oracle (policy=oracle_budget, issue 24): its allocation is the best of every γ vector under the cost
table, its accepted lengths are each position's own, it decodes losslessly with zero waste, refuses sampling, and
runs in the load sweep with its headroom over the best static γ reported (CPU, tiny float32 models, seconds)."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from conftest import noisy_copy, random_prompts

from eagle_backbone.kinds.draft_lm import DraftModelCandidateGenerator
from eagle_backbone.cost import CostTable, cost_key
from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.decoder import SpeculativeDecoder
from eagle_backbone.policy import StaticPolicy
from eagle_backbone.sampling import SamplingConfig
from ldlp.bench.comparisons.load_aggregate import ORACLES, findings
from ldlp.bench.comparisons.load_sweep import Contender, sweep
from ldlp.report.load_sweep import write
from ldlp.bench.harness.workload import run_workload
from ldlp.policies.oracles import OracleBudgetPolicy, accepted_lengths, allocate_budget, budget_rate
from ldlp.policies.oracles import OraclePolicy

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cand(t32):
    """A draft LM that agrees with the target often but not always: accepted lengths from 0 to k_max."""
    return DraftModelCandidateGenerator(noisy_copy(t32, 0.3), t32)


def random_sorted_or_unsorted_table(rng: random.Random, monotone: bool) -> CostTable:
    """A small random table: every list of cells drawn in a range, sorted (rising) when ``monotone`` and in no order
    otherwise; a depth overhead half the time."""
    slots, tokens = [1, 2, 4, 8], [1, 2, 3, 5, 9]

    def cells(n, lo, hi):
        v = [rng.uniform(lo, hi) for _ in range(n)]
        return sorted(v) if monotone else v

    return CostTable({"source": "test"}, slots, tokens, [cells(5, 1, 20) for _ in slots], cells(4, 0.1, 5),
                     [cells(5, 0, 3) for _ in slots], cells(4, 0, 2), cells(4, 0, 1) if rng.random() < 0.5 else [])


def brute_force(lengths, costs, fed):
    return max(budget_rate(list(g), costs, fed) for g in itertools.product(*[range(x + 1) for x in lengths]))


def test_allocation_is_the_best_of_every_gamma_vector():
    """On random cost tables (increasing cells or not, and linear ones) and random accepted lengths, the allocation
    reaches the best rate over every γ vector with 0 <= γ_b <= L_b."""
    rng = random.Random(0)
    for case in range(600):
        kind = case % 3
        costs = (CostTable.linear(rng.uniform(1, 20), rng.uniform(0, 5), rng.uniform(0, 2)) if kind == 2
                 else random_sorted_or_unsorted_table(rng, monotone=kind == 0))
        lengths = [rng.randint(0, 4) for _ in range(rng.randint(1, 5))]
        fed = rng.uniform(1, 5)
        g = allocate_budget(lengths, costs, fed)
        assert all(0 <= a <= b for a, b in zip(g, lengths)), (lengths, g)
        assert budget_rate(g, costs, fed) >= brute_force(lengths, costs, fed) * (1 - 1e-12), (case, lengths, g)
    # memoised answers are the same answers
    memo, costs = {}, random_sorted_or_unsorted_table(random.Random(1), monotone=True)
    for _ in range(50):
        lengths = [rng.randint(0, 3) for _ in range(4)]
        assert allocate_budget(lengths, costs, 2.0, memo) == allocate_budget(lengths, costs, 2.0)
    assert allocate_budget([], costs, 2.0) == [] and allocate_budget([0, 0], costs, 2.0) == [0, 0]


def test_a_ragged_allocation_beats_every_uniform_depth_cap():
    """Uniform depth caps (γ_b = min(L_b, g)) do not cover the optimum: the target's price jumps past 7 tokens at
    3 rows, so the best step scores 4 drafts over two depths, which no cap gives (caps give 3 or 5 drafts)."""
    costs = CostTable({"source": "test"}, [3], [1, 7 / 3, 8 / 3], [[10.0, 10.0, 100.0]], [0.1], [[0.0, 0.0, 0.0]], [0.0])
    lengths = [2, 2, 1]
    g = allocate_budget(lengths, costs, 1.0)
    uniform = max(budget_rate([min(x, cap) for x in lengths], costs, 1.0) for cap in range(3))
    assert sum(g) == 4 and max(g) == 2
    assert budget_rate(g, costs, 1.0) == pytest.approx(brute_force(lengths, costs, 1.0)) and \
        budget_rate(g, costs, 1.0) > 1.1 * uniform
    # drafting that never pays: plain decoding; drafting nearly free: every accepted draft
    assert allocate_budget([3, 1, 2], CostTable.linear(1.0, 50.0), 1.0) == [0, 0, 0]
    assert allocate_budget([3, 1, 2], CostTable.linear(10.0, 0.01), 1.0) == [3, 1, 2]


def test_accepted_lengths_are_each_positions_own(t32, cand):
    """Every position's accepted length equals a one-slot engine's first step on the prompt with the output's first
    p - 1 tokens appended; the replay's own positions agree with the chain oracle; the output is the target's
    greedy decoding."""
    for prompt in random_prompts(3, seed=4):
        out, at = accepted_lengths(t32, cand, prompt, 14, 4, slots=3)
        assert out == t32.reference_greedy(prompt, 14) and sorted(at) == list(range(1, len(out)))
        for p in range(1, len(out)):
            o = SpeculativeDecoder(t32, cand, StaticPolicy(4)).generate(prompt + out[: p - 1], min(4, 14 - p - 1) + 2)
            assert at[p] == (o.stats.accept_lengths[0] if o.stats.accept_lengths else 0), p
        chain = OraclePolicy(4)
        BatchedSpeculativeEngine(t32, cand, slots=1, policy=chain)  # binds it to the pair
        chain.begin(0, prompt, 14)
        assert chain.known.by_slot[0] and all(at[p] == a for p, a in chain.known.by_slot[0].items())
    assert max(max(accepted_lengths(t32, cand, p, 14, 4)[1].values()) for p in random_prompts(3, seed=4)) > 0


def table_file(tmp_path, t32, table: CostTable):
    table.key = cost_key("tiny", t32.dtype, t32.device, torch.get_num_threads())
    return str(table.save(tmp_path / "cost.json"))


def run(t32, cand, policy, prompts, C, n):
    eng = BatchedSpeculativeEngine(t32, cand, slots=C, policy=policy)
    return run_workload(eng, prompts, C, n)


def test_lossless_with_zero_waste_and_the_chain_oracle_when_drafting_is_free(t32, cand, tmp_path):
    """In a batch: every output is the target's greedy decoding and every draft is accepted; with drafting nearly
    free it drafts every accepted length (the chain oracle's target forwards), with drafting never paying none."""
    prompts = random_prompts(5, seed=4)
    ref = [t32.reference_greedy(p, 14) for p in prompts]

    def budget(table):
        return OracleBudgetPolicy({"cost_dir": str(tmp_path), "model": "tiny", "online_costs": False,
                                   "cost_table": table_file(tmp_path, t32, table)}, k_max=4)

    chain = OraclePolicy(4)
    free, chained = run(t32, cand, budget(CostTable.linear(10.0, 0.01)), prompts, 3, 14), run(t32, cand, chain, prompts, 3, 14)
    costly = run(t32, cand, budget(CostTable.linear(1.0, 50.0)), prompts, 3, 14)
    for res in (free, costly):
        assert [o.tokens for o in res.outputs] == ref
        assert all(o.stats.drafted_tokens == o.stats.accepted_tokens for o in res.outputs)
    assert [o.stats.target_forwards for o in free.outputs] == [o.stats.target_forwards for o in chained.outputs]
    assert free.stats.drafted_tokens > 0 and costly.stats.drafted_tokens == 0


def test_greedy_only_and_bad_settings(t32, cand, tmp_path):
    pol = OracleBudgetPolicy({"cost_dir": str(tmp_path), "model": "tiny"}, k_max=4)
    with pytest.raises(ValueError, match="greedy decoding only") as e:
        BatchedSpeculativeEngine(t32, cand, slots=2, policy=pol, sampling=SamplingConfig(temperature=1.0))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"bind\(view\)"):
        OracleBudgetPolicy({"cost_dir": str(tmp_path), "model": "tiny"}).begin(0, [5, 6])
    for bad in ({"k_max": 0}, {"replay_slots": 0}, {"k_max": 2.5}):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            OracleBudgetPolicy({"cost_dir": str(tmp_path), "model": "tiny"}, **bad)


def test_the_sweep_runs_it_and_reports_its_headroom(t32, cand, tmp_path):
    """A contender of the load sweep like the chain oracle: prepared before the clocks, T=0 only (skipped in one
    line at T > 0), lossless, its cost table recorded, and its gain over the best static γ per C in the findings
    (the page's headroom section is written from them) and the runs file."""
    path = table_file(tmp_path, t32, CostTable.linear(10.0, 0.3, 0.05))
    cs = [Contender("ar", "ar", 0, None),
          Contender("static γ=1", "static", 1, lambda: StaticPolicy(1)),
          Contender("static γ=2", "static", 2, lambda: StaticPolicy(2)),
          Contender("oracle", "oracle", None, lambda: OraclePolicy(4)),
          Contender("oracle_budget", "oracle_budget", None,
                    lambda: OracleBudgetPolicy({"cost_dir": str(tmp_path), "model": "tiny", "cost_table": path}, k_max=4))]
    logs = []
    result = sweep(t32, cand, random_prompts(6, seed=2), cs, [1, 3], 10, rounds=1, temperatures=[0.0, 1.0], blocks=2,
                   log=logs.append, bootstrap=50)
    rows = [r for r in result["rows"] if r["policy"] == "oracle_budget"]
    assert {(r["concurrency"], r["temperature"]) for r in rows} == {(1, 0.0), (3, 0.0)}
    assert all(r["lossless"] for r in rows) and all(set(r["vs"]) == {"ar", "best_static", "batch1_static", "oracle"}
                                                    for r in rows)
    assert {"contender": "oracle_budget", "temperature": 1.0, "why": "defined for greedy decoding only"} in result["skipped"]
    assert any("skipping oracle_budget at T=1" in line for line in logs)
    assert result["cost_tables"]["oracle_budget"]["path"] == path
    head = findings(result["rows"], temperature=0.0)["oracle_headroom"]
    assert set(head) == {"oracle", "oracle_budget"} and set(head["oracle_budget"]) == {1, 3}
    for C, h in head["oracle_budget"].items():
        best = max((r for r in result["rows"] if r["temperature"] == 0 and r["concurrency"] == C
                    and r["policy"] == "static"), key=lambda r: r["tokens_per_s"])
        row = next(r for r in rows if r["concurrency"] == C)
        assert h["best_static_gamma"] == best["gamma"]
        assert h["gain_over_best_static"] == pytest.approx(row["tokens_per_s"] / best["tokens_per_s"] - 1)
        assert h["paired"]["ratio"] == row["vs"]["best_static"]["ratio"]
    # what the page calls each one's headroom
    assert {lab: ORACLES[next(iter(per_c.values()))["policy"]] for lab, per_c in head.items()} == \
        {"oracle": "chain oracle", "oracle_budget": "batched oracle"}
    out = write(result, tmp_path / "out")
    runs = json.loads((out / "batch_bench_runs.json").read_text())
    assert runs["findings"]["0.0"]["oracle_headroom"]["oracle_budget"]["1"]["best_static_gamma"] in (1, 2)
