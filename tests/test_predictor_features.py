"""The learned draft-length policy: its features are computed alike in collection, replay and the engine (one code
path), its cost rule picks what brute force picks, and the predictor study runs end to end."""

import itertools
import json

import numpy as np
import pytest
import torch
from oracle_helpers import greedy_oracle, mimic_pair

from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.cost import CostTable
from eagle_backbone.decoder import SpeculativeDecoder
from eagle_backbone.sampling import confidence
from ldlp.bench.harness.replay import OracleRows, replay
from ldlp.models.features import GROUPS, feature_names, history_features
from ldlp.policies.learned import LearnedPolicy, expected_gain, gamma_by_cost, \
    step_seconds_table

PROMPTS = [[5, 9, 11, 3], [7, 7, 20], [30, 4, 12, 18, 9]]
BUDGET = 30
K_MAX = 8


@pytest.fixture(scope="module")
def setup():
    target, drafter = mimic_pair()
    out = [greedy_oracle(target, drafter, p, BUDGET, k_max=K_MAX) for p in PROMPTS]
    return target, drafter, [o[0] for o in out], OracleRows.from_sequences([o[1] for o in out], BUDGET)


def test_collected_target_stats_are_the_confidence_of_the_logits_behind_the_last_token(setup):
    target, _, responses, rows = setup
    prompt, response = PROMPTS[0], responses[0]
    seq = torch.tensor([prompt + response])
    logits, _ = target(seq, target.new_cache())
    n = len(prompt)
    first = rows.sequences[0]
    stored = rows.cols["target_stats"][first[0]: first[1]]
    expect = confidence(logits[0, n - 1: n - 1 + len(stored)]).numpy()
    np.testing.assert_allclose(stored, expect, rtol=1e-6, atol=1e-7)
    top1, margin, entropy = stored.T
    assert (margin >= 0).all() and (margin <= top1).all() and (entropy >= 0).all() and (top1 <= 1).all()


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_the_engine_and_replay_record_the_same_features(setup, gamma):
    """A static-γ walk visits the same positions in both; every feature group agrees at every step (the target's
    confidence from lm_head(f) in the engine and from the collector's logits in replay, the drafter's top-1 from
    the engine's distributions and the stored statistics, the history from the two walks)."""
    target, drafter, _, rows = setup
    in_engine, in_replay = [], []
    engine_policy = LearnedPolicy(max_gamma=K_MAX, groups=GROUPS, record=in_engine, fixed=gamma)
    decoder = SpeculativeDecoder(target, EagleCandidateGenerator(drafter, target), engine_policy)
    for p in PROMPTS:
        decoder.generate(p, BUDGET)
        in_engine.pop()  # the engine plans ahead after its last step too, for a step that never comes
    replay_policy = LearnedPolicy(max_gamma=K_MAX, groups=GROUPS, record=in_replay, fixed=gamma)
    replay(rows, replay_policy, CostTable.linear(10.0, 1.0), embed=target.embed, vocab_size=target.vocab_size)
    assert len(in_engine) == len(in_replay) >= 2 * len(PROMPTS)
    a, b = np.stack(in_engine), np.stack(in_replay)
    names = feature_names(GROUPS, target.hidden_size)
    for j in np.flatnonzero(~np.isclose(a, b, rtol=1e-5, atol=1e-6).all(0)):
        pytest.fail(f"feature {names[j]} differs: engine {a[:, j][:8]} replay {b[:, j][:8]}")
    prev = [names.index(f"prev_draft_top1_{m}") for m in (1, 2, 3)]
    assert (a[:, prev] > 0).sum(0).tolist() == [(a[:, prev[0]] > 0).sum()] * min(gamma, 3) + [0] * (3 - min(gamma, 3))


def test_history_features_from_the_host_lists_and_from_a_step_not_yet_read():
    h = history_features([[], [2, 4], [3, 1, 5]], [[], [4, 4], [3, 3, 6]])
    assert h[0].tolist() == [-1.0, -1.0, -1.0, -1.0, 0.0, 0.0]
    assert h[1, :3].tolist() == [4.0, 2.0, -1.0] and h[1, 4] == 1.0  # most recent first; the last kept all it drafted
    assert float(h[1, 3]) == pytest.approx(0.7 * 2 + 0.3 * 4) and float(h[1, 5]) == pytest.approx(np.log(3))
    assert h[2, 4] == 0.0  # drafted 6, kept 5
    # the same last step, still on the device (planning ahead): the same bits
    ahead = history_features([[2], [3, 1]], [[4], [3, 3]], torch.tensor([4, 5]), torch.tensor([4, 6]))
    assert torch.equal(ahead, h[1:])


def _synthetic():
    """Three kinds of position, each with its own chance to keep each further draft."""
    cont = np.array([[0.95, 0.9, 0.9, 0.85, 0.8], [0.6, 0.5, 0.4, 0.4, 0.3], [0.2, 0.1, 0.1, 0.1, 0.1]])
    survival = np.cumprod(cont, axis=1)
    weight = np.array([0.5, 0.3, 0.2])
    return survival, weight


def _ratio(survival, weight, seconds, gammas):
    """Expected tokens over expected seconds when kind j drafts gammas[j]."""
    tokens = time = 0.0
    for S, w, k in zip(survival, weight, gammas):
        S0 = np.r_[1.0, S]
        p_a = S0[: k + 1] - np.r_[S0[1: k + 1], 0.0]
        tokens += w * (1 + S[:k].sum())
        time += w * float(p_a @ seconds[k, : k + 1])
    return tokens / time


@pytest.mark.parametrize("step_ms, draft_ms, accepted_ms", [(12.0, 1.6, 0.0), (10.0, 4.0, 0.5), (5.0, 0.5, 1.0)])
def test_the_cost_rule_at_its_fixed_point_is_the_brute_force_optimum(step_ms, draft_ms, accepted_ms):
    survival, weight = _synthetic()
    K = survival.shape[1]
    seconds = step_seconds_table(CostTable.linear(step_ms, draft_ms, accepted_ms), K)
    best = max(itertools.product(range(K + 1), repeat=len(weight)),
               key=lambda g: _ratio(survival, weight, seconds, g))
    best_ratio = _ratio(survival, weight, seconds, best)
    token_s = seconds[0, 0]  # start anywhere (here: plain decoding's seconds per token); iterate to the fixed point
    for _ in range(10):
        gammas = [gamma_by_cost(S, seconds, token_s) for S in survival]
        token_s = 1.0 / _ratio(survival, weight, seconds, gammas)
    assert _ratio(survival, weight, seconds, gammas) == pytest.approx(best_ratio, rel=1e-12)
    assert tuple(gammas) == best
    # with costs linear in γ it is the per-token rule: draft token m while S_m × (a token's worth - the seconds
    # an accepted token adds) exceeds the seconds a drafted token costs
    ca, cd = accepted_ms / 1e3, draft_ms / 1e3
    assert [int((S * (token_s - ca) > cd).sum()) for S in survival] == list(gammas)
    assert len(set(gammas)) > 1  # the kinds get different lengths: the test is not trivial


def test_expected_gain_counts_tokens_and_seconds():
    seconds = step_seconds_table(CostTable.linear(10.0, 2.0, 0.0), 3)
    gain = expected_gain(np.array([1.0, 1.0, 0.0]), seconds, token_s=0.01)
    # a draft kept for sure: +1 token for 2 ms, i.e. +1 - 0.2; the third is never kept: -0.2
    np.testing.assert_allclose(gain, [1 - 1.0, 2 - 1.2, 3 - 1.4, 3 - 1.6])
    assert gamma_by_cost(np.array([1.0, 1.0, 0.0]), seconds, 0.01) == 2
    assert gamma_by_cost(np.array([1.0, 1.0, 0.0]), seconds, 0.01, max_gamma=1) == 1


class _BatchedLinear:
    """A step of R rows: 10 ms fixed, 1 ms a scored token, 1.5 ms a draft depth and 0.1 ms a row drafting at it."""

    def step_ms(self, R, depth_rows, scored, fed_per_row):
        return 10.0 + 1.0 * scored + sum(1.5 + 0.1 * a for a in depth_rows if a > 0)


def test_under_load_a_row_pays_its_share_of_the_pass_and_drafts_less():
    """At R rows a row's price is its share of a step in which every row drafts alike: the fixed cost is shared, a
    draft's marginal cost is not, so at each load's own fixed point (its best ratio of tokens to seconds) the rule
    drafts shorter."""
    costs, K = _BatchedLinear(), 6
    one, many = step_seconds_table(costs, K), step_seconds_table(costs, K, rows=16)
    for k in range(K + 1):
        assert one[k, 0] == pytest.approx((10.0 + (k + 1) + 1.6 * k) / 1e3)
        assert many[k, 0] == pytest.approx((10.0 + 16 * (k + 1) + k * (1.5 + 1.6)) / 16 / 1e3)
    S = 0.8 ** np.arange(1, K + 1)
    chosen = {}
    for rows, seconds in ((1, one), (16, many)):
        token_s = seconds[0, 0]
        for _ in range(20):  # Dinkelbach: a token's worth is the seconds per token the rule's own choice gives
            g = gamma_by_cost(S, seconds, token_s)
            p_a = np.append(-np.diff(np.r_[1.0, S[:g]]), S[g - 1] if g else 1.0)  # P(A = a), a = 0..g
            token_s = float(p_a @ seconds[g, : g + 1]) / (1 + S[:g].sum())
        chosen[rows] = g
    assert chosen[16] < chosen[1]


def test_the_batch_cap_is_the_best_depth_for_the_whole_step():
    """Every batch-wide cap G priced by the step's own costs (a drafter pass at each depth any row reaches, the
    verification of all scored tokens): the cap chosen is the brute-force best, and a lone deep row is cut."""
    from types import SimpleNamespace

    from ldlp.policies.learned import batch_cap

    rng = np.random.default_rng(1)
    R, K = 3, 5
    tables = SimpleNamespace(target=torch.tensor([10.0 + 0.8 * n for n in range(R * (K + 1) + 1)], dtype=torch.float64),
                             draft=torch.tensor([0.0] + [2.0 + 0.1 * a for a in range(1, R + 1)], dtype=torch.float64))
    for _ in range(20):
        S = torch.tensor(np.cumprod(rng.uniform(0.4, 0.98, (R, K)), axis=1))
        gammas = torch.tensor(rng.integers(0, K + 1, R))
        token_s = float(rng.uniform(0.002, 0.006))

        def value(G):
            g = [min(int(x), G) for x in gammas]
            tokens = sum(1 + float(S[b, :g[b]].sum()) for b in range(R))
            ms = 1.0 + float(tables.target[sum(x + 1 for x in g)]) + (0.5 if max(g) > 0 else 0.0)
            ms += sum(float(tables.draft[sum(x >= d for x in g)]) for d in range(1, K + 1) if sum(x >= d for x in g))
            return tokens - ms / 1e3 / token_s

        best = max(range(K + 1), key=lambda G: (value(G), -G))
        got = batch_cap(S, gammas, tables, 1.0, 0.5, token_s)
        assert got.tolist() == [min(int(x), best) for x in gammas]
    # one row wants 5 and the others 1: its four extra depths cost a pass each for little survival
    S = torch.tensor([[0.5, 0.3, 0.2, 0.1, 0.05]] * 3, dtype=torch.float64)
    assert batch_cap(S, torch.tensor([5, 1, 1]), tables, 1.0, 0.5, 0.004).tolist() == [1, 1, 1]
    # one depth for the step (gammas None): every row drafts the same, the best such depth by the same prices
    S = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5], [0.5, 0.3, 0.2, 0.1, 0.05], [0.8, 0.6, 0.4, 0.3, 0.2]],
                     dtype=torch.float64)
    got = batch_cap(S, None, tables, 1.0, 0.5, 0.004)
    assert len(set(got.tolist())) == 1
    assert got.tolist() == batch_cap(S, torch.tensor([5, 5, 5]), tables, 1.0, 0.5, 0.004).tolist()


def test_the_study_runs_resumes_and_refuses_other_settings(setup, tmp_path):
    from types import SimpleNamespace

    from hydra import compose, initialize_config_dir
    from conftest import REPO

    import eagle_backbone.paths  # noqa: F401
    from ldlp.bench.comparisons.predictors import run_predictor_study
    from ldlp.report.predictors import study_page
    from ldlp.training.step_predictor import fit_step_history, fit_step_ldlp
    from oracle_helpers import prompts, write_collection

    target, drafter, _, _ = setup
    oracle = write_collection(tmp_path / "oracle", target, drafter, prompts(12, seed=1), prompts(4, seed=2),
                              store_states=False)
    pair = SimpleNamespace(target=target, candidates=None)

    def cfg(*extra):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            return compose("study_predictors", overrides=[
                f"oracle_dir={oracle}", f"out_dir={tmp_path / 'study'}", "costs.linear.step_ms=10",
                "costs.linear.draft_ms=1.5", "K=6", "max_gamma=6", "behaviours=[1,3]", "learning_curve.sizes=[40]",
                "models=[constant,logistic,gbt,ldlp,gru]", "ablation.max_examples=60", "progress=false", *extra])

    def study(c):
        return study_page(run_predictor_study(c, pair, {"ldlp": fit_step_ldlp, "gru": fit_step_history}), str(oracle), tmp_path / "study")

    page = study(cfg())
    record = json.loads((tmp_path / "study" / "study.json").read_text())
    runs = record["runs"]
    assert {r["section"] for r in runs.values()} == {"models", "learning_curve", "ablation", "rules"}
    assert runs["models/constant"]["auc_mean"] == 0.5 and "decision_us" in runs["models/gbt"]
    # the features tell the mimic pair's long and short drafts apart
    assert min(runs[f"models/{m}"]["auc_mean"] for m in ("ldlp", "logistic", "gru")) > 0.5
    assert runs["learning_curve/40"]["train_examples"] < runs["models/gbt"]["train_examples"]
    for r in runs.values():
        assert 0 <= r["mae"] and 0 < r["vs_best_static"] and r["tau"] >= 1
    assert "## Feature ablation" in page and (tmp_path / "study" / "learning_curve.png").is_file()
    assert study(cfg()) == page  # everything done: the same page, from study.json
    with pytest.raises(ValueError, match="other settings .*behaviours"):
        study(cfg("behaviours=[2]"))


def test_replay_beside_a_head_to_head_prices_each_contender_by_each_table(setup, tmp_path):
    from conftest import step_ldlp

    from eagle_backbone.policy import StaticPolicy
    from ldlp.bench.comparisons.replay_beside import replay_beside_measured
    from ldlp.report.predictors import beside_markdown

    target, _, _, rows = setup
    h2h = {"reference": "static γ=3", "n_prompts": 3, "dataset": "mimic", "max_new_tokens": BUDGET,
           "rows": [{"contender": "static γ=3", "policy": "static", "setting": {"gamma": 3}, "vs_best_static": 1.0,
                     "tau": 3.0},
                    {"contender": "static γ=6", "policy": "static", "setting": {"gamma": 6}, "vs_best_static": 0.97,
                     "ci95": [0.95, 0.99], "tau": 4.0},
                    {"contender": "learned", "policy": "learned", "setting": {"max_gamma": 8}, "vs_best_static": 1.01,
                     "tau": 3.5},
                    {"contender": "oracle", "policy": "oracle", "setting": {"k_max": 8}, "vs_best_static": 1.3,
                     "tau": 5.0}]}
    costs = {"cheap drafts": CostTable.linear(10.0, 0.5), "dear drafts": CostTable.linear(10.0, 4.0)}
    learned = step_ldlp(target.hidden_size, tmp_path / "learned")
    out = replay_beside_measured(h2h, rows, costs, target.embed, target.vocab_size, learned)
    by = {e["contender"]: e for e in out}
    for label, table in costs.items():
        assert by["static γ=3"][f"{label}_ratio"] == 1.0
        six = replay(rows, StaticPolicy(6), table).tokens_per_s / replay(rows, StaticPolicy(3), table).tokens_per_s
        assert by["static γ=6"][f"{label}_ratio"] == pytest.approx(six)
        assert by["oracle"][f"{label}_ratio"] >= max(1.0, six)  # the oracle bounds every static γ
    # dearer drafts make the long static γ worse against the short one
    assert by["static γ=6"]["dear drafts_ratio"] < by["static γ=6"]["cheap drafts_ratio"]
    assert "learned" in by and by["learned"]["tau_replay"] >= 1
    page = beside_markdown(out, list(costs), h2h, "here")
    assert "| static γ=6 | 0.970 | 0.950 – 0.990 |" in page


def test_the_main_command_times_the_shipped_policy_only_where_its_predictor_fits(tmp_path):
    from conftest import step_ldlp

    from ldlp.pipeline.contenders import shipped_unfit

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 32}))
    assert shipped_unfit("learned", step_ldlp(32, tmp_path / "fits"), target) is None
    assert "size 16, this target's are 32" in shipped_unfit("learned", step_ldlp(16, tmp_path / "other"), target)
    assert "no predictor" in shipped_unfit("learned", tmp_path / "missing", target)
    assert "not a local file" in shipped_unfit("learned", tmp_path / "fits", "lmsys/vicuna-7b-v1.3")
    assert shipped_unfit("acceptance", tmp_path / "missing", target) is None  # only learned reads a shipped predictor
    # the shipped predictor fits the shipped pair
    from eagle_backbone.paths import REPO_ROOT

    assert shipped_unfit("learned", REPO_ROOT / "data/embedded/predictor", REPO_ROOT / "data/embedded/target") is None


def test_the_step_history_model_reads_each_walk_alone_and_streams_as_it_scores():
    import torch

    from ldlp.models.step_history import StepHistoryConfig, StepHistoryGRU, StreamingHistory, gather, windows

    stream = np.array([4, 4, 4, 9, 9, 2])
    np.testing.assert_array_equal(windows(stream, 3), [[-1, -1, 0], [-1, 0, 1], [0, 1, 2], [-1, -1, 3], [-1, 3, 4],
                                                       [-1, -1, 5]])
    torch.manual_seed(0)
    model = StepHistoryGRU(StepHistoryConfig(input_dim=4, k_max=5, window=3)).eval()
    x = torch.randn(6, 4)
    x[[0, 3, 5], 0] = 0.0  # column 0 plays "steps": 0 where a walk starts
    x[[1, 2, 4], 0] = 1.0
    S = model.survival_tensor(*gather(x, torch.as_tensor(windows(stream, 3)))).detach().numpy()
    assert (np.diff(S, axis=1) <= 1e-7).all() and ((0 < S) & (S < 1)).all()  # a survival curve
    streaming = StreamingHistory(model, steps_col=0)
    np.testing.assert_allclose(np.concatenate([streaming.survival(x[i:i + 1].numpy()) for i in range(6)]), S,
                               rtol=1e-5, atol=1e-6)
    # the first step of a walk sees nothing of the walk before it
    alone = model.survival_tensor(*gather(x, torch.tensor([[-1, -1, 3]]))).detach().numpy()
    np.testing.assert_allclose(S[3], alone[0], rtol=1e-6)


@pytest.mark.parametrize("groups", [("ef",), tuple(GROUPS)])
def test_the_one_row_cpu_decision_is_the_torch_rules(setup, groups):
    """At one row on a CPU the policy decides in numpy (cheaper right after a target forward); every γ of a walk
    equals the torch rule's on the same network and prices (and they vary: the test is not trivial)."""
    from ldlp.models.features import step_features
    from ldlp.models.predictor import LDLP, LDLPConfig
    from ldlp.models.features import GROUP_NAMES

    target, drafter, _, _ = setup
    torch.manual_seed(0)
    d = target.hidden_size
    width = 2 * d + sum(len(GROUP_NAMES[g]) for g in groups if g != "ef")
    ldlp = LDLP(LDLPConfig(input_dim=width, hidden_dim=32, k_max=K_MAX, head="distribution", inputs=list(groups)))
    with torch.no_grad():
        ldlp.output.weight.mul_(20.0)  # curves that differ from row to row
        ldlp.output.bias.add_(1.5)  # and reach past the first draft
    ldlp.eval()
    seconds = step_seconds_table(CostTable.linear(10.0, 1.5), K_MAX)

    class TorchRule(LearnedPolicy):
        def _one_row_cpu(self, rows, x=None):
            x = step_features(rows, self.groups)[0] if x is None else x
            table, terms = self._terms(K_MAX, x.device)
            S = self.predictor.survival_tensor(x[None])
            return int(gamma_by_cost(S, table, self.token_seconds(), self.max_gamma, terms)[0])

    runs = []
    for cls in (LearnedPolicy, TorchRule):
        policy = cls(predictor=ldlp, groups=groups, seconds=seconds, token_s=0.004, max_gamma=K_MAX)
        decoder = SpeculativeDecoder(target, EagleCandidateGenerator(drafter, target), policy)
        runs.append([decoder.generate(p, BUDGET).stats.draft_lengths for p in PROMPTS])
    assert runs[0] == runs[1]
    assert len({g for walk in runs[0] for g in walk}) >= 3


def test_replay_prices_a_deployed_learned_policy_by_its_own_table(setup, tmp_path):
    """policy=learned prices its choices by the engine's step costs; replay (scripts/tune_policies.py) has no engine,
    so it hands the policy the table that prices the replayed steps (it raised AttributeError on None before)."""
    from ldlp.models.predictor import LDLP, LDLPConfig

    target, _, _, rows = setup
    LDLP(LDLPConfig(input_dim=2 * target.hidden_size, k_max=K_MAX, head="distribution", inputs=["ef"])
         ).save_pretrained(tmp_path / "predictor")
    table = CostTable.linear(10.0, 1.0)
    policy = LearnedPolicy(str(tmp_path / "predictor"), max_gamma=K_MAX,
                           pricing={"cost_dir": str(tmp_path / "cost"), "model": "m"})
    result = replay(rows, policy, table, embed=target.embed, vocab_size=target.vocab_size)
    assert policy.pricing.costs is table and result.steps > 0
    np.testing.assert_allclose(policy.seconds(), step_seconds_table(table, K_MAX))
