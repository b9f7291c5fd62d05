"""Candidate generation, kept apart from verification (as in transformers' ``candidate_generator.py``).

A candidate generator proposes draft chains for the engine's slots; the engine picks each draft token
from the distribution the generator gives (argmax, or a draw from the slot's random stream), asks the
policy whether to go on, verifies and rolls back. This module holds what every drafter kind shares: the
interface (:class:`CandidateGenerator`), the view of the engine's buffers a bound generator reads
(:class:`DraftView`) and helpers. Each drafter kind is one class in one file of :mod:`eagle_backbone.kinds`
(EAGLE-1 ``eagle``, EAGLE-3 ``eagle3``, the standalone draft LM ``draft_lm``), registered by name in
:mod:`eagle_backbone.drafter_kinds`: it loads its weights, checks that they fit the target, drafts, says what
the step-cost profiler runs to time it and which label collections label it.

A new kind subclasses :class:`CandidateGenerator` and implements five calls over slot indices (host
lists) and device tensors. The engine binds its own shallow copy (:meth:`CandidateGenerator.bound`), so one
generator can serve several engines (a policy profiling its costs, the oracle's replay) while each copy
owns its per-slot caches.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from eagle_backbone.ragged import RaggedBatch, Span
from eagle_backbone.runtime import to_device
from eagle_backbone.target import TargetModel


@dataclass(frozen=True)
class DraftView:
    """What of the engine a bound generator may read: ``seq`` (slots, positions) the tokens by position,
    ``feat`` (slots, positions, F) the target's features by position when the generator ``needs_features``
    (else None), the device, the slot count, the positions a slot may use (``limit``: caches of ``limit + 1``
    positions, plus ``tree_room`` for the nodes a draft tree feeds past them) and the target's vocabulary (the
    width of the logits a generator returns). The tensors are the engine's own, written in place, never copied."""

    seq: torch.Tensor
    feat: torch.Tensor | None
    device: torch.device
    slots: int
    limit: int
    tree_room: int
    vocab_size: int

    @classmethod
    def of(cls, engine) -> DraftView:
        return cls(engine.seq, getattr(engine, "feat", None), engine.device, engine.slots, engine.limit,
                   engine.tree_room, engine.target.vocab_size)

    def rows(self, slots: list[int]):
        """An index tensor for a row subset, or None when the rows are all slots in order (views, no gather)."""
        if slots == list(range(self.slots)):
            return None
        return to_device(slots, self.device)


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

    What a bound generator reads of the engine is its :class:`DraftView` (``self.view``): ``seq`` tokens by
    position and, when ``needs_features``, ``feat`` the target's features by position: its last hidden state
    (F = d), or with ``feature_layers`` the states entering those layers, concatenated (F = k·d).

    A drafter kind (:mod:`eagle_backbone.drafter_kinds`) is a subclass registered under its ``kind``; besides the
    calls above it says how its weights load (:meth:`load`, :meth:`check_fits`), what the step-cost profiler runs
    to time its forwards (:meth:`profile_context`, :meth:`profile_feed`, :meth:`profile_draft`) and which label
    collections label it (``labelled_by``, ``oracle_rows``). Constructed as ``cls(drafter, target, attn)``."""

    kind = "base"
    needs_features = False  # True: the engine keeps the target's features by position
    feature_layers: tuple[int, ...] = ()  # the target layers whose entering states are the features (EAGLE-3);
    # () : the features are the target's last hidden state (EAGLE-1)
    # the label collections (ldlp.labels) that label this kind: "oracle" (oracle draft lengths), "acceptance"
    # (the acceptance head's labels, read from the drafter's states)
    labelled_by: tuple[str, ...] = ()
    # how the oracle collector drafts its rows: the name of one of ldlp.labels.oracle's recipes ("eagle", "eagle3")
    # or a callable with oracle_labels' arguments and rows; None: not labelled by the oracle
    oracle_rows = None
    vllm_method: str | None = None  # vLLM's speculative method that serves this drafter (ldlp.bench.peers.vllm_peer)
    causal_lm = False  # the drafter is a standalone causal LM (transformers' assisted generation runs it)

    # ---- the kind: weights -----------------------------------------------------------------------
    @classmethod
    def load(cls, path, dtype: str, device: str = "cpu", trust_remote_code: bool = False):
        """The drafter model in folder ``path``, what ``cls(drafter, target, attn)`` takes; ``dtype`` a name
        (``float32``, ``bfloat16``, ...: ``auto`` resolved for the device)."""
        raise NotImplementedError(f"drafter kind {cls.kind!r} loads no weights")

    @classmethod
    def check_fits(cls, drafter, target) -> None:
        """Refuse, in one line, a drafter folder that cannot serve the target folder, read before either loads
        (default: nothing to check)."""

    @classmethod
    def train(cls, cfg):
        """Train a drafter of this kind (``scripts/train_drafter.py`` with ``drafter_training.kind`` naming it, ``cfg``
        its config); returns the run's summary."""
        raise NotImplementedError(f"drafter kind {cls.kind!r} has no training recipe in scripts/train_drafter.py")

    # ---- the kind: the features the engine keeps for it, and what the step-cost profiler runs ---------------
    def feature_width(self, hidden_size: int) -> int:
        """F, the width of the target's features this generator reads by position (the engine's ``feat``)."""
        return hidden_size * max(1, len(self.feature_layers))

    @classmethod
    def profiles(cls) -> bool:
        """Whether the kind gives the step-cost profiler its forwards (:meth:`profile_feed`, :meth:`profile_draft`)."""
        return cls.profile_feed is not CandidateGenerator.profile_feed

    def profile_context(self, tokens, batch: RaggedBatch, g: torch.Generator) -> None:
        """Fill the bound generator's caches with a context of ``tokens`` as rows of ``batch`` (random inputs
        it needs besides the tokens drawn from ``g``)."""
        raise NotImplementedError(f"drafter kind {self.kind!r} gives the cost profiler no forwards")

    def profile_feed(self, tokens, batch: RaggedBatch, g: torch.Generator):
        """A callable timing the catch-up forward over ``tokens`` as rows of ``batch`` after the context, with
        the LM head at each row's last position; its random inputs drawn from ``g`` now, not in the call."""
        raise NotImplementedError(f"drafter kind {self.kind!r} gives the cost profiler no forwards")

    def profile_draft(self, tokens, batch: RaggedBatch, g: torch.Generator):
        """A callable timing one draft depth: a forward of one token a row (``batch``), LM head and softmax."""
        raise NotImplementedError(f"drafter kind {self.kind!r} gives the cost profiler no forwards")

    def bound(self, engine) -> CandidateGenerator:
        """A shallow copy bound to ``engine`` (its slots, capacity and buffers), with its own caches."""
        out = copy.copy(self)
        # the view holds the engine's buffers, not the engine: the engine owns its generator, not the other way
        # round (a reference back made a cycle that only the cyclic collector frees, so a benchmark building an
        # engine per run kept finished engines and their KV caches alive for minutes: 8 GB on the long prompts)
        out.view = DraftView.of(engine)
        out.bind(out.view)
        return out

    def bind(self, view: DraftView) -> None:
        """Allocate per-slot state for ``view.slots`` slots of ``view.limit + 1`` positions."""

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


def tree_batch(slots, tokens, tlens, depth: int, offset: int, visible, first: int) -> RaggedBatch:
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
