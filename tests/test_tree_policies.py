"""The tree policies (ldlp/policies/trees.py): YAML-level behaviour beyond the engine's tree tests.

tree_budget grows a tree only where a second choice pays for its scored token and the tree's own cost:
with verification priced flat (a GPU at low load) every drafting step is a tree; with each scored token
expensive (a CPU) the steps are chains, with a tree every ``explore_every`` chain steps to keep the sibling
rate current. Either way the output is the target's own greedy output."""

from __future__ import annotations

import pytest
import torch
from conftest import ar, prompts_of

from eagle_backbone.cost import CostTable
from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from ldlp.policies.trees import Eagle2TreePolicy, StaticTreePolicy, TreeBudgetPolicy

torch.set_num_threads(1)

SLOTS, TOKENS = [1, 2, 4], [1, 2, 3, 5, 9, 17]


def tree_table(token_ms: float) -> CostTable:
    """Verification 5 ms plus ``token_ms`` per scored token a row (every one, up to a tree's 17), a draft depth
    0.5 ms and feeding 0.1 ms (tests/conftest.py's ``table`` prices the tokens past a row's first, up to 9)."""
    return CostTable({"source": "test"}, SLOTS, TOKENS, [[5.0 + token_ms * R * t for t in TOKENS] for R in SLOTS],
                     [0.5] * len(SLOTS), [[0.1] * len(TOKENS) for _ in SLOTS], [0.0] * len(SLOTS))


def budget(tmp_path, token_ms: float, **kw) -> TreeBudgetPolicy:
    policy = TreeBudgetPolicy({"cost_dir": str(tmp_path), "model": "tiny"}, **kw)
    policy.pricing.costs = tree_table(token_ms)  # as bind would load it
    return policy


@pytest.mark.parametrize("token_ms, trees", [(0.0, True), (2.0, False)])
def test_tree_pays_follows_the_price_of_a_token(tmp_path, token_ms, trees):
    policy = budget(tmp_path, token_ms, tree_overhead_ms=0.0, sibling_prior=0.1)
    assert policy.tree_pays(1, 4) is trees
    assert not policy.tree_pays(1, 0)  # no drafting, no tree


@pytest.mark.parametrize("token_ms", [0.0, 2.0])
def test_tree_budget_steps_and_greedy_identity(t32, eagle32, tmp_path, token_ms, monkeypatch):
    """Before any evidence (the priors) a free token makes the first drafting step a tree and a costly one a
    chain; chains then explore with a tree every ``explore_every`` steps; the output is the target's."""
    policy = budget(tmp_path, token_ms, explore_every=3, tree_overhead_ms=0.0, sibling_prior=0.3)
    monkeypatch.setattr(TreeBudgetPolicy, "bind", lambda self, engine: setattr(self, "device", engine.device))
    steps = []
    decide = TreeBudgetPolicy.tree_now
    monkeypatch.setattr(TreeBudgetPolicy, "tree_now", lambda self: steps.append(decide(self)) or steps[-1])
    prompts = prompts_of((5, 9, 3, 7), seed=8)
    engine = BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=2, policy=policy)
    out = [o.tokens for o in engine.generate(prompts[:2], 12)] + [o.tokens for o in engine.generate(prompts[2:], 12)]
    assert out == ar(t32, prompts, 12)
    assert steps and steps[0] is (token_ms == 0.0)
    assert policy.tree_steps == sum(steps) and policy.chain_steps == len(steps) - sum(steps)
    if token_ms:
        assert not any(steps[i] and steps[i + 1] for i in range(len(steps) - 1))  # trees only to explore


def test_bad_tree_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="static_tree policy: unknown shape"):
        StaticTreePolicy("nope")
    with pytest.raises(ValueError, match="static_tree policy: paths"):
        StaticTreePolicy([[0, 1]])  # [0] missing: not closed under prefixes
    with pytest.raises(ValueError, match="eagle2_tree policy: top_k"):
        Eagle2TreePolicy(top_k=0)
    with pytest.raises(ValueError, match="tree_budget policy: tree: width"):
        TreeBudgetPolicy({"cost_dir": str(tmp_path), "model": "tiny"}, top_k=2, width=3)
    with pytest.raises(ValueError, match="tree_budget policy: need"):
        TreeBudgetPolicy({"cost_dir": str(tmp_path), "model": "tiny"}, sibling_prior=1.0)
