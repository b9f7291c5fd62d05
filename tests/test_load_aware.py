"""policy=load_aware (ldlp/load_aware.py), its cost table (eagle_backbone/batched/cost.py) and online
recalibration (ldlp/calibration.py): the allocation against brute force, the two cost extremes, and
losslessness in a batch, greedy and sampled. Tiny float32 models; synthetic cost tables; no clock read."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from test_batched import _chi2_pvalue, _pair_distribution, ar, noisy_copy, prompts_of

from eagle_backbone.batched.cost import CostTable, check_costs, cost_key, profile_costs, table_path
from eagle_backbone.engine import BatchedSpeculativeEngine
from eagle_backbone.candidates import EagleCandidateGenerator
from eagle_backbone.engine import SpeculativeDecoder
from eagle_backbone.sampling import SamplingConfig
from ldlp.calibration import OnlineLogitCalibration
from ldlp.load_aware import LoadAwarePolicy, allocate_budget, marginal_prefix

torch.set_num_threads(1)


def table(target_per_token: float, draft: float, base: float = 10.0, key=None) -> CostTable:
    """A synthetic table: the target costs ``base`` + ``target_per_token`` per scored token past the first
    a row; a draft depth ``draft`` ms whatever the rows."""
    slots, tokens = [1, 2, 4, 8, 16, 32], [1, 2, 3, 5, 9]
    return CostTable(key or {}, slots, tokens,
                     [[base + target_per_token * R * (t - 1) for t in tokens] for R in slots],
                     [draft] * len(slots), [[draft] * len(tokens) for _ in slots], [0.0] * len(slots))


def policy(tmp_path, costs: CostTable, **kw) -> LoadAwarePolicy:
    p = tmp_path / "cost.json"
    costs.save(p)
    pol = LoadAwarePolicy(cost_dir=str(tmp_path), model="tiny", cost_table=str(p), explore_every=0, **kw)
    return pol


def bind(pol, key):
    pol.costs.key = key  # the synthetic table stands for this machine's


# ---- the allocation ----------------------------------------------------------------------------------


def test_marginal_allocation_equals_brute_force():
    """On small batches with every survival known, the global top budget maximises E / T exactly."""
    rng = random.Random(0)
    for _ in range(200):
        R, G = rng.randint(1, 3), rng.randint(1, 3)
        surv = []
        for _ in range(R):
            s, row = 1.0, []
            for _ in range(G):
                s *= rng.random()
                row.append(s)
            surv.append(row)
        E, T, m = float(R), rng.uniform(5, 20), rng.uniform(0.05, 5)

        def rate(gs):
            return (E + sum(sum(row[:g]) for row, g in zip(surv, gs))) / (T + m * sum(gs))

        best = max(rate(gs) for gs in itertools.product(range(G + 1), repeat=R))
        got = allocate_budget(surv, E, T, m)
        assert rate(got) == pytest.approx(best, rel=1e-12)


def test_marginal_prefix_stops_at_the_first_value_below_the_rate():
    # rate 1 token/ms; a token at 0.5 ms is worth it when its value >= 0.5 (and the rate then rises)
    assert marginal_prefix([0.9, 0.6, 0.55, 0.1], 10.0, 10.0, 0.5) == 3
    assert marginal_prefix([0.4], 10.0, 10.0, 0.5) == 0


def test_free_tokens_draft_to_the_cap_and_prohibitive_ones_draft_nothing(tmp_path, t32, eagle32):
    prompts = prompts_of((5, 9, 7, 12), seed=2)
    key = cost_key("tiny", t32.dtype, t32.device, torch.get_num_threads())
    for per_token, draft, expect in ((0.0, 0.0, "cap"), (1e4, 1e4, "none")):
        pol = policy(tmp_path, table(per_token, draft, key=key), max_gamma=3)
        eng = BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=4, policy=pol)
        outs = eng.generate(prompts, 12)
        assert [o.tokens for o in outs] == ar(t32, prompts, 12)
        for o in outs:
            st = o.stats
            if expect == "none":
                assert st.drafted_tokens == 0 and st.target_forwards == len(o.tokens)
            else:
                # every step drafts to its cap (3, or what the budget leaves)
                assert all(d == min(3, 12 - n - 1) for d, n in zip(st.draft_lengths, _emitted_before(st)))


def _emitted_before(st):
    """Tokens emitted before each decoding step (the prefill emits the first)."""
    n, out = 1, []
    for k in st.accept_lengths:
        out.append(n)
        n += k + 1
    return out


# ---- losslessness in a batch -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["marginal", "fixed", "step"])
def test_greedy_identity_in_a_batch(tmp_path, t32, eagle32, mode):
    key = cost_key("tiny", t32.dtype, t32.device, torch.get_num_threads())
    # the tiny drafter's top probabilities are low: a low fixed threshold so that it drafts at all
    pol = policy(tmp_path, table(0.05, 0.5, key=key), mode=mode, max_gamma=4, threshold=0.02)
    prompts = prompts_of((3, 11, 6, 8, 4, 9), seed=7)
    eng = BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=3, policy=pol)
    from eagle_backbone.batched.workload import run_workload

    res = run_workload(eng, prompts, 3, 16)
    assert [o.tokens for o in res.outputs] == ar(t32, prompts, 16)
    lengths = {d for o in res.outputs for d in o.stats.draft_lengths}
    assert max(lengths) > 0 and len(lengths) > 1  # it drafts, and not always the same γ


def test_batch1_engine_runs_the_same_policy(tmp_path, t32, eagle32):
    key = cost_key("tiny", t32.dtype, t32.device, torch.get_num_threads())
    pol = policy(tmp_path, table(0.05, 0.5, key=key), max_gamma=4)
    dec = SpeculativeDecoder(t32, EagleCandidateGenerator(eagle32, t32), pol)
    prompts = prompts_of((5, 8), seed=3)
    assert [dec.generate(p, 14).tokens for p in prompts] == ar(t32, prompts, 14)


def test_sampled_sequences_have_the_target_distribution(tmp_path, t32):
    """Speculative sampling stays exact with the load-aware policy choosing γ per slot (mixed, 0 included)."""
    import copy

    no_eos = copy.copy(t32)
    no_eos.eos_token_ids = set()
    drafter = noisy_copy(t32, 0.6, seed=11)
    temp, runs, slots = 0.3, 60, 32
    prompt = prompts_of((6,), seed=5)[0]
    exact = _pair_distribution(no_eos, prompt, temp)
    key = cost_key("tiny", t32.dtype, t32.device, torch.get_num_threads())
    samples, gammas = [], set()
    for r in range(runs):
        pol = policy(tmp_path, table(0.02, 0.3, key=key), max_gamma=2)
        eng = BatchedSpeculativeEngine(no_eos, drafter, "draft_lm", slots=slots, policy=pol,
                                       sampling=SamplingConfig(temperature=temp))
        outs = eng.generate([prompt] * slots, 4, seeds=[1000 * r + b for b in range(slots)])
        samples += [tuple(o.tokens[:2]) for o in outs]
        gammas |= {d for o in outs for d in o.stats.draft_lengths}
    assert {0, 1, 2} <= gammas
    assert _chi2_pvalue(samples, exact, len(samples)) > 1e-3


# ---- cost table and calibration ----------------------------------------------------------------------


def test_cost_table_profiles_round_trips_and_refuses_another_key(tmp_path, t32, eagle32):
    key = cost_key("tiny", t32.dtype, t32.device, 1)
    tab = profile_costs(lambda R, policy=None: BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=R, capacity=64,
                                                                        policy=policy),
                        key, slots=(1, 2), tokens=(1, 3), context=16, reps=1, log=lambda *_: None)
    assert len(tab.target) == 2 and all(len(r) == 2 and min(r) > 0 for r in tab.target) and min(tab.draft) > 0
    path = tab.save(table_path(tmp_path, key))
    assert CostTable.load(path, key).target == tab.target
    with pytest.raises(ValueError, match="profiled for"):
        CostTable.load(path, {**key, "threads": 7})
    assert tab.target_ms(1, 2) == pytest.approx((tab.target[0][0] + tab.target[0][1]) / 2)
    # the table against measured engine steps: one row per (slots, γ), both times positive
    rows = check_costs(tab, lambda R, policy=None: BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=R, capacity=64,
                                                                            policy=policy),
                       prompts_of((4, 6, 5, 7, 3, 8, 6, 5), seed=1), slots=(1, 2), gammas=(0, 2), steps=2,
                       max_new_tokens=6)
    assert [(r["slots"], r["gamma"]) for r in rows] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in rows)


def test_online_calibration_recovers_a_miscalibrated_estimator():
    g = torch.Generator().manual_seed(0)
    cal = OnlineLogitCalibration()
    for _ in range(300):
        p = torch.rand(32, generator=g) * 0.98 + 0.01
        true = torch.sigmoid(0.5 * torch.log(p / (1 - p)) + 1.0)
        cal.update(p, (torch.rand(32, generator=g) < true).float())
    s = cal.state()
    assert s["w"] == pytest.approx(0.5, abs=0.15) and s["c"] == pytest.approx(1.0, abs=0.2)


def test_bad_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        LoadAwarePolicy(cost_dir=str(tmp_path), model="tiny", mode="greedy")
    with pytest.raises(ValueError, match="estimator"):
        LoadAwarePolicy(cost_dir=str(tmp_path), model="tiny", estimator=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no cost table"):
        from eagle_backbone.batched.cost import load_or_profile

        load_or_profile(tmp_path, {"dtype": "float32", "device": "cpu", "threads": 1}, None, profile_if_missing=False)
