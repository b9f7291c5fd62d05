"""How often the target keeps each of the drafter's choices: kept/tested counts by depth and sibling rank,
from decoding with full draft trees (every grown node scored). What decides whether tree siblings can pay
(docs/trees.md): a node is *tested* when its parent was accepted, *kept* when it is on the accepted path."""

from __future__ import annotations

import torch

from eagle_backbone.policy import TreeOutcome, TreePolicy
from eagle_backbone.tree_draft import TreeSpec
from ldlp.bench.harness.engines import EngineFactory


class _FullTree(TreePolicy):
    """Scores every grown node of ``spec`` to its full depth; counts the outcomes by (depth, rank)."""

    name = "full_tree"

    def __init__(self, spec: TreeSpec):
        self.tree = spec
        self.kept = torch.zeros(spec.depth, spec.top_k, dtype=torch.long)
        self.tested = torch.zeros_like(self.kept)

    def plan(self, rows):
        return [self.tree.depth] * len(rows)

    def verified(self, o: TreeOutcome) -> None:
        idx = o.index.clamp(min=0)
        tested = o.tested & (o.index >= 0)
        cell = (o.grown.depth.gather(1, idx) - 1) * self.tree.top_k + o.grown.rank.gather(1, idx)
        n = self.kept.numel()
        self.tested += torch.bincount(cell[tested], minlength=n).view_as(self.tested).cpu()
        self.kept += torch.bincount(cell[tested & o.kept], minlength=n).view_as(self.kept).cpu()


def choice_rates(target, candidates, prompts: list[list[int]], top_k: int, depth: int, max_new_tokens: int,
                 slots: int = 1, sampling=None) -> dict:
    """Decode ``prompts`` with width-1 trees of ``top_k`` children a node to ``depth`` (every node scored):
    per (depth, rank) the tested and kept counts and the rate, and per rank over all depths."""
    policy = _FullTree(TreeSpec(top_k, depth, width=1))
    engine = EngineFactory(target, candidates)(slots, policy, sampling)
    for i in range(0, len(prompts), slots):
        batch = prompts[i: i + slots]
        engine.generate(batch, max_new_tokens, seeds=list(range(i, i + len(batch))))
    kept, tested = policy.kept.tolist(), policy.tested.tolist()
    cells = [{"depth": d + 1, "rank": r, "tested": tested[d][r], "kept": kept[d][r],
              "rate": kept[d][r] / tested[d][r] if tested[d][r] else None}
             for d in range(depth) for r in range(top_k)]
    by_rank = []
    for r in range(top_k):
        n, k = sum(t[r] for t in tested), sum(x[r] for x in kept)
        by_rank.append({"rank": r, "tested": n, "kept": k, "rate": k / n if n else None})
    return {"top_k": top_k, "depth": depth, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "slots": slots, "cells": cells, "by_rank": by_rank}
