"""Drafter kind ``eagle3``: an EAGLE-3 drafter (:mod:`eagle_backbone.eagle3`), reading three of the target's layers."""

from __future__ import annotations

import torch

from eagle_backbone.candidates import DraftView, check_eagle_pair
from eagle_backbone.drafter_kinds import register
from eagle_backbone.eagle3 import BatchedEagle3Drafter, Eagle3Drafter
from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.ragged import SlotCache
from eagle_backbone.target import TargetModel


@register
class Eagle3CandidateGenerator(EagleCandidateGenerator):
    """Chain and tree drafting with an EAGLE-3 drafter (:mod:`eagle_backbone.eagle3`): the engine keeps the
    states entering the drafter's target layers, fused by its fc for the true pairs; drafts feed the drafter's
    own states. Cache and rollback as EAGLE-1's: only true pairs count, drafted pairs are overwritten.
    The states it returns (acceptance heads, the LDLP) are the drafter's pre-norm states (R, d).
    Its weights: EAGLE's layout or speculators' (config.json says which); the fit check is EAGLE-1's."""

    kind = "eagle3"
    labelled_by = ("oracle",)
    oracle_rows = "eagle3"  # ldlp.labels.oracle.oracle_labels_eagle3, on the engine's EAGLE-3 code
    vllm_method = "eagle3"

    def __init__(self, drafter, target: TargetModel, attn: str = "eager"):
        check_eagle_pair(drafter, target)
        self.drafter, self.target, self.attn = drafter, target, attn
        self.feature_layers = drafter.aux_layers(target.model.config.num_hidden_layers)
        self.dtype = next(drafter.fc.parameters()).dtype

    @classmethod
    def load(cls, path, dtype, device="cpu", trust_remote_code=False):
        return Eagle3Drafter.from_pretrained(path, dtype=dtype, device=device)

    @classmethod
    def train(cls, cfg):
        from eagle_backbone.train.eagle3 import run_eagle3_training

        return run_eagle3_training(cfg)

    def bind(self, view: DraftView):
        self.dm = BatchedEagle3Drafter(self.drafter, view.limit + 1 + view.tree_room, self.attn)
        self.cache: SlotCache = self.dm.new_cache(view.slots)
        self.h_last = torch.zeros(view.slots, self.target.hidden_size, dtype=self.dm.dtype, device=view.device)
        self.fed = [0] * view.slots

    def profiled_draft_step(self):
        return self.dm.draft  # EAGLE-3 drafts on its own state
