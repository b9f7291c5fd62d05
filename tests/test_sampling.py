"""Speculative sampling is exact: the output distribution equals the target's, with a draft LM and with the EAGLE
drafter under static and adaptive policies (the per-sequence path included); seeded streams repeat."""

import pytest
import torch
from conftest import chi2_pvalue, exact_sequence_distribution, make_drafter, make_target

from eagle_backbone import sampling as S
from eagle_backbone.kinds.draft_lm import DraftModelCandidateGenerator
from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.decoder import SpeculativeDecoder
from eagle_backbone.policy import DraftPolicy, StaticPolicy
from eagle_backbone.sampling import SamplingConfig


def _dist(values):
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


CASES = {
    "random": (torch.rand(50, generator=torch.Generator().manual_seed(0)).double(),
               torch.rand(50, generator=torch.Generator().manual_seed(1)).double()),
    "disjoint_support": (_dist([0.5, 0.5, 0, 0]), _dist([0, 0, 0.3, 0.7])),
    "q_zero_where_p_positive": (_dist([0.2, 0.3, 0.5, 0]), _dist([0, 0.5, 0.5, 0])),
    "identical": (_dist([0.1, 0.2, 0.7]), _dist([0.1, 0.2, 0.7])),
    "point_masses": (_dist([1, 0, 0]), _dist([0, 1, 0])),
}


@pytest.mark.parametrize("case", CASES)
def test_accept_resample_step_is_exact(case):
    p, q = CASES[case]
    p, q = p / p.sum(), q / q.sum()
    out = S.one_step_output_distribution(p, q)
    assert torch.allclose(out, p, atol=1e-6), (out, p)


def test_probs_from_logits_filters_alike():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    assert torch.equal(S.probs_from_logits(logits, SamplingConfig(1.0, top_k=2)) > 0,
                       torch.tensor([True, True, False, False, False]))
    probs = S.probs_from_logits(logits, SamplingConfig(1.0, top_p=0.7))
    assert (probs > 0).sum() == 2 and abs(float(probs.sum()) - 1) < 1e-6
    assert torch.allclose(S.probs_from_logits(logits, SamplingConfig(2.0)), torch.softmax(logits / 2, -1))


def _speculative_counts(target, draft, prompt, length, cfg, n):
    dec = SpeculativeDecoder(target, DraftModelCandidateGenerator(draft.model, target), StaticPolicy(2))
    counts = {}
    for seed in range(n):
        seq = tuple(dec.generate(prompt, length, cfg, seed=seed).tokens)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def test_sampled_sequences_follow_the_target(tiny_vocab_pair):
    target, draft = tiny_vocab_pair
    cfg, prompt, n = SamplingConfig(temperature=1.0), [1, 3], 1200
    probs = exact_sequence_distribution(target, prompt, 3, cfg)
    assert abs(sum(probs.values()) - 1) < 1e-6
    assert chi2_pvalue(_speculative_counts(target, draft, prompt, 3, cfg, n), probs, n) > 1e-3


def test_a_broken_residual_is_detected(tiny_vocab_pair, monkeypatch):
    """The statistical test has power: resampling from p instead of max(p - q, 0) fails it."""
    target, draft = tiny_vocab_pair
    cfg, prompt, n = SamplingConfig(temperature=1.0), [1, 3], 1200
    probs = exact_sequence_distribution(target, prompt, 3, cfg)
    monkeypatch.setattr(S, "residual", lambda p, q: p)
    assert chi2_pvalue(_speculative_counts(target, draft, prompt, 3, cfg, n), probs, n) < 1e-6


def test_top_k_top_p_sampling_is_lossless_too(tiny_vocab_pair):
    target, draft = tiny_vocab_pair
    cfg, prompt, n = SamplingConfig(temperature=0.8, top_k=3, top_p=0.9), [2], 1500
    probs = exact_sequence_distribution(target, prompt, 2, cfg)
    assert chi2_pvalue(_speculative_counts(target, draft, prompt, 2, cfg, n), probs, n) > 1e-3


# -- the EAGLE drafter and adaptive policies sample the target's distribution too


class RandomGamma(DraftPolicy):
    """γ drawn at random every step for each row, from the row's own generator (seeded when its prompt enters),
    not the sampler's: a plan that no acceptance statistic drives."""

    name = "random_gamma"

    def __init__(self, max_gamma=4, seed=0):
        self.seed, self.max_gamma, self.rng = seed, max_gamma, {}

    def begin(self, slot, prompt_ids, max_new_tokens=None):
        self.rng[slot] = torch.Generator().manual_seed(self.seed)

    def plan(self, rows):
        return [int(torch.randint(0, self.max_gamma + 1, (1,), generator=self.rng[b])) for b in rows.slots]


@pytest.fixture(scope="module")
def tiny_eagle_pair(tmp_path_factory):
    target = make_target(seed=11, vocab=4, d=16, layers=1, eos=None)
    target.eos_token_ids = set()
    drafter = make_drafter(target, seed=5)
    with torch.no_grad():  # a poor drafter: many rejections, so the residual matters (the power check's point)
        drafter.fc.weight.mul_(3.0)
    from ldlp.models.predictor import LDLP, LDLPConfig

    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp("ldlp") / "ldlp"
    LDLP(LDLPConfig(input_dim=32, hidden_dim=8, k_max=4)).save_pretrained(folder)
    return target, drafter, folder


def _policy(kind, ldlp_folder):
    from ldlp.policies.threshold import ConfidencePolicy, LDLPPolicy

    if kind == "static":
        return StaticPolicy(2)
    if kind == "random":
        return RandomGamma()
    if kind == "threshold":
        return ConfidencePolicy(threshold=0.4, max_gamma=4)
    return LDLPPolicy(str(ldlp_folder), max_gamma=4, offset=1)


def _eagle_counts(target, drafter, policy, prompt, length, cfg, n):
    dec = SpeculativeDecoder(target, EagleCandidateGenerator(drafter, target), policy)
    counts = {}
    for seed in range(n):
        seq = tuple(dec.generate(prompt, length, cfg, seed=seed).tokens)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("kind", ["static", "random", "threshold", "ldlp"])
def test_eagle_and_adaptive_policies_sample_the_target_distribution(tiny_eagle_pair, kind, temperature):
    target, drafter, folder = tiny_eagle_pair
    cfg, prompt, n = SamplingConfig(temperature=temperature), [1, 3], 1500  # seeded: the p-values are fixed
    probs = exact_sequence_distribution(target, prompt, 3, cfg)
    counts = _eagle_counts(target, drafter, _policy(kind, folder), prompt, 3, cfg, n)
    assert chi2_pvalue(counts, probs, n) > 1e-3


@pytest.mark.parametrize("kind", ["random", "ldlp"])
def test_a_broken_residual_is_detected_with_eagle_and_adaptive_policies(tiny_eagle_pair, monkeypatch, kind):
    """The test above has power: with the same samples' size and seeds, resampling from p instead of
    max(p - q, 0) gives p-values far below its acceptance level of 1e-3."""
    target, drafter, folder = tiny_eagle_pair
    cfg, prompt, n = SamplingConfig(temperature=0.7), [1, 3], 1500
    probs = exact_sequence_distribution(target, prompt, 3, cfg)
    monkeypatch.setattr(S, "residual", lambda p, q: p)
    assert chi2_pvalue(_eagle_counts(target, drafter, _policy(kind, folder), prompt, 3, cfg, n), probs, n) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_sampling_on_the_targets_device(tiny_eagle_pair):
    """On a GPU the random stream lives on the target's device: a seed gives the same output every time,
    and the sampled sequences still follow the target's distribution."""
    import copy

    from eagle_backbone.decoder import autoregressive_generate

    cpu_target, cpu_drafter, folder = tiny_eagle_pair
    target, drafter = copy.deepcopy(cpu_target).to("cuda"), copy.deepcopy(cpu_drafter).to("cuda")
    cfg, prompt, n = SamplingConfig(temperature=1.0), [1, 3], 600
    probs = exact_sequence_distribution(cpu_target, prompt, 3, cfg)  # the same weights, enumerated on the CPU
    for kind in ("static", "ldlp"):
        policy = _policy(kind, folder)
        if kind == "ldlp":
            policy.model = policy.model.to("cuda")
        counts = _eagle_counts(target, drafter, policy, prompt, 3, cfg, n)
        again = _eagle_counts(target, drafter, _policy(kind, folder) if kind == "static" else policy, prompt, 3, cfg, n)
        assert counts == again  # seeded: the same outputs
        assert chi2_pvalue(counts, probs, n) > 1e-3
    runs = [autoregressive_generate(target, prompt, 8, cfg, seed=s).tokens for s in (0, 0, 1)]
    assert runs[0] == runs[1]


def test_seeded_streams_are_reproducible_and_a_generator_continues_its_stream():
    """A sampled sequence's stream is counter-based on the target's device (eagle_backbone.sampling): the same
    int seed gives the same samples every time; a generator passed in draws the stream's seed, so two
    generators seeded alike agree and one generator used twice continues (the second call differs)."""
    target, draft = make_target(seed=11, vocab=8, d=16, layers=1), make_target(seed=12, vocab=8, d=16, layers=1)
    target.eos_token_ids = set()
    dec = SpeculativeDecoder(target, DraftModelCandidateGenerator(draft.model, target), StaticPolicy(2))
    cfg = SamplingConfig(temperature=1.0)
    for seed in (7, 8):
        by_int = dec.generate([1, 3], 12, cfg, seed=seed).tokens
        assert by_int == dec.generate([1, 3], 12, cfg, seed=seed).tokens
        g = torch.Generator().manual_seed(seed)
        by_gen = dec.generate([1, 3], 12, cfg, seed=g).tokens
        assert by_gen == dec.generate([1, 3], 12, cfg, seed=torch.Generator().manual_seed(seed)).tokens
        assert dec.generate([1, 3], 12, cfg, seed=g).tokens != by_gen  # the stream went on
    assert dec.generate([1, 3], 12, cfg, seed=7).tokens != by_int  # the seed matters: the check can fail
