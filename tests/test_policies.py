"""Draft-length policies: each rule's decisions on synthetic contexts, the oracle's zero waste on tiny
float64 models, losslessness of every policy inside the engine, and their YAML files."""

import math
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from conftest import noisy_head_copy, step_ldlp
from hydra.utils import instantiate

from eagle_backbone.kinds.draft_lm import DraftModelCandidateGenerator
from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.decoder import SpeculativeDecoder, autoregressive_generate
from ldlp.bench.harness.replay import OneSequence
from eagle_backbone.sampling import SamplingConfig
from ldlp.policies.threshold import ConfidencePolicy, DDDPolicy, EntropyPolicy, HeuristicPolicy, LDLPDDDPolicy, LDLPPolicy
from ldlp.policies.oracles import OraclePolicy
from eagle_backbone.policy import StaticPolicy
from ldlp.models.predictor import LDLP, LDLPConfig

REPO = Path(__file__).resolve().parent.parent
D = 32  # hidden size of the conftest targets


def one_row(policy) -> OneSequence:
    """``policy`` driven one sequence at a time, as replay drives it (embeddings all zero), its prompt begun."""
    seq = OneSequence(policy, embed=lambda ids: torch.zeros(len(ids), D))
    seq.begin([1])
    return seq


def planned(seq: OneSequence) -> int:
    """The depth ``seq``'s policy plans for a row at last token 5 with a zero feature (cap 100)."""
    return seq.plan(5, torch.zeros(D), cap=100)


def dist(top: float, vocab: int = 10) -> torch.Tensor:
    """Top probability ``top`` on token 0, the rest spread evenly."""
    p = torch.full((vocab,), (1 - top) / (vocab - 1))
    p[0] = top
    return p


def drive(policy, probs_seq) -> int:
    """How many tokens a chain drafts when the drafter's distributions are ``probs_seq`` (token 0 each time)."""
    seq = one_row(policy)
    gamma = planned(seq)
    for i, p in enumerate(probs_seq[:gamma], 1):
        if i == gamma or not seq.go_on(i, p):
            return i
    return min(gamma, len(probs_seq))


@pytest.fixture(scope="module")
def ldlp_dir(tmp_path_factory):
    """A saved regression LDLP that always predicts 2 (zero weights, bias 2)."""
    model = LDLP(LDLPConfig(input_dim=2 * D, hidden_dim=8, k_max=8))
    with torch.no_grad():
        model.output.weight.zero_()
        model.output.bias.fill_(2.0)
    return str(model.save_pretrained(tmp_path_factory.mktemp("ldlp")))


# -- decisions on synthetic contexts ---------------------------------------------------------------------


def test_ddd_stops_when_cumulative_logprob_falls_below_threshold():
    policy = DDDPolicy(threshold=math.log(0.5), max_gamma=8)
    # cumulative probabilities 0.9, 0.72, 0.576, 0.4608: the fourth token crosses log 0.5 and ends the chain
    assert drive(policy, [dist(0.9), dist(0.8), dist(0.8), dist(0.8), dist(0.99)]) == 4
    assert drive(policy, [dist(0.4)] * 8) == 1  # the state resets at every gamma()
    assert drive(policy, [dist(1.0)] * 10) == 8  # never below: the cap


def test_ldlp_predicts_and_ldlp_ddd_drafts_at_least_that(ldlp_dir):
    assert planned(one_row(LDLPPolicy(ldlp_dir))) == 2
    assert planned(one_row(LDLPPolicy(ldlp_dir, offset=1))) == 3
    assert planned(one_row(LDLPPolicy(ldlp_dir, max_gamma=1))) == 1
    both = LDLPDDDPolicy(ldlp_dir, threshold=math.log(0.5), max_gamma=8)
    assert drive(both, [dist(0.1)] * 8) == 2  # DDD would stop at 1; the LDLP length comes first
    assert drive(both, [dist(0.95)] * 8) == 8  # DDD keeps going past the LDLP length
    assert drive(both, [dist(0.9), dist(0.9), dist(0.9), dist(0.5), dist(0.9)]) == 4


def test_ldlp_distribution_head_threshold(tmp_path, ldlp_dir):
    """Survival curve P(L >= k) = 0.8^k: threshold 0.5 drafts 3 (0.512), threshold 0.3 drafts 5 (0.328)."""
    model = LDLP(LDLPConfig(input_dim=2 * D, hidden_dim=8, k_max=8, head="distribution"))
    with torch.no_grad():
        model.output.weight.zero_()
        model.output.bias.fill_(math.log(0.8 / 0.2))  # every continuation probability is 0.8
    path = str(model.save_pretrained(tmp_path / "dist"))
    assert planned(one_row(LDLPPolicy(path))) == 3
    assert planned(one_row(LDLPPolicy(path, threshold=0.3))) == 5
    assert planned(one_row(LDLPPolicy(path))) == 3  # the shared (cached) model keeps its own threshold
    with pytest.raises(ValueError, match="distribution head only"):
        LDLPPolicy(ldlp_dir, threshold=0.3)


def test_ldlp_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="train_ldlp"):
        LDLPPolicy(str(tmp_path / "nothing"))


def test_confidence_and_entropy_thresholds():
    conf = ConfidencePolicy(threshold=0.5, max_gamma=6)
    assert drive(conf, [dist(0.9), dist(0.6), dist(0.4), dist(0.9)]) == 3
    assert drive(conf, [dist(0.9)] * 10) == 6
    ent = EntropyPolicy(threshold=1.0, max_gamma=6)
    assert EntropyPolicy.entropy(torch.tensor([1.0, 0.0])) == 0.0
    assert abs(EntropyPolicy.entropy(torch.full((4,), 0.25)) - math.log(4)) < 1e-9
    # ten tokens: entropy of dist(0.9) ~ 0.52 nats, of dist(0.3) ~ 2.0 nats
    assert drive(ent, [dist(0.9), dist(0.9), dist(0.3), dist(0.9)]) == 3
    with pytest.raises(ValueError):
        ConfidencePolicy(threshold=1.5)
    with pytest.raises(ValueError):
        DDDPolicy(threshold=0.3)


def test_heuristic_schedule_matches_transformers():
    policy = one_row(HeuristicPolicy(initial_gamma=5))
    for drafted, accepted in [(5, 5), (7, 7), (9, 3), (8, 0), (7, 7), (9, 8), (8, 0), (7, 0), (6, 0), (5, 0),
                              (4, 0), (3, 0), (2, 0), (1, 0)]:
        assert planned(policy) == drafted
        policy.observe(drafted, accepted)
    assert planned(policy) == 1  # never below 1
    policy.begin([1])
    assert planned(policy) == 5  # reset per generation
    capped = one_row(HeuristicPolicy(initial_gamma=5, max_gamma=6))
    planned(capped)
    capped.observe(5, 5)
    assert planned(capped) == 6


def test_heuristic_keeps_a_schedule_per_slot():
    """One instance serves every slot: each row's γ follows its own accept counts, and a new prompt in a slot
    starts that slot over."""
    from eagle_backbone.policy import Rows

    policy = HeuristicPolicy(initial_gamma=3)
    for slot in (0, 1, 2):
        policy.begin(slot, [1])
    rows = Rows([0, 1, 2], [8] * 3, [1] * 3, torch.zeros(3, dtype=torch.long), torch.zeros(3, D))
    policy.observe(rows, [3, 3, 0], [3, 1, 0])  # all kept, one rejected, a plain step
    assert policy.plan(rows) == [5, 2, 2]
    policy.begin(1, [7])
    assert policy.plan(rows) == [5, 3, 2]


# -- the oracle and the engine ----------------------------------------------------------------------------


PROMPTS = [[3, 14, 15, 9, 26], [5, 8, 13], [21, 34, 55, 4, 7, 11, 30]]


@pytest.mark.parametrize("kind", ["eagle", "draft_lm"])
def test_oracle_zero_waste_and_lossless(target, drafter, kind):
    cand = (EagleCandidateGenerator(drafter, target) if kind == "eagle"
            else DraftModelCandidateGenerator(noisy_head_copy(target), target))
    oracle = OraclePolicy(k_max=6)
    static = SpeculativeDecoder(target, cand, StaticPolicy(6))
    for prompt in PROMPTS:
        ref = autoregressive_generate(target, prompt, 40).tokens
        out = SpeculativeDecoder(target, cand, oracle).generate(prompt, 40)
        s = out.stats
        assert out.tokens == ref
        assert s.wasted_tokens == 0 and s.draft_lengths == s.accept_lengths
        # every target forward emits its accepted drafts plus one token: τ = mean(accepted + 1)
        assert s.new_tokens == s.target_forwards + s.accepted_tokens
        assert s.target_forwards == static.generate(prompt, 40).stats.target_forwards
    if kind == "draft_lm":
        assert s.accepted_tokens > 0  # the noisy copy is accepted sometimes: the test sees non-trivial labels


def test_oracle_is_greedy_only(target, drafter):
    with pytest.raises(ValueError, match="greedy"):
        BatchedSpeculativeEngine(target, EagleCandidateGenerator(drafter, target), slots=1, policy=OraclePolicy(),
                                 sampling=SamplingConfig(temperature=0.8))
    with pytest.raises(ValueError, match="bind"):
        OraclePolicy().begin(0, [1, 2])


def test_every_policy_is_lossless_in_the_engine(target, ldlp_dir):
    draft_lm = noisy_head_copy(target, seed=1)
    policies = [StaticPolicy(3), LDLPPolicy(ldlp_dir), LDLPDDDPolicy(ldlp_dir, threshold=-1.0),
                DDDPolicy(-1.0), ConfidencePolicy(0.4), EntropyPolicy(1.0), HeuristicPolicy(5)]
    for policy in policies:
        dec = SpeculativeDecoder(target, DraftModelCandidateGenerator(draft_lm, target), policy)
        for prompt in PROMPTS[:2]:
            assert dec.generate(prompt, 30).tokens == autoregressive_generate(target, prompt, 30).tokens, policy.name


def test_policy_yaml_files_instantiate(ldlp_dir, tmp_path):
    survival_dir = str(LDLP(LDLPConfig(input_dim=2 * D, hidden_dim=8, k_max=8, head="distribution"))
                       .save_pretrained(tmp_path / "survival"))
    from ldlp.models.acceptance import AcceptanceHead, AcceptanceHeadConfig

    acceptance_dir = AcceptanceHead(AcceptanceHeadConfig(hidden_size=D, k_max=8)).save_pretrained(tmp_path / "acc")
    learned_dir = step_ldlp(D, tmp_path / "learned", k_max=8)
    names = sorted(p.stem for p in (REPO / "conf" / "policy").glob("*.yaml"))
    assert {"static", "ldlp", "ddd", "ldlp_ddd", "confidence", "entropy", "acceptance", "heuristic",
            "oracle"} <= set(names)
    import eagle_backbone.paths  # noqa: F401

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for name in names:
            overrides = [f"policy={name}", f"ldlp_path={ldlp_dir}", f"ldlp_survival_path={survival_dir}",
                         f"learned_path={learned_dir}",
                         f"acceptance_path={acceptance_dir}", f"paths.draft_acceptance={tmp_path}",
                         f"paths.cost={tmp_path / 'cost'}"]
            cfg = compose(config_name="evaluate", overrides=overrides)
            policy = instantiate(cfg.policy)
            # only a fixed γ is reported as static (the results then carry its γ); every other rule,
            # the oracle and the transformers peers choose their own lengths
            assert policy.adaptive is (name != "static"), name
            if name == "static":
                assert policy.fixed_gamma == cfg.policy.gamma


# -- docs/policies.md's "Adding one", run as written -------------------------------------------------------------


def _recipe_blocks() -> dict[str, str]:
    """The recipe's code blocks by the file each one's first line names (``# ldlp/policies/mine.py``)."""
    text = (REPO / "docs" / "policies.md").read_text(encoding="utf-8").split("## Adding one", 1)[1]
    blocks = re.findall(r"```(?:python|yaml)\n(.*?)```", text, re.S)
    return {b.splitlines()[0].removeprefix("# ").strip(): b for b in blocks}


def test_the_add_a_policy_recipe_runs_as_written(tmp_path, monkeypatch):
    """The page's file and YAML, nothing else: the class imports as the YAML's ``_target_`` names it, composes as
    ``policy=mine`` and builds through the scripts' loader, decodes losslessly in the engine (its stop and plan cut
    the drafts), and replay counts what the engine counted."""
    import sys
    import types

    from conftest import compose_config
    from oracle_helpers import greedy_oracle, mimic_pair

    from eagle_backbone.cost import CostTable
    from ldlp.bench.harness.loaders import build_policy
    from ldlp.bench.harness.replay import OracleRows, replay

    blocks = _recipe_blocks()
    assert sorted(blocks) == ["conf/policy/mine.yaml", "ldlp/policies/mine.py"]  # one file plus a YAML
    module = types.ModuleType("ldlp.policies.mine")
    exec(compile(blocks["ldlp/policies/mine.py"], "ldlp/policies/mine.py", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "ldlp.policies.mine", module)
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "mine.yaml").write_text(blocks["conf/policy/mine.yaml"])
    # the tiny pair drafts flat distributions: a lower threshold than the YAML's, so that both rules decide
    cfg = compose_config("evaluate", ["policy=mine", "policy.threshold=0.1", f"hydra.searchpath=[file://{tmp_path}]"])
    make = lambda: build_policy(cfg.policy)  # noqa: E731
    assert type(make()).__name__ == "MyPolicy" and (make().threshold, make().max_gamma) == (0.1, 8)

    target, drafter = mimic_pair()
    cand = EagleCandidateGenerator(drafter, target)
    prompts, budget = [[5, 9, 11, 3], [7, 7, 20], [30, 4, 12, 18, 9]], 36
    stats = []
    for p in prompts:
        out = SpeculativeDecoder(target, cand, make()).generate(p, budget)
        assert out.tokens == autoregressive_generate(target, p, budget).tokens
        stats.append(out.stats)
    lengths = [n for s in stats for n in s.draft_lengths]
    assert 0 < min(lengths) < max(lengths) <= 8  # the policy decided: not every step drafts to the cap
    rows = OracleRows.from_sequences([greedy_oracle(target, drafter, p, budget, k_max=8)[1] for p in prompts], budget)
    res = replay(rows, make(), CostTable.linear(10.0, 1.0), embed=target.embed, vocab_size=target.vocab_size)
    assert res.drafted == sum(s.drafted_tokens for s in stats)
    assert res.accepted == sum(s.accepted_tokens for s in stats)


def test_a_policy_yaml_that_builds_no_policy_is_refused_in_one_line():
    """A ``_target_`` that builds something other than a DraftPolicy (or a peer) is named, not run into mid-decode."""
    from conftest import one_line
    from omegaconf import OmegaConf

    from ldlp.bench.harness.loaders import build_policy

    with pytest.raises(ValueError, match=r"policy._target_=collections.OrderedDict built a OrderedDict, not a "
                                         r"DraftPolicy") as e:
        build_policy(OmegaConf.create({"_target_": "collections.OrderedDict"}))
    one_line(e)
