"""The acceptance head: its examples, its fit and folding, its files, and the policy that reads it."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import one_line
from omegaconf import OmegaConf
from oracle_helpers import mimic_pair, partial_collection, prompts, write_collection

from eagle_backbone.kinds.draft_lm import DraftModelCandidateGenerator
from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.cost import CostTable
from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.policy import EngineView
from eagle_backbone.sampling import SamplingConfig
from eagle_backbone.decoder import SpeculativeDecoder, autoregressive_generate
from ldlp.models.acceptance import AcceptanceHead, AcceptanceHeadConfig, clip_log_p
from ldlp.bench.harness.replay import OracleRows, replay
from ldlp.policies.threshold import AcceptancePolicy
from ldlp.report.training import write_acceptance_head_metrics
from ldlp.training.acceptance import examples, load_rows, train_acceptance_head

K_MAX, BUDGET = 8, 36


@pytest.fixture(scope="module")
def trained(mimic, tmp_path_factory):
    target, drafter = mimic
    root = tmp_path_factory.mktemp("acceptance")
    oracle = write_collection(root / "oracle", target, drafter, prompts(14, seed=1), prompts(4, seed=2))
    cfg = OmegaConf.create({"oracle_dir": str(oracle), "out_dir": str(root / "head"), "C": 0.5, "seed": 0,
                            "val_fraction": 0.1, "max_examples": None})
    return oracle, root / "head", train_acceptance_head(cfg)


def test_examples_follow_the_labels_and_drop_what_the_response_cannot_tell():
    label = np.array([0, 3, 5])
    remaining = np.array([9, 9, 3])  # the last row's response ends 3 tokens later
    top1 = np.full((3, 4), 0.5)
    states = np.arange(3 * 4 * 2, dtype=np.float32).reshape(3, 4, 2)
    X, S, y, rows = examples(label, remaining, top1, states, k_max=4)
    # steps 1..3; row 2 gives steps 1 and 2 only (remaining >= m + 1)
    assert rows.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert y.tolist() == [False, True, True, False, True, True, False, False]  # label >= m + 1
    assert S[:, 2].tolist() == [1, 1, 1, 2, 2, 2, 3, 3]
    assert S[3, 1] == pytest.approx(2 * math.log(0.5)) and S[3, 0] == pytest.approx(math.log(0.5))
    assert np.array_equal(X[4], states[1, 1])  # row 1, step 2 reads the state behind draft 2


def test_folded_head_equals_the_sklearn_pipeline():
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 6)).astype(np.float32) * rng.uniform(0.1, 10, size=6).astype(np.float32)
    S = np.stack([rng.uniform(-5, 0, 400), rng.uniform(-20, 0, 400), rng.integers(1, 8, 400)], 1).astype(np.float32)
    y = (X[:, 0] / 5 + S[:, 0] + rng.normal(size=400)) > -2
    # the trainer's model: standardised inputs, then a logistic regression
    pipe = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=5000)).fit(np.concatenate([X, S], 1), y)
    head = AcceptanceHead.from_sklearn(pipe, AcceptanceHeadConfig(hidden_size=6, k_max=8))
    want = pipe.predict_proba(np.concatenate([X, S], 1))[:, 1]
    got = head(torch.from_numpy(X), torch.from_numpy(S)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)
    for r in range(5):  # the one-decision path of the drafting loop
        one = head.probability(torch.from_numpy(X[r]), float(S[r, 0]), float(S[r, 1]), int(S[r, 2]))
        assert one == pytest.approx(float(want[r]), abs=1e-5)


def test_training_writes_a_head_that_beats_the_drafter_probabilities(trained):
    _, out, metrics = trained
    head = AcceptanceHead.from_pretrained(out)
    assert head.config.hidden_size == 32 and head.config.k_max == K_MAX
    assert set(head.config.meta["made_for"]) == {"model", "dtype", "drafter_kind", "drafter_weights"}  # from the labels' manifest
    val = metrics["validation"]
    assert val["acceptance_head"]["examples"] == val["drafter_probabilities_only"]["examples"] > 50
    assert 0 < val["acceptance_head"]["positive_rate"] < 1
    # the head reads the probabilities too, so on the data it was chosen for it does not do worse
    assert val["acceptance_head"]["auc"] > 0.6
    assert json.loads((out / "metrics.json").read_text()) == json.loads(json.dumps(metrics))
    assert set(metrics["validation_auc_by_step"]) == set(range(1, K_MAX))  # every step but the last has a next one
    write_acceptance_head_metrics(out, metrics)  # what scripts/train_acceptance.py writes next to metrics.json
    assert (out / "metrics.md").read_text().startswith("## Acceptance head\n")  # renders, from the metrics above


def test_head_files_round_trip_and_bad_files_fail_clearly(trained, tmp_path):
    _, out, _ = trained
    head = AcceptanceHead.from_pretrained(out)
    again = AcceptanceHead.from_pretrained(head.save_pretrained(tmp_path / "copy"))
    assert torch.equal(head.state_weight, again.state_weight) and float(head.bias) == float(again.bias)
    with pytest.raises(ValueError, match="not an acceptance head"):
        AcceptanceHead.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "copy" / "config.json").write_text(json.dumps({"kind": "ldlp", "hidden_size": 32, "k_max": 8}))
    with pytest.raises(ValueError, match="kind='ldlp'"):
        AcceptanceHead.from_pretrained(tmp_path / "copy")
    (tmp_path / "copy" / "config.json").write_text(json.dumps({"kind": "acceptance_head", "hidden_size": 16, "k_max": 8}))
    with pytest.raises(ValueError, match="does not match"):
        AcceptanceHead.from_pretrained(tmp_path / "copy")


def test_training_without_states_names_the_setting(mimic, tmp_path):
    target, drafter = mimic
    oracle = write_collection(tmp_path / "bare", target, drafter, prompts(2), prompts(1, seed=3), store_states=False)
    with pytest.raises(ValueError, match="store_draft_states=true"):
        load_rows(oracle)


def test_policy_is_lossless_and_replays_exactly(mimic, trained):
    target, drafter = mimic
    oracle, head_dir, _ = trained
    cand = EagleCandidateGenerator(drafter, target)
    test_prompts = prompts(4, seed=2)  # the validation prompts of the collection
    for threshold, cap in ((0.3, 8), (0.6, 5), (0.05, 8)):
        policy = AcceptancePolicy(str(head_dir), threshold, cap)
        stats = []
        for p in test_prompts:
            out = SpeculativeDecoder(target, cand, policy).generate(p, BUDGET)
            assert out.tokens == autoregressive_generate(target, p, BUDGET).tokens
            stats.append(out.stats)
        rows = OracleRows.load(oracle, "validation")
        res = replay(rows, AcceptancePolicy(str(head_dir), threshold, cap), CostTable.linear(10.0, 1.0),
                     vocab_size=target.vocab_size)
        assert res.drafted == sum(s.drafted_tokens for s in stats), threshold
        assert res.accepted == sum(s.accepted_tokens for s in stats)
        assert res.steps == sum(s.target_forwards - 1 for s in stats)
        # batch 1 decides on host floats (_one_row_cpu), four rows on tensors: the same draft lengths
        engine = BatchedSpeculativeEngine(target, drafter, "eagle", slots=4, policy=AcceptancePolicy(str(head_dir),
                                                                                                    threshold, cap))
        batched = engine.generate(test_prompts, BUDGET)
        assert [o.stats.draft_lengths for o in batched] == [s.draft_lengths for s in stats], threshold
    lengths = [n for s in stats for n in s.draft_lengths]
    assert len(set(lengths)) > 1  # the head stopped drafts at different depths


def test_policy_needs_a_drafter_state(mimic, trained):
    target, _ = mimic
    _, head_dir, _ = trained
    from conftest import make_target

    draft_lm = make_target(seed=5, layers=1).model
    with pytest.raises(ValueError, match="DraftModelCandidateGenerator offers none"):  # when the decoder is built
        SpeculativeDecoder(target, DraftModelCandidateGenerator(draft_lm, target), AcceptancePolicy(str(head_dir)))
    with pytest.raises(ValueError, match="threshold"):
        AcceptancePolicy(str(head_dir), threshold=1.5)
    with pytest.raises(ValueError, match="train_acceptance"):
        AcceptancePolicy("/nonexistent/head")


def test_clip_log_p_matches_the_examples():
    top1 = np.array([[0.5, 1e-9, 1.0]])
    _, S, _, _ = examples(np.array([3]), np.array([9]), top1, np.zeros((1, 3, 1), np.float32), k_max=3)
    assert S[0, 0] == pytest.approx(clip_log_p(0.5)) and S[1, 0] == pytest.approx(clip_log_p(1e-9))


# -- training refuses an incomplete oracle collection unless allow_partial=true


def test_acceptance_training_refuses_an_incomplete_collection(tmp_path):
    from omegaconf import OmegaConf

    from ldlp.training.acceptance import train_acceptance_head

    oracle = partial_collection(tmp_path, planned=13)
    cfg = OmegaConf.create({"oracle_dir": str(oracle), "out_dir": str(tmp_path / "head"), "C": 0.5, "seed": 0,
                            "val_fraction": 0.1, "max_examples": None, "allow_partial": False})
    with pytest.raises(ValueError) as e:
        train_acceptance_head(cfg)
    msg = one_line(e)
    assert "5 of 13 sequences are missing" in msg and f"python scripts/collect_oracle.py out_dir={oracle}" in msg
    assert "num_shards=2" in msg and "allow_partial=true" in msg
    assert not (tmp_path / "head").exists()
    cfg.allow_partial = True
    train_acceptance_head(cfg)
    meta = json.loads((tmp_path / "head" / "config.json").read_text())["meta"]
    assert meta["allow_partial"] is True and meta["oracle_collection"]["missing_sequences"] == 5
    from ldlp.models.acceptance import AcceptanceHead

    assert AcceptanceHead.from_pretrained(tmp_path / "head").config.meta["allow_partial"] is True


def test_a_complete_collection_trains_without_the_override(tmp_path):
    from ldlp.labels.store import require_complete

    status = require_complete(partial_collection(tmp_path, planned=8, num_shards=1))
    assert status["complete"] is True and status["missing_sequences"] == 0 and status["allow_partial"] is False


def test_a_head_refuses_another_kinds_drafter_states(mimic, trained, tmp_path):
    """A head records the drafter kind whose states it learned (from its labels' manifest, when it has one); a
    pair whose drafter is of another kind, with states of the same width, is refused in one line."""
    import json
    import shutil
    from types import SimpleNamespace

    from conftest import one_line

    target, drafter = mimic
    _, head_dir, _ = trained
    other = tmp_path / "head"
    shutil.copytree(head_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["meta"] = {**cfg.get("meta", {}), "drafter_kind": "eagle3"}
    (other / "config.json").write_text(json.dumps(cfg))
    eagle = SimpleNamespace(kind="eagle", drafter=SimpleNamespace(hidden_size=target.hidden_size))
    view = EngineView(target, eagle, SamplingConfig(), torch.device("cpu"))
    AcceptancePolicy(str(head_dir)).bind(view)  # its own kind (or no record): taken
    with pytest.raises(ValueError, match="trained on eagle3 drafter states and this pair's drafter is eagle") as e:
        AcceptancePolicy(str(other)).bind(view)
    one_line(e)
    # accept_mismatch=true: taken, and the message recorded for the run's results
    from eagle_backbone.errors import accept_mismatches, accepted_mismatches

    accept_mismatches(True)
    try:
        AcceptancePolicy(str(other)).bind(view)
        assert [m.split(":")[0] for m in accepted_mismatches()] == ["acceptance policy"]
    finally:
        accept_mismatches(False)
