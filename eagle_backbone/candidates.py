"""Candidate generation, kept apart from verification (as in transformers' ``candidate_generator.py``).

A candidate generator proposes a chain of draft tokens and is told afterwards how much of it the
target kept. Two kinds drive the same engine:

* :class:`EagleCandidateGenerator`: the EAGLE-1 drafter, reading the target's features;
* :class:`DraftModelCandidateGenerator`: a standalone small causal LM (classic speculative decoding).
"""

from __future__ import annotations

from typing import Callable

import torch

from eagle_backbone.sampling import SamplingConfig, probs_from_logits, sample
from eagle_backbone.target import TargetModel, new_cache, rollback

# keep(i, token, probs, state) -> bool: asked after drafted token i (1-based); False ends the chain.
# ``state`` is the drafter's hidden state that ``probs`` came from (what its LM head read), or None when
# the generator has none to offer; acceptance heads read it.
KeepFn = Callable[[int, int, torch.Tensor, "torch.Tensor | None"], bool]


class CandidateGenerator:
    kind = "base"

    def start(self, prompt_ids: list[int], features: torch.Tensor) -> None:
        """A new sequence: ``features`` (n, d) are the target's features for the prompt."""
        raise NotImplementedError

    def propose(self, tokens: list[int], gamma: int, keep: KeepFn, sampling: SamplingConfig,
                rng: torch.Generator | None) -> tuple[list[int], list[torch.Tensor]]:
        """Draft up to ``gamma`` tokens after ``tokens``; returns them and the distribution each
        was drawn from (greedy: the drafter's softmax, for policies to read)."""
        raise NotImplementedError

    def commit(self, valid_len: int, new_features: torch.Tensor) -> None:
        """After verification: the first ``valid_len`` tokens of the sequence are final and the
        target produced ``new_features`` (m, d) for the positions it just accepted."""
        raise NotImplementedError


def _pick(logits: torch.Tensor, sampling: SamplingConfig, rng) -> tuple[int, torch.Tensor]:
    probs = probs_from_logits(logits, sampling)
    return (int(probs.argmax()) if sampling.greedy else sample(probs, rng)), probs


class EagleCandidateGenerator(CandidateGenerator):
    """Chain drafting with an EAGLE-1 drafter. A drafter whose checkpoint ships no embedding must have
    the target's tied first (:func:`eagle_backbone.loading.tie_drafter_embedding`); constructing only checks.

    The drafter's cache holds only pairs built from *true* target features; the pairs built from its
    own predicted features during drafting are rolled back at commit and replaced by the target's
    features for the accepted tokens, as EAGLE does.
    """

    kind = "eagle"

    def __init__(self, drafter, target: TargetModel):
        if drafter.hidden_size != target.hidden_size:
            raise ValueError(f"drafter hidden size {drafter.hidden_size} != target hidden size "
                             f"{target.hidden_size}: the drafter was trained for another target")
        if drafter.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocabulary {drafter.vocab_size} != target vocabulary {target.vocab_size}")
        if not getattr(drafter, "has_own_embedding", True) and drafter.embed_tokens is not target.embed_tokens:
            raise ValueError("the drafter's checkpoint ships no embedding: tie the target's to it first "
                             "(eagle_backbone.loading.tie_drafter_embedding(drafter, target); load_pair does)")
        self.drafter, self.lm_head = drafter, target.lm_head
        self.dtype = next(drafter.fc.parameters()).dtype

    def start(self, prompt_ids, features):
        self.cache = self.drafter.new_cache()
        self.fed = 0  # pairs (t_{j+1}, f_j) in the cache, all from true features
        self.pending = [features]

    @torch.inference_mode()
    def propose(self, tokens, gamma, keep, sampling, rng):
        n = len(tokens)
        ids = torch.tensor([tokens[self.fed + 1: n]], device=self.pending[0].device)
        feats = torch.cat(self.pending).to(self.dtype)[None]
        h = self.drafter(ids, feats, self.cache)[:, -1:]
        self.fed, self.pending = n - 1, []
        draft, dists = [], []
        for i in range(1, gamma + 1):
            state = h.to(self.lm_head.weight.dtype)
            tok, probs = _pick(self.lm_head(state)[0, -1], sampling, rng)
            draft.append(tok)
            dists.append(probs)
            if i == gamma or not keep(i, tok, probs, state[0, -1]):
                break
            h = self.drafter(torch.tensor([[tok]], device=ids.device), h, self.cache)
        return draft, dists

    def commit(self, valid_len, new_features):
        rollback(self.cache, self.fed)
        self.pending.append(new_features)


class DraftModelCandidateGenerator(CandidateGenerator):
    """Chain drafting with an independent small causal LM sharing the target's vocabulary."""

    kind = "draft_lm"

    def __init__(self, draft_model, target: TargetModel):
        vocab = draft_model.get_output_embeddings().weight.shape[0]
        if vocab != target.vocab_size:
            raise ValueError(f"draft model vocabulary {vocab} != target vocabulary {target.vocab_size}")
        self.model = draft_model.eval()

    def start(self, prompt_ids, features):
        self.cache = new_cache(self.model)
        self.cached = 0

    @torch.inference_mode()
    def propose(self, tokens, gamma, keep, sampling, rng):
        device = self.model.get_output_embeddings().weight.device
        ids = torch.tensor([tokens[self.cached:]], device=device)
        draft, dists = [], []
        for i in range(1, gamma + 1):
            logits = self.model(input_ids=ids, cache=self.cache, use_cache=True).logits[0, -1]
            self.cached += ids.shape[1]
            tok, probs = _pick(logits, sampling, rng)
            draft.append(tok)
            dists.append(probs)
            if i == gamma or not keep(i, tok, probs, None):
                break
            ids = torch.tensor([[tok]], device=device)
        return draft, dists

    def commit(self, valid_len, new_features):
        self.cached = min(self.cached, valid_len)
        rollback(self.cache, self.cached)
