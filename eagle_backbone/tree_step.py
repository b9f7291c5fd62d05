"""The phases of a speculative step for draft trees (a policy with a ``tree`` spec): grow a tree per row
(:func:`~eagle_backbone.tree_draft.grow_tree`), let the policy select what the target scores, verify the
selection as span rows of the step's one target forward, accept the longest path (greedy) or walk the tree
losslessly (sampling), and move the accepted path's keys and values to where a chain would have put them.
The outputs are the chain phases' records (:mod:`eagle_backbone.step_records`), so the engine's commit is
the chain's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_backbone.policy import TreeOutcome
from eagle_backbone.ragged import RaggedBatch, Span
from eagle_backbone.runtime import to_device
from eagle_backbone.sampling import probs_from_logits, sample_rows
from eagle_backbone.step_records import Acceptance, DraftRecord, Drafts, StepPlan, Verification
from eagle_backbone.tree import DraftTree, emitted_tokens, on_path, prune, tree_uniforms, tree_walk, verify_tree_greedy
from eagle_backbone.tree_draft import grow_tree


@dataclass
class _Walk:
    path: torch.Tensor  # (R, K) accepted nodes, root side first, -1 padded
    tested: torch.Tensor  # (R, K) bool: nodes the target judged


class TreePhases:
    """The tree phases, mixed into :class:`~eagle_backbone.batched_engine.BatchedSpeculativeEngine`: they read
    its generator (``cand``), policy, tree spec, buffers and cache, and score through its verification
    forward (``_score``)."""

    def _tree_phases(self, plan: StepPlan):
        """Grow a tree per row, let the policy select what the target scores, verify the selection as tree
        rows of the step's forward and accept the longest path (greedy) or walk it losslessly (sampling).
        Returns the chain phases' outputs, the hidden states reordered along the accepted path so that
        the commit is the chain's."""
        prof = self.prof
        grown = grow_tree(self.cand, plan.run, plan.tlens, plan.gammas, self.tree, self.sampling, plan.seeds,
                          plan.steps)
        prof.mark("draft")
        chosen = self.own.call(self.policy.select, grown, plan.view)
        # a row's scored nodes must fit its context: keep the first ones (a prefix of a topological order of
        # an ancestor-closed set is closed too)
        room = to_device([max(0, self.limit - 1 - t) for t in plan.tlens], self.device)
        chosen = chosen & grown.valid & (chosen.long().cumsum(1) <= room[:, None])
        prof.mark("policy")
        counts = chosen.sum(1)
        if self.early_exit:  # where a read is no synchronisation: score only the selected nodes
            drafted = counts.tolist()
            W = max(drafted)
        else:  # the selection stays a mask: every row scores up to the policy's bound, padding masked
            # (and within every row's context: the padded width is the whole batch's)
            room_all = max(0, self.limit - 1 - max(plan.tlens))
            W = min(grown.tokens.shape[1], self.policy.tree_width(plan.view), room_all)
            drafted = [W] * len(plan.run)
        tree, index = prune(grown.tree, chosen, width=W)
        drafts = Drafts(tree.tokens, drafted, lengths=None if self.early_exit else counts)
        R = len(plan.run)  # the drafter read one token a row at depth 1, then a frontier of ``width`` a row
        drafts.depth_rows = [R] + [R * self.tree.width] * (plan.max_gamma - 1)
        ver = self._verify_tree(plan, tree, drafted)
        q = None  # sampling: the distribution each scored node was drawn from
        if grown.q is not None:
            q = grown.q.gather(1, index.clamp(min=0)[..., None].expand(*index.shape, grown.q.shape[-1]))
        acc, walk = self._accept_tree(plan, tree, ver, q)
        self.own.call(self.policy.verified, TreeOutcome(grown, index, tree, walk.path, acc.accepted, walk.tested))
        # the target's states along the accepted path, root first: what a chain's verification would give
        root = torch.zeros(walk.path.shape[0], 1, dtype=walk.path.dtype, device=self.device)
        path_rows = torch.cat([root, walk.path + 1], 1).clamp(min=0)
        hidden = ver.hidden.gather(1, path_rows[..., None].expand(*path_rows.shape, ver.hidden.shape[-1]))
        feats = None if ver.feats is None else ver.feats.gather(
            1, path_rows[..., None].expand(*path_rows.shape, ver.feats.shape[-1]))
        self._move_path(plan, walk.path, acc.accepted)
        return drafts, Verification(ver.record, ver.logits, hidden, ver.tlens, ver.prefill, feats), acc

    def _verify_tree(self, plan: StepPlan, tree: DraftTree, drafted: list[int]) -> Verification:
        """One target forward: each row scores [last token, its W selected nodes] as span rows (the tree's
        mask, nodes rotated at their depth), prompts admitted this step after them."""
        tl = plan.tl
        tokens = torch.cat([self.seq[plan.rows, tl][:, None], tree.tokens], 1)
        span = Span(plan.tlens, tree.attention_mask(), tree.positions(tl))
        batch = RaggedBatch(plan.run, plan.tlens, [d + 1 for d in drafted], self.device, span=span)
        rec = DraftRecord(tree.tokens, tree.valid.sum(1), tree.parents)
        return self._score(rec, tokens, batch, tl)

    def _accept_tree(self, plan: StepPlan, tree: DraftTree, ver: Verification, q: torch.Tensor | None):
        """The longest greedy path, or the lossless walk over sampled siblings (``q`` (R, W, V): the
        distribution each scored node was drawn from)."""
        samp = self.sampling
        if samp.greedy:
            a, path, x = verify_tree_greedy(tree, ver.logits)
            # the nodes whose parent is the root or on the accepted path: the ones the target judged
            tested = tree.valid & on_path(path).gather(1, tree.parents + 1)
        else:
            u_acc, u_fin = tree_uniforms(plan.seeds, plan.steps, tree.K)
            walk = tree_walk(tree, probs_from_logits(ver.logits, samp), q, None, u_acc)
            a, path, tested = walk.accepted, walk.path, walk.tested
            x = sample_rows(walk.residual, u_fin)
        acc = Acceptance(a, x, emitted_tokens(tree, path, a, x))
        return acc, _Walk(path, tested)

    def _move_path(self, plan: StepPlan, path: torch.Tensor, accepted: torch.Tensor) -> None:
        """The accepted path's keys and values, written at ``tlen + 1 + node``, to ``tlen + 1 + depth - 1``,
        where a chain would have put them; the rest stays past the slot's length, unseen."""
        R, W = path.shape
        j = torch.arange(W, device=self.device)[None]
        on = j < accepted[:, None]
        base = plan.tl[:, None] + 1
        src = torch.where(on, base + path, self.trash)
        dst = torch.where(on, base + j, self.trash)
        self.tcache.move(plan.rows[:, None].expand(R, W).reshape(-1), src.reshape(-1), dst.reshape(-1))
