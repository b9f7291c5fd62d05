"""Drafter kind ``eagle``: an EAGLE-1 drafter (:mod:`eagle_backbone.drafter`), drafting chains and trees from the
target's last hidden states."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle_backbone.candidates import CandidateGenerator, DraftView, check_eagle_pair, tree_batch
from eagle_backbone.drafter import EagleDrafter
from eagle_backbone.drafter_kinds import register
from eagle_backbone.llama import BatchedEagleDrafter
from eagle_backbone.loading import check_verifier
from eagle_backbone.ragged import RaggedBatch, SlotCache
from eagle_backbone.runtime import to_device
from eagle_backbone.target import TargetModel


@register
class EagleCandidateGenerator(CandidateGenerator):
    """Chain drafting with an EAGLE-1 drafter. A drafter whose checkpoint ships no embedding must have
    the target's tied first (:func:`eagle_backbone.loading.tie_drafter_embedding`); constructing only checks.

    The drafter's cache holds only pairs (t_{j+1}, f_j) built from *true* target features: drafting
    writes its own predicted pairs past a slot's length, where the next step's true pairs overwrite them,
    as EAGLE does. So rollback is nothing at all: the length counts true pairs only."""

    kind = "eagle"
    needs_features = True
    labelled_by = ("oracle", "acceptance")
    oracle_rows = "eagle"
    vllm_method = "eagle"

    def __init__(self, drafter, target: TargetModel, attn: str = "eager"):
        check_eagle_pair(drafter, target)
        self.drafter, self.target, self.lm_head, self.attn = drafter, target, target.lm_head, attn
        self.dtype = next(drafter.fc.parameters()).dtype

    # ---- the kind: weights -----------------------------------------------------------------------
    @classmethod
    def load(cls, path, dtype, device="cpu", trust_remote_code=False):
        return EagleDrafter.from_pretrained(path, dtype=dtype, device=device)

    @classmethod
    def check_fits(cls, drafter, target) -> None:
        """An EAGLE drafter reads the target's hidden states and tokens: its ``hidden_size`` and ``vocab_size``
        must be the target's. Read from the two ``config.json`` files before either model loads; a mismatch is
        one line naming both sizes and both files; a head that names the target it was trained for must name this
        one (:func:`~eagle_backbone.loading.check_verifier`)."""
        files = Path(drafter) / "config.json", Path(target) / "config.json"
        try:
            raw_d, raw_t = (json.loads(f.read_text()) for f in files)
        except (OSError, ValueError):
            return  # an unreadable config is the loader's to report
        layer = raw_d.get("transformer_layer_config") or raw_d  # speculators' layout nests the layer's config
        for key in ("hidden_size", "vocab_size"):
            d, t = layer.get(key), raw_t.get(key)
            if d is not None and t is not None and d != t:
                raise ValueError(f"{files[0]}: {key} {d} differs from the target's {t} ({files[1]}); an {cls.kind} "
                                 f"drafter needs the target's {key}")
        check_verifier(files[0], raw_d, target, raw_t)

    @classmethod
    def train(cls, cfg):
        from eagle_backbone.train.drafter import run_drafter_training

        return run_drafter_training(cfg)

    # ---- drafting --------------------------------------------------------------------------------
    def bind(self, view: DraftView):
        # a draft tree feeds up to view.tree_room nodes past the positions a chain would write
        self.dm = BatchedEagleDrafter(self.drafter, self.lm_head, view.limit + 1 + view.tree_room, self.attn)
        self.cache: SlotCache = self.dm.new_cache(view.slots)
        self.h_last = torch.zeros(view.slots, self.target.hidden_size, dtype=self.dm.dtype, device=view.device)
        self.fed = [0] * view.slots  # true pairs in the cache, per slot

    def prefill(self, slots, tokens, batch, first, hidden):
        # pairs (t_{j+1}, f_j), j < n: each prompt shifted by one, the first generated token closing it
        last = batch.last()
        nxt = torch.cat([tokens[1:], tokens[:1]])
        nxt[last] = first
        out = self.dm(nxt, hidden, batch, self.cache)
        self.h_last[to_device(slots, tokens.device)] = out[last]
        for b, n in zip(slots, batch.counts):
            self.fed[b] = n

    def _feed(self, slots, tlens):
        """The pairs the target accepted since the last step: positions fed .. tlen - 1."""
        v = self.view
        batch = RaggedBatch(slots, [self.fed[b] for b in slots], [t - self.fed[b] for b, t in zip(slots, tlens)],
                            v.device)
        out = self.dm(v.seq[batch.slot_of, batch.pos + 1], v.feat[batch.slot_of, batch.pos], batch, self.cache)
        self.h_last[to_device(slots, v.device)] = out[batch.last()]
        for b, t in zip(slots, tlens):
            self.fed[b] = t

    def start(self, slots, tlens):
        pend = [(b, t) for b, t in zip(slots, tlens) if self.fed[b] < t]
        if pend:
            self._feed([b for b, _ in pend], [t for _, t in pend])
        rows = self.view.rows(slots)
        state = self.h_last if rows is None else self.h_last[rows]
        return self.dm.logits(state), state

    def extend(self, slots, tokens, tlens, depth, states):
        # draft `depth`'s pair sits past the true pairs, where the next step's true pairs overwrite it
        batch = RaggedBatch(slots, [t + depth - 1 for t in tlens], [1] * len(slots), self.view.device)
        out = self.dm.draft(tokens, states, batch, self.cache)
        return self.dm.logits(out), out

    def extend_tree(self, slots, tokens, tlens, depth, states, offset, visible):
        # the frontier's pairs (node token, its parent's predicted feature) sit past the true pairs, like chain
        # drafts: the next step's true pairs overwrite them
        R, W = tokens.shape
        batch = tree_batch(slots, tokens, tlens, depth, offset, visible, 0)
        out = self.dm.draft(tokens.reshape(-1), states.reshape(R * W, -1), batch, self.cache)
        return self.dm.logits(out).view(R, W, -1), out.view(R, W, -1)

    # ---- the kind: what the step-cost profiler runs ----------------------------------------------------------
    # a true pair brings the target's features (feature_width: the last layer's, or EAGLE-3's chosen layers side by
    # side, fused by the drafter's fc); a draft depth reads a drafter state (the hidden size)
    def profile_context(self, tokens, batch, g):
        feats = torch.randn(len(tokens), self.feature_width(self.target.hidden_size), generator=g)
        self.dm(tokens, feats.to(tokens.device, self.target.dtype), batch, self.cache)

    def profile_feed(self, tokens, batch, g):
        f = torch.randn(len(tokens), self.feature_width(self.target.hidden_size), generator=g).to(
            tokens.device, self.target.dtype)

        def run():
            out = self.dm(tokens, f, batch, self.cache)
            self.dm.logits(out[batch.last()])
        return run

    def profile_draft(self, tokens, batch, g):
        s = torch.randn(len(tokens), self.target.hidden_size, generator=g).to(tokens.device, self.target.dtype)
        step = self.profiled_draft_step()

        def run():
            torch.softmax(self.dm.logits(step(tokens, s, batch, self.cache)).float(), -1)
        return run

    def profiled_draft_step(self):
        """The forward the profiler times for a draft depth (EAGLE-1: the drafter's forward)."""
        return self.dm
