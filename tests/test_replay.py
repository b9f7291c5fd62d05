"""Replay on oracle rows counts exactly what the engine does; pricing by the cost table (measured or linear), the
linear fit and the tuner work."""

import pytest
import torch
from oracle_helpers import greedy_oracle, mimic_pair

from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.decoder import SpeculativeDecoder
from eagle_backbone.metrics import GenerationStats
from eagle_backbone.policy import StaticPolicy
from eagle_backbone.cost import CostTable
from ldlp.bench.harness.replay import (OracleRows, costs_record, fit_costs, grid, replay, stand_in_probs, step_seconds,
                                       tune)
from ldlp.report.replay import tuning_markdown
from ldlp.policies.threshold import ConfidencePolicy, DDDPolicy, HeuristicPolicy

PROMPTS = [[5, 9, 11, 3], [7, 7, 20], [30, 4, 12, 18, 9], [6]]
BUDGET = 36


@pytest.fixture(scope="module")
def setup():
    target, drafter = mimic_pair()
    rows = [greedy_oracle(target, drafter, p, BUDGET, k_max=8)[1] for p in PROMPTS]
    return target, drafter, OracleRows.from_sequences(rows, BUDGET)


POLICIES = [lambda: StaticPolicy(1), lambda: StaticPolicy(3), lambda: StaticPolicy(8), lambda: StaticPolicy(0),
            lambda: DDDPolicy(-0.7, 8), lambda: DDDPolicy(-3.0, 5), lambda: ConfidencePolicy(0.5, 8),
            lambda: HeuristicPolicy(2, 8)]


@pytest.mark.parametrize("make", POLICIES)
def test_replay_counts_equal_the_engine(setup, make):
    target, drafter, rows = setup
    cand = EagleCandidateGenerator(drafter, target)
    stats = [SpeculativeDecoder(target, cand, make()).generate(p, BUDGET).stats for p in PROMPTS]
    res = replay(rows, make(), CostTable.linear(10.0, 1.0), embed=target.embed, vocab_size=target.vocab_size)
    assert res.steps == sum(s.target_forwards - 1 for s in stats)  # the engine also counts the prefill
    assert res.drafted == sum(s.drafted_tokens for s in stats)
    assert res.accepted == sum(s.accepted_tokens for s in stats)
    assert res.new_tokens == sum(s.new_tokens for s in stats) - len(PROMPTS)  # its first token is the prefill's
    assert res.steps > 0 and (res.accepted > 0) == (res.drafted > 0)


def test_oracle_replay_wastes_nothing_and_bounds_static(setup):
    target, _, rows = setup
    costs = CostTable.linear(10.0, 2.0)
    oracle = replay(rows, "oracle", costs, oracle_cap=8)
    assert oracle.wasted == 0
    for g in range(0, 9):
        static = replay(rows, StaticPolicy(g), costs)
        assert static.steps >= oracle.steps and static.tokens_per_s <= oracle.tokens_per_s
        assert static.new_tokens == oracle.new_tokens  # the same responses, cut into different steps


def test_stand_in_distribution_keeps_top_probability_and_entropy():
    for p, h in [(0.9, 0.5), (0.3, 3.0), (0.05, 6.0), (0.5, 0.6931), (1.0, 0.0)]:
        q = stand_in_probs(p, h, 4096)
        assert float(q.sum()) == pytest.approx(1.0)
        assert float(q.max()) == pytest.approx(p) and int(q.argmax()) == 0
        entropy = float(-(q * q.log()).sum())
        assert entropy == pytest.approx(h, abs=0.02)


def test_a_linear_cost_table_prices_exactly_its_three_terms():
    lin = CostTable.linear(12.0, 1.5, 0.4)
    for drafted, accepted in [(0, 0), (1, 0), (1, 1), (4, 2), (8, 8)]:
        want = 12.0 + 1.5 * drafted + 0.4 * accepted
        assert lin.step_ms(1, [1] * drafted, drafted + 1, accepted + 1) == pytest.approx(want)
        assert step_seconds(lin, drafted, accepted) == pytest.approx(want / 1e3)
    assert costs_record(lin) == {"source": "linear", "step_ms": 12.0, "draft_ms": 1.5, "accepted_ms": 0.4}
    with pytest.raises(ValueError, match=">= 0"):
        CostTable.linear(12.0, -1.0)


def test_cost_fit_recovers_known_costs():
    step_ms, draft_ms, accepted_ms = 12.0, 1.5, 0.4
    stats = []
    for f, d, a in [(30, 0, 0), (20, 40, 25), (15, 60, 30), (12, 96, 35), (25, 25, 20)]:
        stats.append(GenerationStats(target_forwards=f, drafted_tokens=d, accepted_tokens=a,
                                     wall_s=(step_ms * f + draft_ms * d + accepted_ms * a) / 1e3))
    fit = fit_costs(stats)
    assert isinstance(fit, CostTable)  # the fit is a (linear) cost table, not a second kind of model
    terms = fit.meta["linear"]
    assert terms["step_ms"] == pytest.approx(step_ms) and terms["draft_ms"] == pytest.approx(draft_ms)
    assert terms["accepted_ms"] == pytest.approx(accepted_ms, abs=1e-6)
    assert fit.step_ms(1, [1] * 4, 5, 3) == pytest.approx(step_ms + 4 * draft_ms + 2 * accepted_ms)
    with pytest.raises(ValueError, match="several static"):
        fit_costs(stats[:2])


def test_tune_reports_best_static_and_oracle_headroom(setup):
    _, _, rows = setup
    results = tune(rows, CostTable.linear(10.0, 2.0), {
        "static": (lambda p: StaticPolicy(**p), grid({"gamma": [1, 2, 4, 8]})),
        "ddd": (lambda p: DDDPolicy(**p), grid({"threshold": [-0.5, -2.0], "max_gamma": 8}))}, progress=False)
    assert [r["policy"] for r in results].count("static") == 4 and results[-1]["policy"] == "oracle"
    best_static = max(r["tokens_per_s"] for r in results if r["policy"] == "static")
    assert any(r["headroom_captured"] == pytest.approx(0.0) and r["tokens_per_s"] == best_static for r in results)
    assert results[-1]["headroom_captured"] == pytest.approx(1.0)


def test_rows_must_have_the_columns():
    with pytest.raises(ValueError, match="lack the columns"):
        OracleRows({"label": torch.zeros(3).numpy()})


def _affine_table(overhead=0.5, base=8.0, per_token=0.7, draft=0.9, feed=0.0) -> CostTable:
    """A table that is affine at one slot: the target ``base + per_token * (t - 1)``, a draft depth ``draft``,
    the drafter's catch-up ``feed`` whatever its tokens."""
    slots, tokens = [1, 2, 4], [1, 2, 3, 5, 9]
    return CostTable({}, slots, tokens, [[R * (base + per_token * (t - 1)) for t in tokens] for R in slots],
                     [draft * R for R in slots], [[feed] * len(tokens) for _ in slots], [overhead] * len(slots))


def test_replay_prices_a_step_by_the_tables_formula_at_one_slot():
    tab = _affine_table(feed=0.3)
    assert step_seconds(tab, 0, 0) == pytest.approx((0.5 + 8.0) / 1e3)  # plain decoding: no drafter forward
    assert step_seconds(tab, 3, 2) == pytest.approx((0.5 + 8.0 + 3 * 0.7 + 0.3 + 3 * 0.9) / 1e3)
    assert step_seconds(tab, 3, 2) == pytest.approx(tab.step_ms(1, [1, 1, 1], 4, 3) / 1e3)
    record = costs_record(tab)
    assert record["source"] == "cost_table" and record["slots"] == 1
    assert record["step_ms"] == pytest.approx(8.5) and record["draft_ms"] == pytest.approx(0.9)


def test_replay_priced_by_the_cost_table_counts_the_same_and_matches_its_linear_table(setup):
    """Replay reads the load-aware policies' cost table at one slot: the counts do not depend on the price, and
    a table that is affine at one slot (no catch-up cost) prices exactly as the linear table with its terms."""
    _, _, rows = setup
    table = _affine_table()
    linear = CostTable.linear(0.5 + 8.0, 0.7 + 0.9)
    for make in (lambda: StaticPolicy(3), lambda: StaticPolicy(0), lambda: DDDPolicy(-3.0, 5)):
        a, b = replay(rows, make(), table), replay(rows, make(), linear)
        assert (a.steps, a.drafted, a.accepted, a.new_tokens) == (b.steps, b.drafted, b.accepted, b.new_tokens)
        assert a.seconds == pytest.approx(b.seconds)
    results = tune(rows, table, {"static": (lambda p: StaticPolicy(**p), grid({"gamma": [1, 3]}))},
                   progress=False)
    # the page states which prices it used (describe_costs, from this record)
    assert (costs_record(table)["source"], costs_record(linear)["source"]) == ("cost_table", "linear")
    assert tuning_markdown(results, table, rows, "test").startswith("## Policy tuning by exact replay")  # renders


def test_replay_priced_by_the_step_cost_model_that_an_engine_starts_from_the_table(setup):
    """Tuning prices replayed steps by the engines' step-cost model: as an engine starts it from a table that is
    linear at one slot, it prices as the table does (its fit to the table's grid), and its record says so."""
    from eagle_backbone.step_cost import OnlineCostModel

    _, _, rows = setup
    linear = CostTable.linear(8.5, 1.6, 0.2)
    model = OnlineCostModel(linear)
    a, b = replay(rows, StaticPolicy(3), model), replay(rows, StaticPolicy(3), linear)
    assert (a.steps, a.drafted, a.accepted) == (b.steps, b.drafted, b.accepted)
    assert a.seconds == pytest.approx(b.seconds, rel=0.03)
    record = costs_record(model)
    assert record["source"] == "step_cost_model" and set(record["costs_ms"]) >= {"fixed", "per_token"}


def test_replay_checks_head_sizes_against_the_stored_rows(tmp_path):
    import numpy as np

    from ldlp.models.acceptance import AcceptanceHead, AcceptanceHeadConfig
    from eagle_backbone.cost import CostTable
    from ldlp.bench.harness.replay import OracleRows, replay
    from ldlp.policies.threshold import AcceptancePolicy, LDLPPolicy
    from ldlp.models.predictor import LDLP, LDLPConfig

    n, k, d = 6, 4, 8
    rows = OracleRows({"seq_id": np.zeros(n, int), "index": np.arange(n), "last_token": np.arange(n) % 5,
                       "label": np.ones(n, int), "remaining": np.arange(n)[::-1], "draft_top1_prob": np.full((n, k), .5),
                       "draft_entropy": np.ones((n, k)), "feature": np.zeros((n, d), np.float32),
                       "draft_state": np.zeros((n, k * d), np.float32)})
    AcceptanceHead(AcceptanceHeadConfig(hidden_size=d + 4, k_max=k)).save_pretrained(tmp_path / "acc")
    LDLP(LDLPConfig(input_dim=2 * (d + 4))).save_pretrained(tmp_path / "ldlp")
    costs = CostTable.linear(step_ms=1000.0, draft_ms=100.0)
    for policy, what in ((AcceptancePolicy(str(tmp_path / "acc"), max_gamma=k), f"hidden_size={d + 4}"),
                         (LDLPPolicy(str(tmp_path / "ldlp")), f"input_dim={2 * (d + 4)}")):
        with pytest.raises(ValueError, match=what):
            replay(rows, policy, costs, embed=lambda ids: torch.zeros(len(ids), d))


def test_a_chains_acceptance_by_depth_counts_the_steps_that_reached_each_draft():
    """Steps (drafted, kept): (3, 3), (3, 1), (3, 0), (2, 2) a chain cut by the budget, (0, 0) a prefill. Depth 1 is
    reached by the four drafting steps and kept by three; depth 2 by the three that kept their first draft; depth
    3 by the one of those that drafted three deep, and never by the budget-cut chain."""
    st = GenerationStats()
    for drafted, kept in ((3, 3), (3, 1), (3, 0), (2, 2), (0, 0)):
        st.record_step(drafted, kept)
    assert st.reached_and_kept(3) == ([4, 3, 1], [3, 2, 1])
    assert sum(st.reached_and_kept(3)[1]) == st.accepted_tokens
    assert st.reached_and_kept(2) == ([4, 3], [3, 2])  # deeper drafts than asked for are left out
