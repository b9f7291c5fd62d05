"""policy=load_aware and its ablations (ldlp/policies/load_aware.py), its cost table (eagle_backbone/cost.py) and
online recalibration (ldlp/models/calibration.py): the allocation the policies call against brute force, their
decisions against the pre-refactor single-class policy, the two cost extremes, the YAMLs, and greedy losslessness
in a batch and at batch 1 (sampled losslessness in a batch: tests/test_batched.py,
test_sampled_sequences_have_the_target_distribution[load_aware]). Tiny float32 models; synthetic cost tables; no
clock read."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
from conftest import ar, load_aware_policy, prompts_of, table

import ldlp.policies.load_aware as la
from eagle_backbone.cost import CostTable, check_costs, cost_key, profile_costs, table_path
from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.decoder import SpeculativeDecoder
from eagle_backbone.policy import Depth, Rows
from ldlp.bench.harness.replay import OneSequence
from ldlp.models.calibration import OnlineLogitCalibration
from ldlp.policies.allocation import allocate_depth, marginal_prefix
from ldlp.policies.load_aware import DraftState, LoadAwareMarginal, LoadAwareStep
from ldlp.policies.pricing import Budget, DepthCosts

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
CLASSES = {"marginal": LoadAwareMarginal, "step": LoadAwareStep}


def rich_table(scale: float) -> CostTable:
    """A synthetic table with every part nonzero: the target convex in the tokens, drafts, feed and
    bookkeeping growing with the rows; ``scale`` makes drafting dearer."""
    slots, tokens = [1, 2, 4, 8, 16, 32], [1, 2, 3, 5, 9]
    target = [[8.0 + scale * (0.3 * R * (t - 1) + 0.02 * (R * t) ** 1.3) for t in tokens] for R in slots]
    draft = [0.4 * scale + 0.05 * R for R in slots]
    feed = [[0.3 * scale + 0.04 * R * t for t in tokens] for R in slots]
    overhead = [0.5 + 0.01 * R for R in slots]
    depth_overhead = [0.1 + 0.002 * R for R in slots]
    return CostTable({}, slots, tokens, target, draft, feed, overhead, depth_overhead)


def random_rising_table(rng: random.Random) -> CostTable:
    """A small random table: each row of the target rises from a random start by random steps (nondecreasing in
    the tokens), the other parts positive and in no order; a depth overhead always."""
    slots, tokens = [1, 2, 4, 8], [1, 2, 3, 5, 9]
    target = []
    for _ in slots:
        row, ms = [], rng.uniform(2, 20)
        for _ in tokens:
            row.append(ms)
            ms += rng.uniform(0, 6)
        target.append(row)
    return CostTable({}, slots, tokens, target, [rng.uniform(0.05, 4) for _ in slots],
                     [[rng.uniform(0.05, 3) for _ in tokens] for _ in slots], [rng.uniform(0, 2) for _ in slots],
                     [rng.uniform(0, 1) for _ in slots])


# ---- the allocation ----------------------------------------------------------------------------------


def _host(x):
    return x.tolist() if isinstance(x, torch.Tensor) else x


def alloc(survival, accept, can_continue, budget: Budget, costs: DepthCosts):
    """allocate_depth on host lists (the tests' inputs) through its device tensors; codes back as a list."""
    f64 = torch.float64
    out = allocate_depth(torch.tensor(survival, dtype=f64), torch.tensor(accept, dtype=f64),
                         torch.tensor(can_continue, dtype=torch.bool),
                         Budget(torch.tensor(float(budget.E), dtype=f64), torch.tensor(int(budget.N)),
                                torch.tensor(float(budget.T), dtype=f64)), costs)
    return out.codes.tolist(), Budget(float(out.budget.E), float(out.budget.N), float(out.budget.T))


def brute_force_best(survival, accept, can_continue, budget: Budget, costs: DepthCosts):
    """Over every allocation of a depth (each row dropped, kept, or kept and drafting on where it may):
    the best rate of the scored set, and the best net value of the rows drafting on among the allocations
    with that rate (allocate_depth's two objectives, in order)."""
    survival, accept, can_continue = _host(survival), _host(accept), _host(can_continue)
    budget = Budget(float(budget.E), float(budget.N), float(budget.T))
    T0, m = budget.T + float(costs.draft_ms), float(costs.token_ms)
    next_ms = [float(x) for x in costs.next_depth_ms]

    def rate(codes):
        kept = [j for j, c in enumerate(codes) if c]
        return (budget.E + sum(survival[j] for j in kept)) / (T0 + m * len(kept))

    def net(codes):
        on = [j for j, c in enumerate(codes) if c == 2]
        return sum(survival[j] * accept[j] for j in on) - rate(codes) * (m * len(on) + next_ms[len(on)])

    allocations = list(itertools.product(*[(0, 1, 2) if go else (0, 1) for go in can_continue]))
    best_rate = max(rate(c) for c in allocations)
    tied = [c for c in allocations if rate(c) >= best_rate * (1 - 1e-12)]
    return best_rate, max(net(c) for c in tied), rate, net


def check_against_brute_force(survival, accept, can_continue, budget, costs, got):
    """``got``: (codes, budget after) as host values."""
    codes, after = got
    survival, can_continue = _host(survival), _host(can_continue)
    best_rate, best_net, rate, net = brute_force_best(survival, accept, can_continue, budget, costs)
    assert rate(codes) == pytest.approx(best_rate, rel=1e-12)
    assert net(codes) == pytest.approx(best_net, rel=1e-12, abs=1e-12)
    kept = [j for j, c in enumerate(codes) if c]
    assert all(can_continue[j] for j, c in enumerate(codes) if c == 2)
    # the plan after the depth: its forward and the kept drafts added
    assert float(after.E) == pytest.approx(float(budget.E) + sum(survival[j] for j in kept), rel=1e-12)
    assert float(after.N) == float(budget.N) + len(kept)
    assert float(after.T) == pytest.approx(float(budget.T) + float(costs.draft_ms) + float(costs.token_ms) * len(kept),
                                           rel=1e-12)


def test_allocate_depth_equals_brute_force_on_random_cost_tables():
    """The one allocation (the function LoadAwareMarginal.keep_rows calls) against every allocation of a
    depth, on small random cost tables, survivals and acceptance estimates: each rate exactly the best."""
    rng = random.Random(0)
    drafting_on = 0
    for _ in range(300):
        tab = random_rising_table(rng)
        R = rng.randint(1, 8)
        A = rng.randint(1, min(R, 5))
        budget = Budget(E=rng.uniform(R, 3 * R), N=float(R + rng.randint(0, 2 * R)), T=rng.uniform(5, 60))
        accept = [rng.random() for _ in range(A)]
        survival = [rng.random() ** rng.randint(0, 3) * a for a in accept]
        can_continue = [rng.random() < 0.75 for _ in range(A)]
        costs = DepthCosts.from_table(tab, R, A, budget.N)
        got = alloc(survival, accept, can_continue, budget, costs)
        check_against_brute_force(survival, accept, can_continue, budget, costs, got)
        drafting_on += 2 in got[0]
    assert drafting_on > 20  # the second objective is exercised, not only "stop everywhere"


def test_the_marginal_policy_allocates_with_allocate_depth_brute_force(tmp_path, monkeypatch):
    """Every call the marginal policy makes while driven as the engine drives it is allocate_depth's, and
    each is the brute-force optimum for the inputs it was given (with the policy's own plan and costs)."""
    calls = []

    def recording(*args):
        out = allocate_depth(*args)
        calls.append((args, (out.codes.tolist(), out.budget)))
        return out

    monkeypatch.setattr(la, "allocate_depth", recording)
    for scale, seed in ((0.5, 1), (1.0, 2), (2.0, 3)):
        pol = _make(tmp_path, "marginal", {}, max_gamma=4)
        _drive(pol, rich_table(scale), seed, steps=20, rows=(1, 2, 3, 5))
    assert len(calls) > 50 and max(args[0].shape[0] for args, _ in calls) >= 4
    for (survival, accept, can_continue, budget, costs), out in calls:
        check_against_brute_force(survival, accept, can_continue, budget, costs, out)


def test_allocate_depth_scores_what_pays_and_continues_what_pays_for_the_next_depth():
    # rate 10 / 10 = 1 token/ms after this depth's free forward; a scored token costs 0.5 ms
    costs = DepthCosts(draft_ms=0.0, token_ms=0.5, next_depth_ms=torch.tensor([0.2 * k for k in range(4)]))
    codes, after = alloc([0.9, 0.1, 0.6], [0.9, 0.9, 0.2], [True, True, True], Budget(10.0, 4.0, 10.0), costs)
    # 0.9 and 0.6 pay (≥ 0.5 at the rising rate), 0.1 does not; 0.9 · 0.9 pays for 0.5 + 0.2 ms, 0.6 · 0.2 not
    assert codes == [2, 0, 1]
    assert after == Budget(11.5, 6.0, 11.0)
    # a row at its cap keeps its draft and stops
    assert alloc([0.9], [0.9], [False], Budget(10.0, 4.0, 10.0), costs)[0] == [1]
    # no rows: the depth's forward only
    assert alloc([], [], [], Budget(1.0, 1.0, 2.0), DepthCosts(3.0, 1.0, torch.zeros(2)))[1].T == 5.0


def test_marginal_prefix_stops_at_the_first_value_below_the_rate():
    # rate 1 token/ms; a token at 0.5 ms is worth it when its value >= 0.5 (and the rate then rises)
    f64 = dict(dtype=torch.float64)
    assert marginal_prefix(torch.tensor([0.9, 0.6, 0.55, 0.1], **f64), 10.0, 10.0, 0.5) == 3
    assert marginal_prefix(torch.tensor([0.4], **f64), 10.0, 10.0, 0.5) == 0


# ---- the same decisions as the single-class policy before the split ----------------------------------

# (the fixed-threshold mode of the single class was retired with load_aware_fixed; its cases keep their
# positions, which seed the others)
_CASES = [("marginal", 1.0, {}), ("marginal", 4.0, {}), ("marginal", 1.0, {"recalibrate": False}),
          ("fixed", 1.0, {"threshold": 0.3}), ("fixed", 4.0, {"threshold": 0.6, "recalibrate": False}),
          ("step", 1.0, {}), ("step", 4.0, {})]
_B1_SEEDS = {"marginal": 100, "step": 102}

# the in-tree reference: recorded from the single-class LoadAwarePolicy(mode=...) before the split, with _drive and
# _drive_batch1 on the cases of _CASES: per step, the plan's γ per row then each depth's codes (comma-separated),
# steps separated by ';', then the running acceptance rate (and drafter feed) at the end
PRE_REFACTOR = {
    "marginal-1.0-0":
        "54025,1222,110;55512050,221012,220,10;1,1;51,21,0;2,2,1;551,221,11;115,112,1;5,1;"
        "25515155,21012121,001;512,111;0;55040250,00111;5,2,1;40505412,111111;4,2,2,1;455,111;"
        "21154252,11110111;55554,11111;54555,01111;54201,0111;510,11;55052,1111;52,22,11;"
        "54554542,10110011;451,111|0.554400712191|1.426117704992",
    "marginal-4.0-1":
        "55,10;00000;00000000;45,01;00000000;00000000;00000000;555,110;00000000;4,2,1;00000000;5,2,0;"
        "00000;1,1;000;00000;00000000;50455525,0001100;00000000;00000;1,1;00000000;15,01;000;"
        "00000000|0.677839060239|1.189349459476",
    "marginal-1.0-2":
        "0;515,211,1;55552,11100;11101211,1111211,1;24555,22121,111;25422555,11210012,10;5,2,2,1;4,2,2,0;"
        "15,01;5,2,1;51,20,1;0;55502240,111001;55,22,12,1;5,2,1;011,11;54,11;542,100;50100015,0011;"
        "55105,2112,11;2,1;04544,1101;05,1;402,10;0|0.627094826979|1.321251542616",
    "step-1.0-5":
        "22222222;331;4;21222;11020;122;32;11202;222;33;022;22220;3;22222;020;22;2;212;212;10111111;33;1;"
        "102;22122;221|0.631280984388|1.899272917014",
    "step-4.0-6":
        "00000000;00000000;00000;11111;000;000;00000000;11;00000;2;00000;0;000;000;11111111;00000;2;2;"
        "000;000;01;11;2;2;00000|0.683090293704|1.401206236835",
    "b1-marginal":
        "2:1;5:2;0:0;5:1;5:1;2:1;5:3;5:3;2:1;2:2;2:2;5:3;2:2;5:2;5:4;0:0;5:1;5:2;5:1;0:0|0.678941465837",
    "b1-step":
        "2:2;2:2;0:0;3:3;2:2;2:2;3:3;3:3;3:3;2:2;3:3;3:3;3:3;3:3;3:3;3:3;3:3;2:2;0:0;3:3|0.690246991615",
}


def _make(tmp_path, mode: str, kw: dict, **more):
    """A policy of ``mode`` reading a cost table set by the driver (no engine)."""
    p = tmp_path / "unused_cost.json"
    rich_table(1.0).save(p)
    return CLASSES[mode]({"cost_dir": str(tmp_path), "model": "tiny", "cost_table": str(p), "online_costs": False},
                         **kw, **more)


def _drive(pol, costs: CostTable, seed: int, steps: int = 25, rows=(1, 2, 3, 5, 8)) -> str:
    """Drive ``pol`` as the batched engine does (plan, keep_rows after each depth for the rows that drafted
    there, observe_rows) on fixed random caps, drafter probabilities and acceptances; its decisions as text."""
    rng = random.Random(seed)
    pol.pricing.costs = costs
    out = []
    for _ in range(steps):
        R = rng.choice(rows)
        caps = [rng.choice([0, 1, 2, 4, 6, 6, 6]) for _ in range(R)]
        view = Rows(list(range(R)), caps, [0] * R, torch.zeros(R, dtype=torch.long), torch.zeros(R, 4))
        g = list(pol.plan(view))
        line = ["".join(map(str, g))]
        drafted = [0] * R
        active = [i for i in range(R) if g[i] > 0]
        depth = 1
        while active:
            for i in active:
                drafted[i] = depth
            if not pol.reads_drafts:
                active = [i for i in active if g[i] > depth]
            else:
                probs = torch.tensor([[p, p / 2, p / 3] for p in (rng.uniform(0.02, 0.99) for _ in active)])
                d = Depth(depth, list(active), torch.tensor(active), torch.zeros(len(active), dtype=torch.long),
                          probs, None, torch.zeros(len(active), dtype=torch.float64))
                codes = pol.stop(d).tolist()
                line.append("".join(map(str, codes)))
                for i, c in zip(active, codes):
                    if c == 0:
                        drafted[i] = depth - 1
                active = [i for i, c in zip(active, codes) if c == 2 and g[i] > depth]
            depth += 1
        accepted = [rng.randint(0, d) for d in drafted]
        pol.observe(view, drafted, accepted, {k: v.tolist() for k, v in pol.reads().items()})
        out.append(",".join(line))
    return ";".join(out) + f"|{pol.accept.value:.12f}|{pol.feed.value:.12f}"


def _drive_batch1(pol, costs: CostTable, seed: int, steps: int = 20) -> str:
    """Drive ``pol`` one sequence at a time as replay does (plan, stop per draft, observe)."""
    rng = random.Random(seed)
    pol.pricing.costs = costs
    state, pol = pol, OneSequence(pol)  # a batched policy one sequence at a time
    pol.begin([])
    out = []
    for _ in range(steps):
        g = pol.plan(5, torch.zeros(4), cap=rng.choice([0, 2, 6, 6]))
        n = 0
        for i in range(1, g + 1):
            n = i
            p = rng.uniform(0.02, 0.99)
            if not pol.go_on(i, torch.tensor([p, p / 2])):
                break
        k = rng.randint(0, n)
        pol.observe(n, k)
        out.append(f"{g}:{n}")
    return ";".join(out) + f"|{state.accept.value:.12f}"


def _decisions(tmp_path) -> dict:
    got = {}
    for k, (mode, scale, kw) in enumerate(_CASES):
        if mode not in CLASSES:
            continue
        got[f"{mode}-{scale}-{k}"] = _drive(_make(tmp_path, mode, kw, max_gamma=5, explore_every=4),
                                            rich_table(scale), seed=k)
    for mode in CLASSES:
        got[f"b1-{mode}"] = _drive_batch1(_make(tmp_path, mode, {}, max_gamma=5, explore_every=4),
                                          rich_table(2.0), seed=_B1_SEEDS[mode])
    return got


def test_the_three_classes_decide_as_the_single_class_policy_did(tmp_path):
    """Same plans (γ per row), same codes at every depth, same running acceptance rate, on fixed inputs, as
    the one class with a ``mode`` string before the split (its outputs recorded in PRE_REFACTOR)."""
    assert _decisions(tmp_path) == PRE_REFACTOR


def test_policy_yamls_build_the_three_classes(tmp_path):
    from hydra.utils import instantiate

    from conftest import compose_config

    built = {}
    for name in ("load_aware", "load_aware_head", "load_aware_step"):
        cfg = compose_config("evaluate", [f"policy={name}", f"paths.draft_acceptance={tmp_path}",
                                          f"paths.cost={tmp_path / 'cost'}"])
        assert "mode" not in cfg.policy, name
        built[name] = instantiate(cfg.policy)
    assert type(built["load_aware"]) is LoadAwareMarginal and built["load_aware"].estimator_spec == "confidence"
    head = built["load_aware_head"]
    assert type(head) is LoadAwareMarginal and head.estimator_spec == str(tmp_path)
    assert type(built["load_aware_step"]) is LoadAwareStep and not built["load_aware_step"].reads_drafts
    assert all(p.name == "load_aware" and p.max_gamma == 8 for p in built.values())


def test_free_tokens_draft_to_the_cap_and_prohibitive_ones_draft_nothing(tmp_path, t32, eagle32):
    prompts = prompts_of((5, 9, 7, 12), seed=2)
    key = cost_key("tiny", t32.dtype, t32.device, torch.get_num_threads())
    for per_token, draft, expect in ((0.0, 0.0, "cap"), (1e4, 1e4, "none")):
        pol = load_aware_policy(tmp_path, table(per_token, draft, key=key), max_gamma=3)
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


@pytest.mark.parametrize("mode", list(CLASSES))
def test_greedy_identity_in_a_batch(tmp_path, t32, eagle32, mode):
    key = cost_key("tiny", t32.dtype, t32.device, torch.get_num_threads())
    # the tiny drafter's top probabilities are low: a low fixed threshold so that it drafts at all
    pol = load_aware_policy(tmp_path, table(0.05, 0.5, key=key), mode=mode, max_gamma=4)
    prompts = prompts_of((3, 11, 6, 8, 4, 9), seed=7)
    eng = BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=3, policy=pol)
    from ldlp.bench.harness.workload import run_workload

    res = run_workload(eng, prompts, 3, 16)
    assert [o.tokens for o in res.outputs] == ar(t32, prompts, 16)
    lengths = {d for o in res.outputs for d in o.stats.draft_lengths}
    assert max(lengths) > 0 and len(lengths) > 1  # it drafts, and not always the same γ


def test_batch1_engine_runs_the_same_policy(tmp_path, t32, eagle32):
    key = cost_key("tiny", t32.dtype, t32.device, torch.get_num_threads())
    pol = load_aware_policy(tmp_path, table(0.05, 0.5, key=key), max_gamma=4)
    dec = SpeculativeDecoder(t32, EagleCandidateGenerator(eagle32, t32), pol)
    prompts = prompts_of((5, 8), seed=3)
    assert [dec.generate(p, 14).tokens for p in prompts] == ar(t32, prompts, 14)


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
    with pytest.raises(ValueError, match="max_gamma"):
        LoadAwareStep({"cost_dir": str(tmp_path), "model": "tiny"}, max_gamma=0)
    with pytest.raises(ValueError, match="estimator"):
        LoadAwareMarginal({"cost_dir": str(tmp_path), "model": "tiny"}, estimator=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no cost table"):
        from eagle_backbone.cost import load_or_profile

        load_or_profile(tmp_path, {"dtype": "float32", "device": "cpu", "threads": 1}, None, profile_if_missing=False)


def test_step_ms_is_the_one_step_formula():
    """CostTable.step_ms (read by the load-aware policies, check_costs and replay): bookkeeping + verification
    + (catch-up + one depth per entry of depth_rows, when any row drafts); uniform_gamma plans with it."""
    from ldlp.policies.pricing import uniform_gamma

    c = rich_table(1.0)
    for R in (1, 3, 8, 20):
        assert c.step_ms(R, [], R, 2.0) == pytest.approx(c.overhead_ms(R) + c.target_ms(R, R))
        depths = [R, max(1, R // 2), 1]
        want = (c.overhead_ms(R) + c.target_ms(R, R + sum(depths)) + c.feed_ms(R, 2.0)
                + sum(c.draft_ms(a, R) for a in depths))
        assert c.step_ms(R, depths, R + sum(depths), 2.0) == pytest.approx(want)
        for accept in (0.0, 0.5, 0.9):  # the γ that maximises tokens per ms under the formula
            rates = [R * sum(accept ** i for i in range(g + 1)) / c.step_ms(R, [R] * g, R * (g + 1), 2.0)
                     for g in range(7)]
            assert uniform_gamma(c, R, 6, accept, 2.0) == max(range(7), key=lambda g: (rates[g], -g))


# ---- the host-float plan of a few rows on a CPU ------------------------------------------------------------


def test_the_host_allocation_makes_the_device_allocations_choices():
    """allocate_depth_host on random survivals, estimates, caps, plans and prices: the same codes and plan
    totals as the device allocation (ties included: survivals drawn from a few values)."""
    from ldlp.policies.allocation import allocate_depth_host

    rng = random.Random(3)
    for _ in range(400):
        A = rng.randint(1, 6)
        S = [rng.choice([-1.0, 0.2, 0.5, 0.5, 0.8, rng.random()]) for _ in range(A)]
        a = [rng.choice([0.3, 0.9, rng.random()]) for _ in range(A)]
        can = [rng.random() < 0.7 for _ in range(A)]
        E, N, T, m = rng.uniform(1, 8), rng.randint(1, 8), rng.uniform(5, 40), rng.choice([0.0, 0.3, 2.0, 8.0])
        nxt = [0.0] + [rng.uniform(0, 3) for _ in range(A)]
        host, hb = allocate_depth_host(S, a, can, Budget(E, N, T), DepthCosts(1.0, m, nxt))
        f64 = dict(dtype=torch.float64)
        dev = allocate_depth(torch.tensor(S, **f64), torch.tensor(a, **f64), torch.tensor(can),
                             Budget(torch.tensor(E, **f64), torch.tensor(N), torch.tensor(T, **f64)),
                             DepthCosts(torch.tensor(1.0, **f64), torch.tensor(m, **f64), torch.tensor(nxt, **f64)))
        assert host == dev.codes.tolist(), (S, a, can, E, N, T, m, nxt)
        assert (hb.N, hb.E, hb.T) == pytest.approx((int(dev.budget.N), float(dev.budget.E), float(dev.budget.T)))


def test_few_rows_on_a_cpu_plan_on_host_floats_with_the_same_outcome(tmp_path, t32, eagle32):
    """policy=load_aware at C <= host_rows on a CPU engine plans on host floats; the outputs and counters
    equal those of the device plan (host_rows=0), and the host plan reads nothing extra."""
    from ldlp.policies.load_aware import HostDraftState

    key = cost_key("tiny", t32.dtype, t32.device, torch.get_num_threads())
    prompts = prompts_of((3, 11, 6, 8), seed=9)
    got = {}
    for host_rows in (4, 0):
        pol = load_aware_policy(tmp_path, table(0.05, 0.5, key=key), max_gamma=4)
        pol.host_rows = host_rows
        plans = []
        start = pol._start
        pol._start = lambda caps, g: (lambda out: plans.append(type(out[1])) or out)(start(caps, g))
        eng = BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=2, policy=pol)
        outs = eng.generate(prompts[:2], 14) + eng.generate(prompts[2:], 14)
        assert plans and set(plans) == ({HostDraftState} if host_rows else {DraftState})
        got[host_rows] = [(o.tokens, o.stats.draft_lengths, o.stats.accept_lengths) for o in outs]
    assert got[4] == got[0]
    assert [t for t, _, _ in got[4]] == ar(t32, prompts, 14)
