"""Drafter kind ``draft_lm``: an independent small causal LM sharing the target's vocabulary (classic speculative
decoding)."""

from __future__ import annotations

import torch

from eagle_backbone.candidates import CandidateGenerator, DraftView, tree_batch
from eagle_backbone.drafter_kinds import register
from eagle_backbone.llama import BatchedLlama
from eagle_backbone.ragged import RaggedBatch, SlotCache
from eagle_backbone.runtime import to_device
from eagle_backbone.target import TargetModel


@register
class DraftModelCandidateGenerator(CandidateGenerator):
    """Chain drafting with an independent small causal LM sharing the target's vocabulary. Its cache
    holds the accepted tokens and the drafts it read; rollback keeps what the target kept. It has sizes of its
    own (no fit check before loading) and no labels."""

    kind = "draft_lm"
    causal_lm = True

    def __init__(self, draft_model, target: TargetModel, attn: str = "eager"):
        vocab = draft_model.get_output_embeddings().weight.shape[0]
        if vocab != target.vocab_size:
            raise ValueError(f"draft model vocabulary {vocab} != target vocabulary {target.vocab_size}")
        self.model, self.target, self.attn = draft_model.eval(), target, attn

    @classmethod
    def load(cls, path, dtype, device="cpu", trust_remote_code=False):
        return TargetModel.from_pretrained(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                           role="draft LM").model

    def bind(self, view: DraftView):
        self.dm = BatchedLlama(self.model, view.limit + 1 + view.tree_room, self.attn)
        self.cache: SlotCache = self.dm.new_cache(view.slots)
        self.logits_last = torch.zeros(view.slots, self.target.vocab_size, dtype=self.dm.dtype,
                                       device=view.device)
        self.fed = [0] * view.slots  # tokens in the cache that the target accepted, per slot

    def prefill(self, slots, tokens, batch, first, hidden):
        # the draft LM reads each prompt and its first token: its logits there predict draft 1
        v = self.view
        own = RaggedBatch(slots, [0] * len(slots), [n + 1 for n in batch.counts], v.device)
        last = own.last()
        prompt = torch.ones(own.n, dtype=torch.bool, device=v.device)
        prompt[last] = False
        ids = torch.zeros(own.n, dtype=tokens.dtype, device=v.device).masked_scatter_(prompt, tokens)
        ids[last] = first
        h = self.dm(ids, own, self.cache)
        self.logits_last[to_device(slots, v.device)] = self.dm.logits(h[last])
        for b, n in zip(slots, batch.counts):
            self.fed[b] = n + 1

    def _feed(self, slots, tlens):
        """The accepted tokens not yet read: positions fed .. tlen."""
        v = self.view
        batch = RaggedBatch(slots, [self.fed[b] for b in slots], [t + 1 - self.fed[b] for b, t in zip(slots, tlens)],
                            v.device)
        out = self.dm(v.seq[batch.slot_of, batch.pos], batch, self.cache)
        self.logits_last[to_device(slots, v.device)] = self.dm.logits(out[batch.last()])
        for b, t in zip(slots, tlens):
            self.fed[b] = t + 1

    def start(self, slots, tlens):
        pend = [(b, t) for b, t in zip(slots, tlens) if self.fed[b] < t + 1]
        if pend:
            self._feed([b for b, _ in pend], [t for _, t in pend])
        rows = self.view.rows(slots)
        return (self.logits_last if rows is None else self.logits_last[rows]), None

    def extend(self, slots, tokens, tlens, depth, states):
        batch = RaggedBatch(slots, [t + depth for t in tlens], [1] * len(slots), self.view.device)
        out = self.dm(tokens, batch, self.cache)
        for b, t in zip(slots, tlens):
            self.fed[b] = t + depth + 1  # draft `depth` is in the cache now
        return self.dm.logits(out), None

    def extend_tree(self, slots, tokens, tlens, depth, states, offset, visible):
        # nodes go after the last accepted token (position tlen); ``fed`` stays tlen + 1, so settle() keeps
        # only the accepted tokens and the next step reads the kept drafts from the engine's tokens
        R, W = tokens.shape
        batch = tree_batch(slots, tokens, tlens, depth, offset, visible, 1)
        out = self.dm(tokens.reshape(-1), batch, self.cache)
        return self.dm.logits(out).view(R, W, -1), None

    def settle(self, slots, tlens):
        for b, t in zip(slots, tlens):
            self.fed[b] = min(self.fed[b], t)  # drafts past the kept prefix are stale; the new last token is unread

    # ---- the kind: what the step-cost profiler runs (the LM reads tokens only) ---------------------------
    def profile_context(self, tokens, batch, g):
        self.dm(tokens, batch, self.cache)

    def profile_feed(self, tokens, batch, g):
        def run():
            self.dm.logits(self.dm(tokens, batch, self.cache)[batch.last()])
        return run

    def profile_draft(self, tokens, batch, g):
        def run():
            torch.softmax(self.dm.logits(self.dm(tokens, batch, self.cache)).float(), -1)
        return run
