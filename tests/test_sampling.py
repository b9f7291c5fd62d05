"""Speculative sampling is exact: the output distribution equals the target's."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from eagle_backbone import sampling as S
from eagle_backbone.candidates import DraftModelCandidateGenerator
from eagle_backbone.engine import SpeculativeDecoder
from eagle_backbone.policy import StaticPolicy
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


def _exact_sequence_distribution(target, prompt, length, cfg):
    """P(x_1..x_L | prompt) of the target itself, by enumerating every sequence (tiny vocabulary)."""
    V = target.vocab_size
    probs = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=length):
            logits, _ = target(torch.tensor([prompt + list(seq)]))
            p = 1.0
            for k, tok in enumerate(seq):
                p *= float(S.probs_from_logits(logits[0, len(prompt) - 1 + k], cfg)[tok])
            probs[seq] = p
    return probs


def _speculative_counts(target, draft, prompt, length, cfg, n):
    dec = SpeculativeDecoder(target, DraftModelCandidateGenerator(draft.model, target), StaticPolicy(2))
    counts = {}
    for seed in range(n):
        seq = tuple(dec.generate(prompt, length, cfg, seed=seed).tokens)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def _chi2_pvalue(counts, probs, n):
    assert all(counts.get(k, 0) == 0 for k in probs if probs[k] == 0), "sampled a sequence of probability 0"
    keys = sorted(k for k in probs if probs[k] > 0)
    total = sum(probs.values())
    expected = [probs[k] / total * n for k in keys]
    observed = [counts.get(k, 0) for k in keys]
    return chisquare(observed, expected).pvalue


def test_sampled_sequences_follow_the_target(tiny_vocab_pair):
    target, draft = tiny_vocab_pair
    cfg, prompt, n = SamplingConfig(temperature=1.0), [1, 3], 1200
    probs = _exact_sequence_distribution(target, prompt, 3, cfg)
    assert abs(sum(probs.values()) - 1) < 1e-6
    assert _chi2_pvalue(_speculative_counts(target, draft, prompt, 3, cfg, n), probs, n) > 1e-3


def test_a_broken_residual_is_detected(tiny_vocab_pair, monkeypatch):
    """The statistical test has power: resampling from p instead of max(p - q, 0) fails it."""
    target, draft = tiny_vocab_pair
    cfg, prompt, n = SamplingConfig(temperature=1.0), [1, 3], 1200
    probs = _exact_sequence_distribution(target, prompt, 3, cfg)
    monkeypatch.setattr(S, "residual", lambda p, q: p)
    assert _chi2_pvalue(_speculative_counts(target, draft, prompt, 3, cfg, n), probs, n) < 1e-6


def test_top_k_top_p_sampling_is_lossless_too(tiny_vocab_pair):
    target, draft = tiny_vocab_pair
    cfg, prompt, n = SamplingConfig(temperature=0.8, top_k=3, top_p=0.9), [2], 1500
    probs = _exact_sequence_distribution(target, prompt, 2, cfg)
    assert _chi2_pvalue(_speculative_counts(target, draft, prompt, 2, cfg, n), probs, n) > 1e-3
