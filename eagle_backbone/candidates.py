"""Candidate generation, kept apart from verification (as in transformers' ``candidate_generator.py``).

A candidate generator proposes draft chains for the engine's slots; the engine picks each draft token
from the distribution the generator gives (argmax, or a draw from the slot's random stream), asks the
policy whether to go on, verifies and rolls back. Three kinds ship:

* :class:`EagleCandidateGenerator`: the EAGLE-1 drafter, reading the target's features;
* :class:`Eagle3CandidateGenerator`: the EAGLE-3 drafter, reading three of the target's layers;
* :class:`DraftModelCandidateGenerator`: a standalone small causal LM (classic speculative decoding).

A new kind subclasses :class:`CandidateGenerator` and implements five calls over slot indices (host
lists) and device tensors. The engine binds its own shallow copy (:meth:`CandidateGenerator.bound`), so one
generator can serve several engines (a policy profiling its costs, the oracle's replay) while each copy
owns its per-slot caches.
"""

from __future__ import annotations

import copy
import weakref

import torch

from eagle_backbone.llama import BatchedEagleDrafter, BatchedLlama
from eagle_backbone.ragged import RaggedBatch, SlotCache, Span
from eagle_backbone.runtime import to_device
from eagle_backbone.target import TargetModel


class CandidateGenerator:
    """What proposes draft chains. Per-slot state lives on the copy :meth:`bound` returns.

    The engine calls, in a step, for the slots it runs:

    1. ``prefill(slots, tokens, batch, first, hidden)`` once when prompts are admitted: their tokens
       flattened (N,) as the rows of ``batch`` (a :class:`~eagle_backbone.ragged.RaggedBatch`: one row a
       prompt, from position 0), their first generated tokens (P,) and the target's hidden states (N, d);
    2. ``start(slots, tlens) -> (logits, states)``: the distribution of draft 1 (R, V) after the target's
       last accepted tokens (``tlens``: host ints, the position of each slot's last token), and the states
       behind it (R, d), or None when the generator has none (acceptance heads read them);
    3. ``extend(slots, tokens, tlens, depth, states) -> (logits, states)``: for the slots still drafting,
       the distribution of draft ``depth + 1`` after draft ``depth`` (``tokens`` (A,)); ``states`` are the
       rows' states from the previous call;
    4. ``settle(slots, tlens)`` after verification, with each slot's new last-token position: roll back
       what the target did not keep (set lengths; nothing is copied).

    Draft trees (:mod:`eagle_backbone.tree_draft`) call ``extend_tree`` instead of ``extend``: W frontier
    nodes a row at once, each seeing the slot's accepted prefix and its own ancestors fed at earlier depths.

    The engine's buffers a generator may read: ``engine.seq`` (slots, positions) tokens by position and,
    when ``needs_features``, ``engine.feat`` (slots, positions, F) the target's features by position: its last
    hidden state (F = d), or with ``feature_layers`` the states entering those layers, concatenated (F = k·d)."""

    kind = "base"
    needs_features = False  # True: the engine keeps the target's features by position
    feature_layers: tuple[int, ...] = ()  # the target layers whose entering states are the features (EAGLE-3);
    # () : the features are the target's last hidden state (EAGLE-1)

    def bound(self, engine) -> CandidateGenerator:
        """A shallow copy bound to ``engine`` (its slots, capacity and buffers), with its own caches."""
        out = copy.copy(self)
        # a weak reference: the engine owns its generator, not the other way round. A strong one made a cycle
        # (engine -> generator -> engine) that only the cyclic collector frees, so a benchmark building an engine
        # per run kept finished engines and their KV caches alive for minutes (8 GB on the long prompts)
        out.engine = weakref.proxy(engine)
        out.bind(engine)
        return out

    def bind(self, engine) -> None:
        """Allocate per-slot state for ``engine.slots`` slots of ``engine.limit + 1`` positions."""

    def prefill(self, slots, tokens, batch: RaggedBatch, first, hidden) -> None:
        raise NotImplementedError

    def start(self, slots: list[int], tlens: list[int]):
        raise NotImplementedError

    def extend(self, slots: list[int], tokens: torch.Tensor, tlens: list[int], depth: int, states):
        raise NotImplementedError

    def extend_tree(self, slots: list[int], tokens: torch.Tensor, tlens: list[int], depth: int, states,
                    offset: int, visible: torch.Tensor):
        """A draft tree's frontier at ``depth``: ``tokens`` (R, W) per row (``states`` (R, W, d) their
        parents' states, or None), fed at the generator's tree positions ``offset .. offset + W - 1`` (after
        ``offset`` nodes fed at earlier depths), each rotated as a chain draft of this depth and seeing the
        accepted prefix plus the fed nodes ``visible`` (R, W, offset + W) marks (its ancestors and itself).
        Returns the next depth's logits (R, W, V) and states (R, W, d) or None."""
        raise NotImplementedError(f"{type(self).__name__} does not grow draft trees")

    def settle(self, slots: list[int], tlens: list[int]) -> None:
        """Default: nothing to roll back (a generator that keeps only what the target accepted)."""


def _tree_batch(slots, tokens, tlens, depth: int, offset: int, visible, first: int) -> RaggedBatch:
    """The frontier of a tree as span rows: row b's W nodes at ``tlen + first + offset ..``, rotated at the
    position a chain draft of ``depth`` would sit (``tlen + first + depth - 1``), seeing the keys before
    ``tlen + first`` and the fed nodes ``visible`` marks."""
    R, W = tokens.shape
    base = [t + first for t in tlens]
    rope = [b + depth - 1 for b in base for _ in range(W)]
    return RaggedBatch(slots, [b + offset for b in base], [W] * R, tokens.device, span=Span(base, visible, rope))


def check_eagle_pair(drafter, target: TargetModel) -> None:
    """One-line errors for a drafter that cannot serve this target."""
    if drafter.hidden_size != target.hidden_size:
        raise ValueError(f"drafter hidden size {drafter.hidden_size} != target hidden size "
                         f"{target.hidden_size}: the drafter was trained for another target")
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(f"drafter vocabulary {drafter.vocab_size} != target vocabulary {target.vocab_size}")
    if not getattr(drafter, "has_own_embedding", True) and drafter.embed_tokens is not target.embed_tokens:
        raise ValueError("the drafter's checkpoint ships no embedding: tie the target's to it first "
                         "(eagle_backbone.loading.tie_drafter_embedding(drafter, target); load_pair does)")


class EagleCandidateGenerator(CandidateGenerator):
    """Chain drafting with an EAGLE-1 drafter. A drafter whose checkpoint ships no embedding must have
    the target's tied first (:func:`eagle_backbone.loading.tie_drafter_embedding`); constructing only checks.

    The drafter's cache holds only pairs (t_{j+1}, f_j) built from *true* target features: drafting
    writes its own predicted pairs past a slot's length, where the next step's true pairs overwrite them,
    as EAGLE does. So rollback is nothing at all: the length counts true pairs only."""

    kind = "eagle"
    needs_features = True

    def __init__(self, drafter, target: TargetModel, attn: str = "eager"):
        check_eagle_pair(drafter, target)
        self.drafter, self.target, self.lm_head, self.attn = drafter, target, target.lm_head, attn
        self.dtype = next(drafter.fc.parameters()).dtype

    def bind(self, engine):
        # a draft tree feeds up to engine.tree_room nodes past the positions a chain would write
        self.dm = BatchedEagleDrafter(self.drafter, self.lm_head, engine.limit + 1 + engine.tree_room, self.attn)
        self.cache: SlotCache = self.dm.new_cache(engine.slots)
        self.h_last = torch.zeros(engine.slots, self.target.hidden_size, dtype=self.dm.dtype, device=engine.device)
        self.fed = [0] * engine.slots  # true pairs in the cache, per slot

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
        e = self.engine
        batch = RaggedBatch(slots, [self.fed[b] for b in slots], [t - self.fed[b] for b, t in zip(slots, tlens)],
                            e.device)
        out = self.dm(e.seq[batch.slot_of, batch.pos + 1], e.feat[batch.slot_of, batch.pos], batch, self.cache)
        self.h_last[to_device(slots, e.device)] = out[batch.last()]
        for b, t in zip(slots, tlens):
            self.fed[b] = t

    def start(self, slots, tlens):
        pend = [(b, t) for b, t in zip(slots, tlens) if self.fed[b] < t]
        if pend:
            self._feed([b for b, _ in pend], [t for _, t in pend])
        rows = self.engine.rows(slots)
        state = self.h_last if rows is None else self.h_last[rows]
        return self.dm.logits(state), state

    def extend(self, slots, tokens, tlens, depth, states):
        # draft `depth`'s pair sits past the true pairs, where the next step's true pairs overwrite it
        batch = RaggedBatch(slots, [t + depth - 1 for t in tlens], [1] * len(slots), self.engine.device)
        out = self.dm.draft(tokens, states, batch, self.cache)
        return self.dm.logits(out), out

    def extend_tree(self, slots, tokens, tlens, depth, states, offset, visible):
        # the frontier's pairs (node token, its parent's predicted feature) sit past the true pairs, like chain
        # drafts: the next step's true pairs overwrite them
        R, W = tokens.shape
        batch = _tree_batch(slots, tokens, tlens, depth, offset, visible, 0)
        out = self.dm.draft(tokens.reshape(-1), states.reshape(R * W, -1), batch, self.cache)
        return self.dm.logits(out).view(R, W, -1), out.view(R, W, -1)


class Eagle3CandidateGenerator(EagleCandidateGenerator):
    """Chain and tree drafting with an EAGLE-3 drafter (:mod:`eagle_backbone.eagle3`): the engine keeps the
    states entering the drafter's target layers, fused by its fc for the true pairs; drafts feed the drafter's
    own states. Cache and rollback as EAGLE-1's: only true pairs count, drafted pairs are overwritten.
    The states it returns (acceptance heads, the LDLP) are the drafter's pre-norm states (R, d)."""

    kind = "eagle3"

    def __init__(self, drafter, target: TargetModel, attn: str = "eager"):
        check_eagle_pair(drafter, target)
        self.drafter, self.target, self.attn = drafter, target, attn
        self.feature_layers = drafter.aux_layers(target.model.config.num_hidden_layers)
        self.dtype = next(drafter.fc.parameters()).dtype

    def bind(self, engine):
        from eagle_backbone.eagle3 import BatchedEagle3Drafter

        self.dm = BatchedEagle3Drafter(self.drafter, engine.limit + 1 + engine.tree_room, self.attn)
        self.cache: SlotCache = self.dm.new_cache(engine.slots)
        self.h_last = torch.zeros(engine.slots, self.target.hidden_size, dtype=self.dm.dtype, device=engine.device)
        self.fed = [0] * engine.slots


class DraftModelCandidateGenerator(CandidateGenerator):
    """Chain drafting with an independent small causal LM sharing the target's vocabulary. Its cache
    holds the accepted tokens and the drafts it read; rollback keeps what the target kept."""

    kind = "draft_lm"

    def __init__(self, draft_model, target: TargetModel, attn: str = "eager"):
        vocab = draft_model.get_output_embeddings().weight.shape[0]
        if vocab != target.vocab_size:
            raise ValueError(f"draft model vocabulary {vocab} != target vocabulary {target.vocab_size}")
        self.model, self.target, self.attn = draft_model.eval(), target, attn

    def bind(self, engine):
        self.dm = BatchedLlama(self.model, engine.limit + 1 + engine.tree_room, self.attn)
        self.cache: SlotCache = self.dm.new_cache(engine.slots)
        self.logits_last = torch.zeros(engine.slots, self.target.vocab_size, dtype=self.dm.dtype,
                                       device=engine.device)
        self.fed = [0] * engine.slots  # tokens in the cache that the target accepted, per slot

    def prefill(self, slots, tokens, batch, first, hidden):
        # the draft LM reads each prompt and its first token: its logits there predict draft 1
        e = self.engine
        own = RaggedBatch(slots, [0] * len(slots), [n + 1 for n in batch.counts], e.device)
        last = own.last()
        prompt = torch.ones(own.n, dtype=torch.bool, device=e.device)
        prompt[last] = False
        ids = torch.zeros(own.n, dtype=tokens.dtype, device=e.device).masked_scatter_(prompt, tokens)
        ids[last] = first
        h = self.dm(ids, own, self.cache)
        self.logits_last[to_device(slots, e.device)] = self.dm.logits(h[last])
        for b, n in zip(slots, batch.counts):
            self.fed[b] = n + 1

    def _feed(self, slots, tlens):
        """The accepted tokens not yet read: positions fed .. tlen."""
        e = self.engine
        batch = RaggedBatch(slots, [self.fed[b] for b in slots], [t + 1 - self.fed[b] for b, t in zip(slots, tlens)],
                            e.device)
        out = self.dm(e.seq[batch.slot_of, batch.pos], batch, self.cache)
        self.logits_last[to_device(slots, e.device)] = self.dm.logits(out[batch.last()])
        for b, t in zip(slots, tlens):
            self.fed[b] = t + 1

    def start(self, slots, tlens):
        pend = [(b, t) for b, t in zip(slots, tlens) if self.fed[b] < t + 1]
        if pend:
            self._feed([b for b, _ in pend], [t for _, t in pend])
        rows = self.engine.rows(slots)
        return (self.logits_last if rows is None else self.logits_last[rows]), None

    def extend(self, slots, tokens, tlens, depth, states):
        batch = RaggedBatch(slots, [t + depth for t in tlens], [1] * len(slots), self.engine.device)
        out = self.dm(tokens, batch, self.cache)
        for b, t in zip(slots, tlens):
            self.fed[b] = t + depth + 1  # draft `depth` is in the cache now
        return self.dm.logits(out), None

    def extend_tree(self, slots, tokens, tlens, depth, states, offset, visible):
        # nodes go after the last accepted token (position tlen); ``fed`` stays tlen + 1, so settle() keeps
        # only the accepted tokens and the next step reads the kept drafts from the engine's tokens
        R, W = tokens.shape
        batch = _tree_batch(slots, tokens, tlens, depth, offset, visible, 1)
        out = self.dm(tokens.reshape(-1), batch, self.cache)
        return self.dm.logits(out).view(R, W, -1), None

    def settle(self, slots, tlens):
        for b, t in zip(slots, tlens):
            self.fed[b] = min(self.fed[b], t)  # drafts past the kept prefix are stale; the new last token is unread


def make_candidates(kind: str, drafter, target: TargetModel, attn: str = "eager") -> CandidateGenerator:
    """The shipped candidate generator for a drafter model of ``kind`` (eagle | eagle3 | draft_lm)."""
    if kind == "eagle":
        return EagleCandidateGenerator(drafter, target, attn)
    if kind == "eagle3":
        return Eagle3CandidateGenerator(drafter, target, attn)
    if kind == "draft_lm":
        return DraftModelCandidateGenerator(drafter, target, attn)
    raise ValueError(f"kind must be 'eagle', 'eagle3' or 'draft_lm' with a drafter model, got {kind!r}")
