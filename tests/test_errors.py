"""Bad input gets a ValueError that names the problem, not a torch stack trace."""

import pytest
from conftest import make_drafter, make_target, one_line, tiny_llama_config
from transformers import LlamaForCausalLM

from eagle_backbone.kinds.draft_lm import DraftModelCandidateGenerator
from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.decoder import SpeculativeDecoder, autoregressive_generate
from eagle_backbone.policy import DraftPolicy, StaticPolicy
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

    class Negative(DraftPolicy):
        name = "negative"

        def plan(self, rows):
            return [-2] * len(rows)

    dec = SpeculativeDecoder(target, EagleCandidateGenerator(drafter, target), Negative())
    with pytest.raises(ValueError, match="gamma=-2"):
        dec.generate([1, 2], 5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(temperature=1.0, top_k=-3)


def test_heads_of_the_wrong_size_fail_before_any_generation(tmp_path, target, drafter):
    from eagle_backbone.kinds.draft_lm import DraftModelCandidateGenerator
    from eagle_backbone.kinds.eagle import EagleCandidateGenerator
    from eagle_backbone.decoder import SpeculativeDecoder
    from ldlp.models.acceptance import AcceptanceHead, AcceptanceHeadConfig
    from ldlp.policies.threshold import AcceptancePolicy, LDLPDDDPolicy, LDLPPolicy
    from ldlp.models.predictor import LDLP, LDLPConfig

    d = target.hidden_size
    cands = EagleCandidateGenerator(drafter, target)
    AcceptanceHead(AcceptanceHeadConfig(hidden_size=d + 4, k_max=8)).save_pretrained(tmp_path / "acc")
    LDLP(LDLPConfig(input_dim=2 * (d + 4))).save_pretrained(tmp_path / "ldlp")
    for policy, what in ((AcceptancePolicy(str(tmp_path / "acc")), f"hidden_size={d + 4}"),
                         (LDLPPolicy(str(tmp_path / "ldlp")), f"input_dim={2 * (d + 4)}"),
                         (LDLPDDDPolicy(str(tmp_path / "ldlp")), f"input_dim={2 * (d + 4)}")):
        with pytest.raises(ValueError) as e:
            SpeculativeDecoder(target, cands, policy)
        msg = one_line(e)
        assert what in msg and str(d) in msg and "train" in msg
    # the right sizes build; an acceptance head with a draft LM (no drafter states) fails at once
    AcceptanceHead(AcceptanceHeadConfig(hidden_size=d, k_max=8)).save_pretrained(tmp_path / "acc_ok")
    SpeculativeDecoder(target, cands, AcceptancePolicy(str(tmp_path / "acc_ok")))
    draft_lm = LlamaForCausalLM(tiny_llama_config(layers=1)).double()
    with pytest.raises(ValueError, match="drafter_kind=eagle"):
        SpeculativeDecoder(target, DraftModelCandidateGenerator(draft_lm, target), AcceptancePolicy(str(tmp_path / "acc_ok")))
    # a drafter trained for another target fails when its generator is built
    from conftest import make_drafter

    other = make_drafter(make_target(d=48))
    with pytest.raises(ValueError, match="hidden size 48 != target hidden size"):
        EagleCandidateGenerator(other, target)
