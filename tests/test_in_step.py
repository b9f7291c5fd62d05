"""The learned policy revised while drafting (ldlp/policies/in_step.py, ``policy=learned_in_step``): its online fit
recovers the weight of the drafter's evidence, it decides as the learned policy when the evidence weighs nothing,
its one-row host path and its batched device path decide alike, it stays lossless and learns in the engine, and its
starting weights are read or refused in one line. No clock is read."""

import json

import numpy as np
import pytest
import torch
from scipy.special import expit

from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.cost import CostTable
from eagle_backbone.decoder import SpeculativeDecoder, autoregressive_generate
from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from ldlp.bench.harness.workload import run_workload
from ldlp.models.calibration import OnlineLogitCalibration
from ldlp.policies.in_step import IN_STEP_FILE, InStepPolicy, read_start
from ldlp.policies.learned import LearnedPolicy, step_seconds_table
from ldlp.training.in_step import depth_events

PROMPTS = [[5, 9, 11, 3], [7, 7, 20], [30, 4, 12, 18, 9], [2, 8, 1]]
SECONDS = step_seconds_table(CostTable.linear(10.0, 1.5), 8)
FROZEN = {"prior": [1.0, 0.0], "drafted": [1.0, 0.0, 0.0]}  # the predictor as it is, no weight on the drafter


def in_step(ldlp, **kw):
    return InStepPolicy(predictor=ldlp, groups=("ef",), seconds=SECONDS, token_s=0.004, **kw)


def test_the_online_fit_recovers_the_weight_of_the_evidence():
    rng = np.random.default_rng(0)
    fit = OnlineLogitCalibration(decay=1.0, prior=1.0, evidence=1)
    for _ in range(200):
        z, e = rng.normal(1.0, 1.5, 64), rng.normal(0.0, 2.0, 64)
        kept = (rng.random(64) < expit(0.5 * z + 0.2 + 1.0 * e)).astype(float)
        fit.add(expit(z).tolist(), kept.tolist(), 64, torch.float64, evidence=e[:, None].tolist())
    w, c, v = fit.params.tolist()
    assert abs(w - 0.5) < 0.05 and abs(c - 0.2) < 0.1 and abs(v - 1.0) < 0.05
    with pytest.raises(ValueError, match="start needs 3 values"):
        OnlineLogitCalibration(evidence=1, start=[1.0, 0.0])


def test_without_evidence_or_correction_it_drafts_as_the_learned_policy(pair_and_ldlp):
    """Frozen at the predictor as it is (no update ever), the revised curve is the planned one: the step drafts on
    exactly to the learned policy's γ, so every sequence drafts and keeps the same counts."""
    target, drafter, ldlp = pair_and_ldlp
    counts = []
    for policy in (LearnedPolicy(predictor=ldlp, groups=("ef",), seconds=SECONDS, token_s=0.004, recalibrate=False),
                   in_step(ldlp, start=FROZEN, update_every=10 ** 9)):
        dec = SpeculativeDecoder(target, EagleCandidateGenerator(drafter, target), policy)
        counts.append([(r.stats.drafted_tokens, r.stats.accepted_tokens) for r in (dec.generate(p, 40) for p in PROMPTS)])
    assert counts[0] == counts[1]
    assert sum(d for d, _ in counts[0]) > 0


def test_the_host_and_device_paths_decide_alike_and_stay_lossless(pair_and_ldlp):
    """Batch 1 (numpy on host floats) and four rows at once (torch, by engine slot, planned ahead): with the weights
    held, every sequence drafts the same; with them learning, both give the target's own greedy outputs and move
    their fits."""
    target, drafter, ldlp = pair_and_ldlp
    ref = [autoregressive_generate(target, p, 40).tokens for p in PROMPTS]
    start = {"prior": [0.7, 0.3], "drafted": [0.6, 0.2, 0.8]}
    held = {}
    for slots in (1, 4):
        policy = in_step(ldlp, start=start, update_every=10 ** 9)
        engine = BatchedSpeculativeEngine(target, drafter, "eagle", slots=slots, policy=policy)
        out = run_workload(engine, PROMPTS, slots, 40).outputs
        assert [o.tokens for o in out] == ref
        held[slots] = [(o.stats.drafted_tokens, o.stats.accepted_tokens) for o in out]
    assert held[1] == held[4]
    for slots in (1, 4):
        policy = in_step(ldlp, start=start, update_every=8)
        engine = BatchedSpeculativeEngine(target, drafter, "eagle", slots=slots, policy=policy)
        assert [o.tokens for o in run_workload(engine, PROMPTS, slots, 40).outputs] == ref
        report = policy.report()
        assert report["drafted"]["observations"] > 0 and report["recalibration"]["outcomes"] > 0
        assert policy.drafted_wc != tuple(start["drafted"]) and policy.calibration.wc != tuple(start["prior"])


def test_depth_events_count_every_reached_depth():
    """A chain reaches depth m when the first m − 1 drafts were kept: label a gives min(a + 1, K) events, the
    first a kept."""
    K = 4
    labels = np.array([0, 2, 4, 9])
    z = np.arange(len(labels) * K, dtype=float).reshape(len(labels), K)
    q = np.full((len(labels), 6), 0.5)
    X, y, g = depth_events(z, q, labels, np.arange(len(labels)))
    assert len(y) == 1 + 3 + 4 + 4 and int(y.sum()) == 0 + 2 + 4 + 4
    assert np.allclose(X[:, 1], 0.0)  # logit of 1/2
    assert sorted(X[g == 1, 0].tolist()) == [4.0, 5.0, 6.0]  # row 1 reached depths 1-3


def test_starting_weights_are_read_or_refused_in_one_line(tmp_path):
    assert read_start(tmp_path) is None  # none there: the predictor as it is
    (tmp_path / IN_STEP_FILE).write_text(json.dumps({"prior": [0.5, 0.4], "drafted": [0.5, 0.8, 0.3], "scores": {}}))
    assert read_start(tmp_path) == {"prior": [0.5, 0.4], "drafted": [0.5, 0.8, 0.3]}
    (tmp_path / IN_STEP_FILE).write_text(json.dumps({"prior": [0.5, 0.4]}))
    with pytest.raises(ValueError, match=r"in_step.json is not an in-step start \(KeyError"):
        read_start(tmp_path)
    (tmp_path / IN_STEP_FILE).write_text(json.dumps({"prior": [0.5], "drafted": [0.5, 0.8, 0.3]}))
    with pytest.raises(ValueError, match="prior needs 2 values"):
        read_start(tmp_path)
