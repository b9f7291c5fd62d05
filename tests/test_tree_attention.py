"""Tree rows in the compact forward (eagle_backbone/llama.py): a row of draft-tree tokens written at
``start + j``, rotated at ``start + depth(j)`` and masked to the prefix and its ancestors, gives every node
the model's output on ``prefix + path-to-node`` alone; and SlotCache.move leaves an accepted path's cache as
a chain would have written it.

Tiny float32 Llama and EAGLE drafter from tests/conftest.py (t32, eagle32); each check compares with
transformers run on the path alone."""

from __future__ import annotations

import pytest
import torch

from eagle_backbone.llama import BatchedEagleDrafter, BatchedLlama
from eagle_backbone.ragged import RaggedBatch

torch.set_num_threads(1)

# siblings at depths 1, 2 and 3, and a depth-4 node: 0 -> {1, 2}, 1 -> {3, 4}, 2 -> {5}, 4 -> {6}
TREE = [-1, 0, 0, 1, 1, 2, 4]
TREE_B = [-1, 0, 1, 0, 3, 3, 5]  # another shape of the same size (a dense block may mix shapes)


def tokens_of(n, seed, vocab=64):
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def path(parents, j):
    """Row indices from the row's first token down to token j."""
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out[::-1]


def test_parents_are_checked_and_chains_stay_chains():
    chain = RaggedBatch([0, 1], [4, 6], [3, 1], "cpu", parents=[[-1, 0, 1], None])
    assert chain.parents is None and chain.rope_pos is chain.pos  # no tree: exactly the chain batch
    tree = RaggedBatch([0, 1], [4, 6], [7, 2], "cpu", parents=[TREE, None])
    assert tree.pos.tolist() == [4, 5, 6, 7, 8, 9, 10, 6, 7]
    assert tree.rope_pos.tolist() == [4, 5, 5, 6, 6, 6, 7, 6, 7]  # start + depth for the tree, the chain as is
    with pytest.raises(ValueError, match="parents"):
        RaggedBatch([0], [0], [3], "cpu", parents=[[-1, 0]])
    with pytest.raises(ValueError, match="earlier token"):
        RaggedBatch([0], [0], [3], "cpu", parents=[[-1, 2, 0]])
    with pytest.raises(ValueError, match="rows"):
        RaggedBatch([0, 1], [0, 0], [3, 1], "cpu", parents=[TREE[:3]])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("slack", [0, 10_000])  # every row on its own / consecutive tree rows as one dense block
def test_tree_rows_give_each_node_its_paths_logits(t32, attn, slack):
    """One forward with a prefill row, a chain row and three tree rows (consecutive slots, two shapes,
    different prefixes): every node's logits are transformers' for ``prefix + path-to-node`` alone."""
    m = BatchedLlama(t32.model, 64, attn)
    cache = m.new_cache(6)
    prefixes = {1: tokens_of(9, 1), 2: tokens_of(12, 2), 3: tokens_of(10, 3), 4: tokens_of(13, 4)}
    m(torch.tensor([x for p in prefixes.values() for x in p]),
      RaggedBatch(list(prefixes), [0] * 4, [len(p) for p in prefixes.values()], "cpu"), cache)
    rows = [  # (slot, prefix, new tokens, parents)
        (0, [], tokens_of(6, 10), None),  # a prompt joining the step
        (1, prefixes[1], tokens_of(7, 11), None),  # a chain of the trees' size, right before them
        (2, prefixes[2], tokens_of(7, 12), TREE),
        (3, prefixes[3], tokens_of(7, 13), TREE_B),
        (4, prefixes[4], tokens_of(7, 14), TREE),
    ]
    batch = RaggedBatch([r[0] for r in rows], [len(r[1]) for r in rows], [len(r[2]) for r in rows], "cpu",
                        dense_slack=slack, parents=[r[3] for r in rows])
    assert batch.blocks == ([(0, 1), (1, 2), (2, 5)] if slack else [(i, i + 1) for i in range(5)])
    got = m.logits(m(torch.tensor([x for r in rows for x in r[2]]), batch, cache))
    o = 0
    for _, prefix, new, parents in rows:
        for j in range(len(new)):
            seq = prefix + [new[a] for a in (path(parents, j) if parents else range(j + 1))]
            ref = t32.model(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(got[o + j], ref, rtol=1e-5, atol=1e-5)
        o += len(new)


def test_a_joined_tree_batch_is_the_same_batch(t32):
    """The engine joins a step's decode rows with its prompts: a tree batch joined with a prefill batch
    gives the logits of the one batch holding both."""
    m = BatchedLlama(t32.model, 48)
    prefix, new, prompt = tokens_of(8, 20), tokens_of(7, 21), tokens_of(5, 22)
    outs = []
    for joined in (False, True):
        cache = m.new_cache(2)
        m(torch.tensor(prefix), RaggedBatch([0], [0], [8], "cpu"), cache)
        tree = RaggedBatch([0], [8], [7], "cpu", parents=[TREE])
        pre = RaggedBatch([1], [0], [5], "cpu")
        batch = tree.join(pre) if joined else RaggedBatch([0, 1], [8, 0], [7, 5], "cpu", parents=[TREE, None])
        if joined:
            assert batch.parents == [TREE, None] and batch.rope_pos.tolist() == tree.rope_pos.tolist() + list(range(5))
        outs.append(m.logits(m(torch.tensor(new + prompt), batch, cache)))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    ref = t32.model(torch.tensor([prefix + [new[a] for a in path(TREE, 6)]])).logits[0, -1]
    torch.testing.assert_close(outs[0][6], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("slack", [0, 10_000])
def test_drafter_tree_rows_match_each_path_alone(eagle32, attn, slack):
    """BatchedEagleDrafter on two tree rows (consecutive slots): each node's predicted feature is the
    EagleDrafter's (transformers' layer) on ``prefix + path-to-node`` as one chain."""
    d = eagle32
    dm = BatchedEagleDrafter(d, torch.nn.Linear(d.hidden_size, d.vocab_size, bias=False), 48, attn)  # head unused
    cache = dm.new_cache(2)
    g = torch.Generator().manual_seed(7)
    lens = (9, 11)
    prefix_tok = [tokens_of(n, 30 + i) for i, n in enumerate(lens)]
    prefix_feat = [torch.randn(n, d.hidden_size, generator=g) for n in lens]
    dm(torch.tensor(prefix_tok[0] + prefix_tok[1]), torch.cat(prefix_feat), RaggedBatch([0, 1], [0, 0], list(lens), "cpu"),
       cache)
    trees = (TREE, TREE_B)
    new_tok = [tokens_of(7, 40 + i) for i in range(2)]
    new_feat = [torch.randn(7, d.hidden_size, generator=g) for _ in range(2)]
    batch = RaggedBatch([0, 1], list(lens), [7, 7], "cpu", dense_slack=slack, parents=list(trees))
    assert len(batch.blocks) == (1 if slack else 2)
    got = dm(torch.tensor(new_tok[0] + new_tok[1]), torch.cat(new_feat), batch, cache).view(2, 7, -1)
    with torch.no_grad():
        for r in range(2):
            for j in range(7):
                p = path(trees[r], j)
                ids = torch.tensor([prefix_tok[r] + [new_tok[r][a] for a in p]])
                feats = torch.cat([prefix_feat[r], new_feat[r][p]])[None]
                ref = d(ids, feats)[0, -1]
                torch.testing.assert_close(got[r, j], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_moving_an_accepted_path_leaves_the_chains_cache(t32, attn):
    """Two slots verify trees; their accepted paths (nodes [0, 2, 5] and [0, 1, 4]; the first moves onto its
    own positions) are moved into place in one call, pairs in any order. The cache then equals the one a chain forward over
    ``prefix + path`` writes, and the next token's logits are transformers'."""
    m = BatchedLlama(t32.model, 48, attn)
    prefixes = [tokens_of(8, 50), tokens_of(11, 51)]
    news = [tokens_of(7, 52), tokens_of(7, 53)]
    accepted = [[0, 2, 5], [0, 1, 4]]
    assert all(path(TREE, a[-1]) == a for a in accepted)
    nexts = [17, 23]  # the bonus tokens, decoded after the move
    cache = m.new_cache(2)
    starts = [len(p) for p in prefixes]
    m(torch.tensor(prefixes[0] + prefixes[1]), RaggedBatch([0, 1], [0, 0], starts, "cpu"), cache)
    m(torch.tensor(news[0] + news[1]), RaggedBatch([0, 1], starts, [7, 7], "cpu", parents=[TREE, TREE]), cache)
    # slot 0's pairs last-first: its node 5 lands on position start + 2 before node 2 is read from there,
    # which a copy one pair at a time would get wrong
    order = [[2, 1, 0], [0, 1, 2]]
    cache.move(torch.tensor([0, 0, 0, 1, 1, 1]),
               torch.tensor([s + acc[j] for s, acc, o in zip(starts, accepted, order) for j in o]),
               torch.tensor([s + j for s, o in zip(starts, order) for j in o]))
    got = m.logits(m(torch.tensor(nexts), RaggedBatch([0, 1], [s + 3 for s in starts], [1, 1], "cpu"), cache))

    chains = [p + [n[a] for a in acc] for p, n, acc in zip(prefixes, news, accepted)]
    ref_cache = m.new_cache(2)
    m(torch.tensor(chains[0] + chains[1]), RaggedBatch([0, 1], [0, 0], [len(c) for c in chains], "cpu"), ref_cache)
    for slot, c in enumerate(chains):
        torch.testing.assert_close(cache.k[:, slot, :, :len(c)], ref_cache.k[:, slot, :, :len(c)], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v[:, slot, :, :len(c)], ref_cache.v[:, slot, :, :len(c)], rtol=1e-5, atol=1e-5)
        ref = t32.model(torch.tensor([c + [nexts[slot]]])).logits[0, -1]
        torch.testing.assert_close(got[slot], ref, rtol=1e-5, atol=1e-5)
