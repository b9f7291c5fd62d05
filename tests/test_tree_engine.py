"""Draft trees in the batched engine (eagle_backbone/tree_step.py, eagle_backbone/tree_draft.py):
greedy identity with the target's own decoding for dynamic (EAGLE-2) and static trees, both candidate kinds,
one and three slots with prompts admitted mid-run, eager and sdpa attention; early_exit on and off agree; a
width-1 tree is the chain; partial and empty selections; the capacity edge; seeded sampled runs repeat.

Tiny float32 Llamas (tests/conftest.py); no test reads a clock. Per-policy host-read counting lives in
tests/test_host_reads.py (it globs conf/policy); EOS inside a tree's accepted path, a sequence's samples independent
of the batch, and lossless tree sampling (chi-square against the enumerated distribution, and its power against a
broken sibling rejection) in tests/test_batched.py (test_eos_inside_one_slots_draft,
test_a_sequences_samples_do_not_depend_on_the_batch, test_sampled_prefixes_have_the_enumerated_distribution and
test_chi_square_has_power_against_a_broken_sibling_rejection: trees beside chains), not here."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import SPECS, AnyTree, ar, counters, decode, prompts_of
from conftest import TREE_N as N
from conftest import TREE_PROMPTS as PROMPTS

from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.policy import StaticPolicy
from eagle_backbone.sampling import SamplingConfig
from eagle_backbone.tree import MC_SIM_7B_63, DraftTree, top_nodes
from eagle_backbone.tree_draft import TreeSpec

torch.set_num_threads(1)


def top_per_row(n_of_slot):
    """A selection: each row's ``n_of_slot(slot)`` best nodes by cumulative drafter log-probability."""

    def sel(grown, rows):
        n = torch.tensor([n_of_slot(b) for b in rows.slots], device=grown.valid.device)
        return top_nodes(grown.score, grown.tree, n, per_row=True)

    return sel


def nothing(grown, rows):
    return torch.zeros_like(grown.valid)


@pytest.fixture(scope="module")
def reference(t32):
    return ar(t32, PROMPTS, N)


# ---- greedy identity ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("kind", ["eagle", "draft_lm"])
def test_greedy_identity(t32, drafters, reference, kind, spec):
    """Every tree shape, both generators, C = 1 and 3 (joined prefill rows next to tree span rows), eager
    and sdpa: the target's own greedy tokens, with drafts scored and (draft LM) accepted."""
    joined_with_tree = []
    for C in (1, 3):
        for attn in ("eager", "sdpa"):
            engine = BatchedSpeculativeEngine(t32, drafters[kind], kind, slots=C, policy=AnyTree(SPECS[spec]),
                                              attn=attn)
            verify = engine._verify_tree

            def watch(plan, tree, drafted, _verify=verify):
                ver = _verify(plan, tree, drafted)
                joined_with_tree.append(ver.prefill is not None)
                return ver

            engine._verify_tree = watch
            out = decode(engine)
            assert [o.tokens for o in out] == reference, (C, attn)
            assert all(o.stats.drafted_tokens > 0 for o in out if len(o.tokens) > 2)
            if kind == "draft_lm":
                assert sum(o.stats.accepted_tokens for o in out) > 20
            for o in out:
                s = o.stats
                assert s.accepted_tokens == sum(s.accept_lengths) <= s.drafted_tokens == sum(s.draft_lengths)
                assert max(s.accept_lengths, default=0) <= SPECS[spec].depth
    assert any(joined_with_tree)  # prompts were prefilled inside tree steps


def test_per_row_depth_caps_and_a_short_budget(t32, drafters):
    """Rows of one step with different depth caps, 0 included (a plain decoding row beside tree rows), and
    budgets that cut the trees' depth."""
    caps = lambda b: b % 4  # slots 0, 1, 2, 3: depth 0 .. 3
    for kind in drafters:
        for n in (N, 5):
            engine = BatchedSpeculativeEngine(t32, drafters[kind], kind, slots=4,
                                              policy=AnyTree(TreeSpec(3, 3), caps=caps))
            out = decode(engine, n=n)
            assert [o.tokens for o in out] == ar(t32, PROMPTS, n)
            assert out[0].stats.drafted_tokens == 0  # prompt 0 sat in slot 0 (depth cap 0)
            assert all(d <= TreeSpec(3, 3).max_nodes for o in out for d in o.stats.draft_lengths)
            assert sum(o.stats.drafted_tokens for o in out) > 0


def test_a_perfect_drafter_accepts_the_deepest_path(t32):
    """The target as its own draft LM: MC_SIM_7B_63 holds the top-1 chain to depth 5, so every step accepts
    min(5, the budget's cap) and the K/V moved along each path gives the next steps the right cache."""
    prompts = prompts_of((5, 9, 7))
    target = copy.copy(t32)
    target.eos_token_ids = set()  # no EOS: every sequence runs to its budget
    engine = BatchedSpeculativeEngine(target, t32.model, "draft_lm", slots=3, policy=AnyTree(SPECS["mc_sim_7b_63"]))
    out = engine.generate(prompts, 24)
    assert [o.tokens for o in out] == ar(target, prompts, 24)
    for o in out:
        left = [24 - 1 - sum(a + 1 for a in o.stats.accept_lengths[:i]) for i in range(len(o.stats.accept_lengths))]
        assert o.stats.accept_lengths == [min(5, c - 1) for c in left]


# ---- early_exit on and off ------------------------------------------------------------------------------


POLICIES = {
    "all_dyn": lambda: AnyTree(SPECS["dyn3x4"]),
    "all_static": lambda: AnyTree(SPECS["mc_sim_7b_63"]),
    "top_per_row": lambda: AnyTree(SPECS["dyn3x4"], sel=top_per_row(lambda b: (3 * b + 1) % 7)),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ["eagle", "draft_lm"])
def test_early_exit_on_and_off_agree(t32, drafters, reference, kind, policy):
    """Scoring only the selected nodes (counts read on the host) or every row padded to tree_width (the
    selection a device mask): the same tokens, and the same accept and drafted counts (padded mode reads the
    exact counts with the step's one read)."""
    runs = {}
    for early in (True, False):
        engine = BatchedSpeculativeEngine(t32, drafters[kind], kind, slots=3, policy=POLICIES[policy](),
                                          early_exit=early)
        assert engine.early_exit is early
        runs[early] = decode(engine)
        assert [o.tokens for o in runs[early]] == reference
    assert counters(runs[True]) == counters(runs[False])


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_early_exit_on_and_off_agree_when_sampling(t32, draft_lm, temperature):
    cfg = SamplingConfig(temperature=temperature)
    runs = [decode(BatchedSpeculativeEngine(t32, draft_lm, "draft_lm", slots=3, policy=AnyTree(TreeSpec(2, 3)),
                                            sampling=cfg, early_exit=early), seeds=range(7, 14))
            for early in (True, False)]
    assert [o.tokens for o in runs[0]] == [o.tokens for o in runs[1]]
    assert counters(runs[0]) == counters(runs[1])


# ---- a width-1 tree is the chain --------------------------------------------------------------------


@pytest.mark.parametrize("g", [1, 3, 5])
@pytest.mark.parametrize("kind", ["eagle", "draft_lm"])
def test_width_one_tree_is_the_chain(t32, drafters, reference, kind, g):
    tree = decode(BatchedSpeculativeEngine(t32, drafters[kind], kind, slots=3, policy=AnyTree(TreeSpec(1, g), g)))
    chain = decode(BatchedSpeculativeEngine(t32, drafters[kind], kind, slots=3, policy=StaticPolicy(g)))
    assert [o.tokens for o in tree] == [o.tokens for o in chain] == reference
    assert counters(tree) == counters(chain)


# ---- selections -------------------------------------------------------------------------------------


@pytest.mark.parametrize("early_exit", [True, False])
@pytest.mark.parametrize("kind", ["eagle", "draft_lm"])
def test_partial_selection_is_greedy_identical(t32, drafters, reference, kind, early_exit):
    """Each row scores its n best nodes, n per slot (0 included: a row with nothing selected beside rows
    with trees, and steps where no row selects anything); drafted counts are the selection's size."""
    n_of = lambda b: (0, 2, 5)[b]
    policy = AnyTree(SPECS["dyn3x4"], sel=top_per_row(n_of), record=True)
    engine = BatchedSpeculativeEngine(t32, drafters[kind], kind, slots=3, policy=policy, early_exit=early_exit)
    out = decode(engine)
    assert [o.tokens for o in out] == reference
    assert all(d <= 5 for o in out for d in o.stats.draft_lengths)
    assert any(d == 5 for o in out for d in o.stats.draft_lengths)
    # the outcome the policy saw: the kept nodes are the accepted path, tested nodes include it, and every
    # scored node is a valid grown node with the same token
    for oc in policy.outcomes:
        assert torch.equal(oc.kept.sum(1), oc.accepted)
        assert not (oc.kept & ~oc.tested).any()
        has = oc.index >= 0
        assert torch.equal(has, oc.scored.valid)
        assert oc.grown.valid.gather(1, oc.index.clamp(min=0))[has].all()
        assert torch.equal(oc.grown.tokens.gather(1, oc.index.clamp(min=0))[has], oc.scored.tokens[has])


@pytest.mark.parametrize("early_exit", [True, False])
def test_empty_selection_is_plain_decoding(t32, draft_lm, reference, early_exit):
    """A select that keeps nothing: every step is a plain decoding step (nothing drafted, nothing accepted)
    and the output is the target's. With early_exit the step's tree has no node slot at all (a budget
    policy choosing n = 0 for the whole batch does this)."""
    engine = BatchedSpeculativeEngine(t32, draft_lm, "draft_lm", slots=3, policy=AnyTree(TreeSpec(2, 3), sel=nothing),
                                      early_exit=early_exit)
    out = decode(engine)
    assert [o.tokens for o in out] == reference
    for o in out:
        assert set(o.stats.accept_lengths) <= {0} and set(o.stats.draft_lengths) <= {0}
        assert o.stats.target_forwards == len(o.tokens)


def test_empty_tree_positions_have_the_root_column():
    """A tree with no node slots still has its root: one position a row, as its mask has one query."""
    z = torch.zeros(2, 0, dtype=torch.long)
    tree = DraftTree(z, z, torch.zeros(2, 0, dtype=torch.bool))
    assert tree.attention_mask().shape == (2, 1, 1)
    assert tree.positions(torch.tensor([5, 7])).tolist() == [[5], [7]]


# ---- the capacity edge ------------------------------------------------------------------------------


CAP = 24
CAP_PROMPTS = prompts_of((20, 22, 23, 17, 12, 21))


@pytest.mark.parametrize("early_exit", [True, False])  # padded: the width is cut to the batch's room
@pytest.mark.parametrize("spec", ["dyn3x4", "mc_sim_7b_63"])
@pytest.mark.parametrize("kind", ["eagle", "draft_lm"])
def test_prompts_near_the_capacity(t32, drafters, kind, spec, early_exit):
    """A small capacity and prompts a few positions short of it: trees are cut to the room left (the
    generator's tree positions live in engine.tree_room past it), and the output is plain decoding's
    under the same capacity."""
    plain = BatchedSpeculativeEngine(t32, slots=1, capacity=CAP)
    ref = [o.tokens for o in decode(plain, CAP_PROMPTS)]
    assert any(len(r) < N for r in ref)  # the capacity, not the budget, ends some sequences
    for C in (1, 3):
        engine = BatchedSpeculativeEngine(t32, drafters[kind], kind, slots=C, policy=AnyTree(SPECS[spec]),
                                          capacity=CAP, early_exit=early_exit)
        assert engine.tree_room == SPECS[spec].fed
        out = decode(engine, CAP_PROMPTS)
        assert [o.tokens for o in out] == ref
        assert all(s.tlen <= CAP for s in engine.state)


# ---- sampling ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["eagle", "draft_lm"])
def test_seeded_sampling_repeats(t32, drafters, kind):
    """The same command twice (fresh engines, same seeds): the same tokens and counters."""
    cfg = SamplingConfig(temperature=1.0)
    runs = [decode(BatchedSpeculativeEngine(t32, drafters[kind], kind, slots=3, policy=AnyTree(SPECS["dyn2x3"]),
                                            sampling=cfg), seeds=range(100, 107))
            for _ in range(2)]
    assert [o.tokens for o in runs[0]] == [o.tokens for o in runs[1]]
    assert counters(runs[0]) == counters(runs[1])
    assert len({tuple(o.tokens) for o in runs[0]}) == len(PROMPTS)


# ---- the drafter's tree forward -----------------------------------------------------------------------


@pytest.mark.parametrize("spec", [TreeSpec(3, 4), TreeSpec(3, 4, width=1), TreeSpec.static(MC_SIM_7B_63)],
                         ids=["dynamic", "width1", "mc_sim_7b_63"])
@pytest.mark.parametrize("kind", ["eagle", "draft_lm"])
def test_every_grown_node_has_its_paths_draft_distribution(t32, drafters, kind, spec):
    """Greedy identity cannot see a wrong drafter mask (the target decides every token). Each grown node's
    log-probability must be what drafting its path as a chain gives: the tree's frontier sees its own
    ancestors only, rotated at its depth, whatever else sits in the drafter's cache."""
    from eagle_backbone.tree_draft import grow_tree

    engine = BatchedSpeculativeEngine(t32, drafters[kind], kind, slots=2, policy=AnyTree(spec))
    for b, p in enumerate(prompts_of((9, 13), seed=3)):
        engine.admit(b, p, 16, request=b)
    engine.step()  # the prefill
    engine.step()  # one tree step, so that the caches hold a verified tree's leftovers too
    run = [0, 1]
    tlens = [engine.state[b].tlen for b in run]
    grown = grow_tree(engine.cand, run, tlens, [spec.depth] * 2, spec)
    R, K = grown.tokens.shape
    for r in range(R):
        for i in range(K):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = int(grown.parents[r, j])
            path = path[::-1]
            logits, state = engine.cand.start([run[r]], [tlens[r]])
            for depth, node in enumerate(path[:-1], 1):  # draft the path's nodes before i as a chain
                tok = grown.tokens[r, node].view(1)
                logits, state = engine.cand.extend([run[r]], tok, [tlens[r]], depth,
                                                   None if state is None else state)
            want = torch.log_softmax(logits.float(), -1)[0, grown.tokens[r, i]]
            torch.testing.assert_close(grown.logq[r, i], want, rtol=1e-4, atol=1e-4)
            assert int(grown.depth[r, i]) == len(path)


def test_a_tree_too_large_names_the_settings_to_change():
    from eagle_backbone.tree_draft import TreeSpec

    with pytest.raises(ValueError, match="top_k=64, depth=6.*lower policy.top_k, policy.depth or policy.width"):
        TreeSpec(top_k=64, depth=6)
