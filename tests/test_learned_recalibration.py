"""The learned policy's online hazard recalibration (ldlp/policies/learned.py, ``recalibrate=true``): it learns the
correction the outcomes call for, pairs each observation with the plan that decided it (also when the policy has
already planned the next step), and in the engine it stays lossless and decides alike on its one-row and batched
paths. No clock is read."""

import numpy as np
import pytest
import torch

from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.cost import CostTable
from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.decoder import SpeculativeDecoder, autoregressive_generate
from ldlp.bench.harness.workload import run_workload
from ldlp.models.predictor import LDLP, LDLPConfig
from ldlp.policies.learned import HazardCalibration, LearnedPolicy, step_seconds_table

K = 6


def drive(cal: HazardCalibration, true_rate, steps: int, seed: int = 0) -> None:
    """``steps`` plans and outcomes: each plan's hazard logits random; drafts of depth K kept while a draw falls
    under ``true_rate(z_m)``."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        z = rng.normal(1.0, 1.5, K)
        cal.planned(0, z)
        kept = 0
        while kept < K and rng.random() < true_rate(z[kept]):
            kept += 1
        cal.observed(0, K, kept)


def test_a_head_without_information_is_flattened_to_the_running_rate():
    cal = HazardCalibration()
    drive(cal, lambda z: 0.6, 3000)
    w, c = cal.wc
    assert w < 0.15  # the logits say nothing: their weight falls towards 0
    rate = 1 / (1 + np.exp(-(w * 1.0 + c)))
    assert abs(rate - 0.6) < 0.05


def test_a_calibrated_head_keeps_its_logits():
    cal = HazardCalibration()
    drive(cal, lambda z: 1 / (1 + np.exp(-z)), 3000)
    w, c = cal.wc
    assert abs(w - 1.0) < 0.15 and abs(c) < 0.2


def test_an_observation_is_paired_with_the_plan_that_decided_it():
    """Planning ahead, step t+1's plan is queued before step t is observed: the outcome must meet step t's logits."""
    cal = HazardCalibration(update_every=1_000_000)
    first, second = np.full(K, 3.0), np.full(K, -3.0)
    cal.planned(4, first)
    cal.planned(4, second)  # the next step, planned ahead
    cal.observed(4, 2, 1)  # drafted 2, kept 1: depth 1 kept, depth 2 rejected
    from scipy.special import expit

    p = float(expit(3.0))  # the first plan's hazards, as probabilities
    assert cal.fit.queued == ([p, p], [1.0, 0.0])
    cal.reset(4)  # a new sequence in the slot forgets the old plans
    cal.observed(4, 2, 2)
    assert cal.fit.queued == ([p, p], [1.0, 0.0])


def test_recalibrate_takes_only_a_boolean():
    with pytest.raises(ValueError, match="recalibrate must be true, false or null"):
        LearnedPolicy(predictor=object(), recalibrate="maybe")


PROMPTS = [[5, 9, 11, 3], [7, 7, 20], [30, 4, 12, 18, 9], [2, 8, 1]]


def policy_of(ldlp):
    seconds = step_seconds_table(CostTable.linear(10.0, 1.5), 8)
    policy = LearnedPolicy(predictor=ldlp, groups=("ef",), seconds=seconds, token_s=0.004, recalibrate=True)
    policy.calibration.update_every = 8
    return policy


def test_recalibrated_decoding_is_lossless_and_learns(pair_and_ldlp):
    """Batch 1 (the one-row numpy path) and four rows at once (the torch path): the target's own greedy outputs,
    and the correction moved, so later decisions read corrected curves."""
    target, drafter, ldlp = pair_and_ldlp
    ref = [autoregressive_generate(target, p, 40).tokens for p in PROMPTS]
    one = policy_of(ldlp)
    decoder = SpeculativeDecoder(target, EagleCandidateGenerator(drafter, target), one)
    assert [decoder.generate(p, 40).tokens for p in PROMPTS] == ref
    many = policy_of(ldlp)
    engine = BatchedSpeculativeEngine(target, drafter, "eagle", slots=4, policy=many)
    assert [o.tokens for o in run_workload(engine, PROMPTS, 4, 40).outputs] == ref
    for policy in (one, many):
        assert policy.calibration.state()["observations"] > 0
        assert policy.calibration.wc != (1.0, 0.0)
        report = policy.report()["recalibration"]  # what the result files keep
        assert (report["w"], report["c"]) == policy.calibration.wc and report["outcomes"] > 0


def test_null_recalibrates_only_a_sampling_engine(pair_and_ldlp):
    """The predictor's labels are greedy: by default it corrects its hazards only where the engine samples."""
    from eagle_backbone.sampling import SamplingConfig

    target, drafter, ldlp = pair_and_ldlp
    seconds = step_seconds_table(CostTable.linear(10.0, 1.5), 8)
    for sampling, on in ((None, False), (SamplingConfig(temperature=1.0), True)):
        policy = LearnedPolicy(predictor=ldlp, groups=("ef",), seconds=seconds, token_s=0.004)
        engine = BatchedSpeculativeEngine(target, drafter, "eagle", slots=2, policy=policy, sampling=sampling)
        run_workload(engine, PROMPTS[:2], 2, 12)
        assert (policy.calibration is not None) == on
        if on:
            assert policy.calibration.outcomes > 0


def test_the_load_sweep_carries_one_correction_per_contender_across_its_runs(t32, eagle32):
    """A benchmark builds a policy per run; a server keeps its policy: the sweep hands each new learned policy the
    correction the earlier runs fitted, so the runs' reports count ever more outcomes (at T = 1, where null
    recalibrates)."""
    from ldlp.bench.comparisons.load_sweep import Contender, sweep

    torch.manual_seed(0)
    d = t32.hidden_size
    ldlp = LDLP(LDLPConfig(input_dim=2 * d, hidden_dim=16, k_max=8, head="distribution", inputs=["ef"])).eval()
    seconds = step_seconds_table(CostTable.linear(10.0, 1.5), 8)
    made = []

    def make():
        made.append(LearnedPolicy(predictor=ldlp, groups=("ef",), seconds=seconds, token_s=0.004))
        return made[-1]

    result = sweep(t32, EagleCandidateGenerator(eagle32, t32), [[5, 9, 11, 3], [7, 7, 20], [30, 4, 12], [2, 8, 1]],
                   [Contender("ar", "ar", 0, None), Contender("learned", "learned", None, make)], [1, 2], 10,
                   rounds=2, blocks=1, log=lambda m: None, bootstrap=20, temperatures=[1.0])
    runs = [r for r in result["runs"] if r["contender"] == "learned"]
    seen = [r["policy_report"]["recalibration"]["outcomes"] for r in runs]
    assert len(runs) == 4 and seen == sorted(seen) and seen[0] < seen[-1]
    assert len({id(p.calibration) for p in made[-4:]}) == 1
