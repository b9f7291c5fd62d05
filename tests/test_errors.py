"""Bad input gets a ValueError that names the problem, not a torch stack trace."""

import pytest
from conftest import make_drafter, make_target

from eagle_backbone.candidates import DraftModelCandidateGenerator, EagleCandidateGenerator
from eagle_backbone.engine import SpeculativeDecoder, autoregressive_generate
from eagle_backbone.policy import DraftLengthPolicy, StaticPolicy
from eagle_backbone.sampling import SamplingConfig


def test_drafter_target_mismatch(target, drafter):
    with pytest.raises(ValueError, match="hidden size"):
        EagleCandidateGenerator(make_drafter(make_target(d=48)), target)
    with pytest.raises(ValueError, match="vocabulary"):
        EagleCandidateGenerator(make_drafter(make_target(vocab=80)), target)
    with pytest.raises(ValueError, match="vocabulary"):
        DraftModelCandidateGenerator(make_target(vocab=80).model, target)


def test_prompts(target, drafter):
    dec = SpeculativeDecoder(target, EagleCandidateGenerator(drafter, target), StaticPolicy(2))
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate([], 5)
    with pytest.raises(ValueError, match="context"):
        dec.generate(list(range(3, 60)) * 5, 5)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        dec.generate([1, 999], 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate([1, 2], -1)
    with pytest.raises(ValueError, match="empty prompt"):
        autoregressive_generate(target, [], 5)


def test_gamma_and_sampling_settings(target, drafter):
    with pytest.raises(ValueError, match="gamma"):
        StaticPolicy(-1)

    class Negative(DraftLengthPolicy):
        name = "negative"

        def gamma(self, ctx):
            return -2

    dec = SpeculativeDecoder(target, EagleCandidateGenerator(drafter, target), Negative())
    with pytest.raises(ValueError, match="gamma=-2"):
        dec.generate([1, 2], 5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(temperature=1.0, top_k=-3)
