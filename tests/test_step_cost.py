"""The online step-cost model (eagle_backbone/step_cost.py): convergence, monotonicity and robustness on
synthetic step times (noise, outliers, a change of load mid-run), the prior, and the engine's records."""

import json
import random

import numpy as np
import pytest
import torch

from eagle_backbone.cost import CostTable
from eagle_backbone.step_cost import FEATURES, OnlineCostModel, StepRecord, StepShape, attended_keys
from ldlp.bench.comparisons.step_costs import run_step_costs

TRUE = dict(fixed=3.0, per_row=0.2, per_token=0.35, per_key=0.01, per_draft_forward=0.8, per_draft_row=0.05,
            per_fed_token=0.02, per_tree=0.0)


def shape(rng, R=None, g=None, ctx=None):
    R = R or rng.choice([1, 2, 4, 8, 16])
    g = rng.randint(0, 6) if g is None else g
    ctx = ctx or rng.randint(40, 300)
    n = [g + 1] * R
    return StepShape(R, R * (g + 1), attended_keys([ctx] * R, n), tuple([R] * g), R * min(g + 1, 3))


def true_ms(s: StepShape, scale=1.0) -> float:
    return scale * float(s.features() @ np.array([TRUE[f] for f in FEATURES]))


def feed(model, rng, n, scale=1.0, noise=0.03, outliers=0.0):
    out = []
    for _ in range(n):
        s = shape(rng)
        ms = true_ms(s, scale) * (1 + rng.gauss(0, noise))
        if rng.random() < outliers:
            ms *= rng.choice([4.0, 8.0])
        out.append(StepRecord(s, ms, model.observe(s, ms)))
    return out


def rel_errors(model, rng, n=200, scale=1.0):
    shapes = [shape(rng) for _ in range(n)]
    return np.array([abs(model.predict(s) - true_ms(s, scale)) / true_ms(s, scale) for s in shapes])


def test_converges_from_a_wrong_prior():
    rng = random.Random(0)
    wrong = CostTable.linear(30.0, 5.0, 1.0)  # a table that over-predicts several-fold
    m = OnlineCostModel(prior=wrong)
    assert np.median(rel_errors(m, random.Random(1))) > 0.5
    recs = feed(m, rng, 300)
    assert np.median(rel_errors(m, random.Random(1))) < 0.05
    acc = run_step_costs(recs, age=0)  # the steps after the model's 50th
    assert acc["n"] == 250 and np.median(np.abs(acc["errors"])) < 0.1


def test_robust_to_outliers():
    rng = random.Random(2)
    m = OnlineCostModel()
    feed(m, rng, 400, outliers=0.1)  # one step in ten 4-8x slower (another process, a page fault)
    assert np.median(rel_errors(m, random.Random(3))) < 0.06


def test_follows_a_change_of_load():
    rng = random.Random(4)
    m = OnlineCostModel()
    feed(m, rng, 300)
    assert np.median(rel_errors(m, random.Random(5))) < 0.05
    feed(m, rng, 400, scale=1.6)  # a second process takes the other core: everything 1.6x slower
    assert np.median(rel_errors(m, random.Random(5), scale=1.6)) < 0.06


def test_monotone_in_every_count():
    rng = random.Random(6)
    m = OnlineCostModel()
    feed(m, rng, 100, noise=0.3, outliers=0.2)
    assert (m.theta >= 0).all()
    for R in (1, 4, 16):
        steps = [m.step_ms(R, [R] * g, R * (g + 1), 2) for g in range(9)]
        assert steps == sorted(steps)
        assert [m.target_ms(R, n) for n in range(R, 9 * R)] == sorted(m.target_ms(R, n) for n in range(R, 9 * R))
        assert [m.draft_ms(a, R) for a in range(R + 1)] == sorted(m.draft_ms(a, R) for a in range(R + 1))
    assert m.overhead_ms(32) >= m.overhead_ms(1)


def test_prior_alone_reproduces_the_table_where_it_is_linear():
    table = CostTable.linear(10.0, 1.5, 0.5)
    m = OnlineCostModel(prior=table)
    for g in range(9):
        want = table.step_ms(1, [1] * g, g + 1, min(g + 1, 3))
        assert m.step_ms(1, [1] * g, g + 1, min(g + 1, 3)) == pytest.approx(want, rel=0.05, abs=0.3)


def test_frozen_model_round_trips_and_never_refits(tmp_path):
    rng = random.Random(7)
    m = OnlineCostModel()
    feed(m, rng, 60)
    path = m.save(tmp_path / "step_costs.json")
    f = OnlineCostModel.load(path)
    s = shape(rng)
    assert f.predict(s) == pytest.approx(m.predict(s))
    before = f.theta.copy()
    f.observe(s, 1e4)
    assert (f.theta == before).all()
    (tmp_path / "bad.json").write_text('{"features": ["a"], "theta": [1]}')
    with pytest.raises(ValueError, match="bad.json: a step cost model needs features"):
        OnlineCostModel.load(tmp_path / "bad.json")


def test_hindsight_fit_of_records():
    rng = random.Random(8)
    recs = [StepRecord(s, true_ms(s)) for s in (shape(rng) for _ in range(80))]
    m = OnlineCostModel.fit(recs)
    assert np.median(rel_errors(m, random.Random(9))) < 0.02


def test_the_engine_records_its_steps_and_the_policy_plans_with_its_model(t32, eagle32, tmp_path):
    """Every speculative step is recorded with its shape; a cost-driven policy plans with the engine's online
    model, warm-started from its table, which learns from those steps; the output stays the target's."""
    from eagle_backbone.batched_engine import BatchedSpeculativeEngine
    from ldlp.policies.load_aware import LoadAwareStep
    from conftest import ar, prompts_of

    from eagle_backbone.cost import cost_key

    path = tmp_path / "cost.json"
    table = CostTable.linear(10.0, 0.5, 0.1)
    table.key = cost_key("tiny", t32.dtype, t32.device, torch.get_num_threads())
    table.save(path)
    pol = LoadAwareStep({"cost_dir": str(tmp_path), "model": "tiny", "cost_table": str(path)}, explore_every=0)
    eng = BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=3, policy=pol)
    prompts = prompts_of((5, 9, 7), seed=3)
    assert [o.tokens for o in eng.generate(prompts, 16)] == ar(t32, prompts, 16)
    model = eng.cost_model
    assert pol.costs is model and model.has_prior and model.seen == len(eng.step_log) == eng.steps
    rec = eng.step_log[0]
    assert rec.shape.prefill == 0 and rec.ms > 0 and rec.predicted_ms is not None
    assert all(r.shape.rows >= 1 and r.shape.scored >= r.shape.rows for r in eng.step_log)
    drafting = [r for r in eng.step_log if r.shape.depth_rows]
    assert drafting and all(r.gamma == len(r.shape.depth_rows) for r in drafting)
    # a second engine given the same model keeps learning from where it is
    eng2 = BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=3, policy=LoadAwareStep(
        {"cost_dir": str(tmp_path), "model": "tiny", "cost_table": str(path)}, explore_every=0), cost_model=model)
    eng2.generate(prompts, 8)
    assert eng2.cost_model is model and model.seen == eng.steps + eng2.steps


def test_joined_prompts_and_plain_steps_are_in_the_shape(t32, eagle32):
    from eagle_backbone.batched_engine import BatchedSpeculativeEngine
    from eagle_backbone.policy import StaticPolicy
    from conftest import prompts_of

    eng = BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=2, policy=StaticPolicy(0))
    a, b = prompts_of((6, 11), seed=5)
    eng.admit(0, a, 10)
    eng.step()  # the prefill alone: a step of its own, not recorded
    assert len(eng.step_log) == 0
    eng.step()
    eng.admit(1, b, 10)
    eng.step()  # slot 1's prompt rides in slot 0's step
    plain, joined = eng.step_log
    assert plain.shape.depth_rows == () and plain.shape.fed == 0 and plain.shape.scored == 1
    assert joined.shape.prefill == len(b) and joined.shape.rows == 1


def test_what_the_records_never_vary_keeps_part_of_the_prior():
    """Steps of one slot say nothing of how the cost splits between a step and a row: the ridge toward the
    prior (which does not fade) keeps a per-row cost of the prior's order, while the records fix what they
    see."""
    rng = random.Random(10)
    table = CostTable({"source": "test"}, [1, 4, 16], [1, 2, 3, 5, 9],
                      [[5.0 + 2.0 * R + 0.3 * R * t for t in (1, 2, 3, 5, 9)] for R in (1, 4, 16)],
                      [0.8, 1.0, 1.6], [[0.5] * 5 for _ in range(3)], [0.0, 0.0, 0.0])
    m = OnlineCostModel(prior=table)
    per_row = m.costs["per_row"]
    assert per_row > 1.0
    for _ in range(400):
        s = shape(rng, R=1)
        m.observe(s, true_ms(s))
    assert m.costs["per_row"] > 0.15 * per_row
    assert np.median([abs(m.predict(s) - true_ms(s)) / true_ms(s) for s in (shape(rng, R=1) for _ in range(50))]) < 0.05


def test_the_gap_decomposition_pairs_online_hindsight_and_true_acceptance():
    from ldlp.bench.comparisons.step_costs import decomposition

    def row(label, ratio, C=16):
        return {"contender": label, "concurrency": C, "temperature": 0.0, "vs": {"best_static": {"ratio": ratio}}}

    rows = [row("load_aware_step", 0.90), row("load_aware_step (hindsight costs)", 0.97),
            row("oracle_budget (hindsight costs)", 1.04), row("static γ=2", 1.0)]
    (d,) = decomposition(rows)
    assert d["policy"] == "load_aware_step" and d["costs"] == pytest.approx(0.07) and d["acceptance"] == pytest.approx(0.07)
    assert decomposition([row("load_aware_step", 0.9)]) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_engine_times_its_steps_with_cuda_events(t32, eagle32):
    """On a GPU the step clock is two CUDA events read after the step's one host read: every step is
    recorded with a positive time, and the output stays the target's."""
    import copy

    from eagle_backbone.batched_engine import BatchedSpeculativeEngine
    from eagle_backbone.policy import StaticPolicy
    from conftest import prompts_of

    target, drafter = copy.deepcopy(t32).to("cuda"), copy.deepcopy(eagle32).to("cuda")
    eng = BatchedSpeculativeEngine(target, drafter, "eagle", slots=2, policy=StaticPolicy(3),
                                   cost_model=OnlineCostModel())
    prompts = prompts_of((5, 9), seed=1)
    outs = eng.generate(prompts, 12)
    assert [o.tokens for o in outs] == [target.reference_greedy(p, 12) for p in prompts]
    assert len(eng.step_log) == eng.steps and all(r.ms > 0 for r in eng.step_log)
    assert eng.cost_model.seen == eng.steps


def test_costs_follow_the_cpu_time_and_the_stretch_makes_them_wall_time():
    """Another process on the core stretches a step's wall time, not its CPU time: the costs are fitted to the
    CPU time (a noisy 1.2-3x stretch does not blur them) and the running stretch scales the predictions."""
    rng = random.Random(11)
    m = OnlineCostModel()
    for _ in range(400):
        s = shape(rng)
        cpu = true_ms(s) * (1 + rng.gauss(0, 0.02))
        m.observe(s, cpu * rng.uniform(1.2, 3.0), cpu)
    cpu_err = [abs(m.predict_cpu(s) - true_ms(s)) / true_ms(s) for s in (shape(rng) for _ in range(100))]
    assert np.median(cpu_err) < 0.04
    assert 1.7 < m.stretch < 2.3  # the geometric mean of uniform(1.2, 3)
    s = shape(rng)
    assert m.predict(s) == pytest.approx(m.stretch * m.predict_cpu(s))
    wall = StepShape(4, 12, attended_keys([100] * 4, [3] * 4), (4, 4), 8)
    assert m.step_ms(4, [4, 4], 12, 2) == pytest.approx(m.stretch * m.predict_cpu(wall), rel=0.1)


def test_a_cost_model_measured_on_another_setup_is_refused(tmp_path, t32, eagle32):
    """A frozen step-cost model (``policy.cost_model=FILE``) records the setup its steps ran on; a policy bound to
    an engine of another setup refuses it in one line naming the fields; one of the same setup, or an older file
    without a key, is taken."""
    from conftest import one_line, table

    from eagle_backbone.cost import cost_key
    from eagle_backbone.batched_engine import BatchedSpeculativeEngine
    from ldlp.policies.load_aware import LoadAwareStep

    key = cost_key("tiny", t32.dtype, t32.device, torch.get_num_threads())
    path = tmp_path / "cost.json"
    table(0.05, 0.5, key=key).save(path)
    model = OnlineCostModel(frozen=True)
    model.theta[:] = 1.0
    for name, fitted in (("same", None), ("other", {**key, "dtype": "bfloat16"}), ("nokey", None)):
        m = OnlineCostModel.load(model.save(tmp_path / f"{name}.json"))
        if name == "same":  # what an engine of this setup binds the policy to: its table's key, filled in by bind
            pol = LoadAwareStep({"cost_dir": str(tmp_path), "model": "tiny", "cost_table": str(path)}, max_gamma=2)
            BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=1, policy=pol)
            fitted = pol.pricing.table.key
        if fitted is not None:
            raw = json.loads((tmp_path / f"{name}.json").read_text())
            (tmp_path / f"{name}.json").write_text(json.dumps({**raw, "key": fitted}))
        assert OnlineCostModel.load(tmp_path / f"{name}.json").key == fitted and m is not None
        pol = LoadAwareStep({"cost_dir": str(tmp_path), "model": "tiny", "cost_table": str(path),
                             "cost_model": str(tmp_path / f"{name}.json")}, max_gamma=2)
        if name == "other":
            with pytest.raises(ValueError, match="was measured on another setup than this engine's \\(dtype: "
                                                 "'bfloat16' vs 'float32'\\)") as e:
                BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=1, policy=pol)
            one_line(e)
        else:
            BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=1, policy=pol)
            assert pol.pricing.costs.key == fitted



def test_a_cost_model_of_another_setup_is_taken_with_accept_mismatch_and_recorded(tmp_path, t32, eagle32):
    """``accept_mismatch=true``: the cost model of another setup prices the steps, with a warning, and the run's
    results record the message the refusal would have given."""
    from conftest import table

    from eagle_backbone.cost import cost_key
    from eagle_backbone.batched_engine import BatchedSpeculativeEngine
    from eagle_backbone.errors import accept_mismatches, accepted_mismatches
    from ldlp.policies.load_aware import LoadAwareStep

    key = cost_key("tiny", t32.dtype, t32.device, torch.get_num_threads())
    path = tmp_path / "cost.json"
    table(0.05, 0.5, key=key).save(path)
    model = OnlineCostModel(frozen=True)
    model.theta[:] = 1.0
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**model.to_dict(), "key": {**key, "dtype": "bfloat16"}}))
    pol = LoadAwareStep({"cost_dir": str(tmp_path), "model": "tiny", "cost_table": str(path), "cost_model": str(other)},
                        max_gamma=2)
    accept_mismatches(True)
    try:
        BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=1, policy=pol)
        assert pol.pricing.costs.key["dtype"] == "bfloat16"
        assert accepted_mismatches() == [f"load_aware policy: cost_model={other} was measured on another setup "
                                         "than this engine's (dtype: 'bfloat16' vs 'float32'); fit one on this setup "
                                         "(scripts/bench_batch.py writes step_costs.json)"]
    finally:
        accept_mismatches(False)
