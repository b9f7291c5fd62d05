"""Prefill scheduling (the engine's ``prefill``): when, and beside what, the engine's target forwards read
the prompts admitted to its slots.

"chunked" (the default, vLLM's default scheduling): a step's target
forward scores at most ``max_batched_tokens`` tokens (2048 by default), the running rows' last tokens and
drafts first and then, in the room left, chunks of the prompts still being read, oldest admission first,
each a ragged row of the same batch (projections and MLPs over all tokens at once) starting where its slot's
prefill stopped (``Slot.prefilled``); when nothing runs, a step is the prompts' chunks alone. A chunk that
does not finish its prompt emits nothing and its slot is not running (the policy does not see it); the chunk
that finishes it picks the first token. "joined": a prompt admitted while other slots run is prefilled whole
inside the step's target forward. "separate": the new prompts' own forward, a step before the others'. In
every mode the drafter's prefill needs the first token, so it is a forward of its own right after the
target's, over the whole prompt (the target's features of earlier chunks read back from the engine's feature
buffer). Each sequence draws from its own random stream (its seed and step), so the schedule changes when a
prompt is read, not what a sampled sequence draws.

The schedule's methods are a mixin of :class:`~eagle_backbone.batched_engine.BatchedSpeculativeEngine`
(:class:`PrefillScheduling`): the engine's :meth:`~eagle_backbone.batched_engine.BatchedSpeculativeEngine.step`
runs a step of prompt chunks alone, and its verification (``_score``) puts chunks after the running rows.
"""

from __future__ import annotations

import time

import torch

from eagle_backbone.ragged import RaggedBatch
from eagle_backbone.runtime import to_device
from eagle_backbone.sampling import FINAL
from eagle_backbone.step_records import HostRead

PREFILL_MODES = ("joined", "chunked", "separate")
PREFILL_DEFAULT = "chunked"  # the engine's schedule unless it is given one (vLLM's default scheduling)
MAX_BATCHED_TOKENS = 2048  # chunked prefill's token budget per target forward (docs/batched.md#chunked-prefill)
MAX_DRAFT = 32  # the most drafts the engine scores for one row in a step unless it is given another cap


def check_prefill(prefill, max_batched_tokens) -> None:
    """One-line errors for a prefill schedule the engine does not have."""
    if prefill not in PREFILL_MODES:
        raise ValueError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {prefill!r}")
    if not isinstance(max_batched_tokens, int) or isinstance(max_batched_tokens, bool) or max_batched_tokens < 1:
        raise ValueError(f"max_batched_tokens must be an integer >= 1, got {max_batched_tokens!r}")


class PrefillScheduling:
    """The engine's prefill methods, mixed into
    :class:`~eagle_backbone.batched_engine.BatchedSpeculativeEngine`: they read and write its slots
    (``state``), the queue of prompts being read (``_admitted``), its buffers (``seq``, ``feat``,
    ``last_feat``) and its generator's prefill, and call its target forward (``_forward``), token pick
    (``_pick``), planning ahead (``_plan_ahead``) and emission (``_emit``)."""

    def _take_chunks(self, budget: int | None) -> list[tuple[int, int, int]]:
        """The prompt chunks this forward reads, as (slot, start, count): the admitted prompts oldest first,
        each from where its prefill stopped, within ``budget`` tokens (None: every prompt whole)."""
        chunks = []
        for b in self._admitted:
            s = self.state[b]
            n = len(s.prompt) - s.prefilled
            if budget is not None:
                n = min(n, budget)
                budget -= n
            if n <= 0:
                break
            chunks.append((b, s.prefilled, n))
        return chunks

    def _prefill_batch(self, chunks: list[tuple[int, int, int]]):
        """The chunks as ragged rows (nothing padded): their flat tokens (N,) and the batch."""
        tok = to_device([t for b, a, n in chunks for t in self.state[b].prompt[a: a + n]], self.device)
        return tok, RaggedBatch([b for b, _, _ in chunks], [a for _, a, _ in chunks], [n for _, _, n in chunks],
                                self.device)

    def _prefill(self, chunks: list[tuple[int, int, int]]):
        """A step of prompt chunks alone (the target's forward, then the drafter's for finished prompts):
        the slots whose prompt finished and what the host reads."""
        tok, batch = self._prefill_batch(chunks)
        return self._prefill_finish(chunks, tok, batch, *self._forward(tok, batch))

    def _prefill_finish(self, chunks, tok, batch: RaggedBatch, h, f=None) -> tuple[list[int], dict[str, torch.Tensor]]:
        """After the target read the chunks (``h`` (N, d): their hidden states; ``f`` the generator's features
        when not ``h``): bookkeeping, and for the prompts now read to their end the first tokens and the
        drafter's own prefill (it needs the first token, so it cannot ride in the target's forward). Returns
        those slots and the device tensors the host reads: their first tokens and a planned-ahead γ."""
        dev = self.device
        self.seq[batch.slot_of, batch.pos] = tok
        keep_features = self.cand is not None and self.cand.needs_features
        if keep_features:
            self.feat[batch.slot_of, batch.pos] = h if f is None else f
        ends = []  # the rows whose chunk finishes its prompt
        for i, (b, a, n) in enumerate(chunks):
            s = self.state[b]
            s.prefilled = a + n
            s.stats.target_forwards += 1
            if s.prefilled == len(s.prompt):
                ends.append(i)
        if not ends:
            return [], {}
        slots = [chunks[i][0] for i in ends]
        self._admitted = [b for b in self._admitted if b not in slots]
        st = [self.state[b] for b in slots]
        whole = len(ends) == len(chunks) and all(a == 0 for _, a, _ in chunks)  # the batch is the prompts
        last = h[batch.last()] if len(ends) == len(chunks) else h[to_device([batch.ends[i] - 1 for i in ends], dev)]
        seeds = steps = None  # the first token's stream (sampling only: greedy draws nothing)
        if not self.sampling.greedy:
            seeds = to_device([s.seed for s in st], dev)
            steps = torch.zeros(len(slots), dtype=torch.long, device=dev)
        x, _ = self._pick(self.tm.logits(last), seeds, steps, FINAL, False)
        ridx = to_device(slots, dev)
        self.seq[ridx, to_device([len(s.prompt) for s in st], dev)] = x
        self.last_feat[ridx] = last
        if self.cand is not None:
            if whole:
                ptok, pbatch, pf = tok, batch, h if f is None else f
            else:  # the whole prompts: earlier chunks' tokens and features as the engine stored them
                pbatch = RaggedBatch(slots, [0] * len(slots), [len(s.prompt) for s in st], dev)
                ptok = self.seq[pbatch.slot_of, pbatch.pos]
                pf = self.feat[pbatch.slot_of, pbatch.pos] if keep_features else None
            self.cand.prefill(slots, ptok, pbatch, x, pf)
        for s in st:
            s.tlen = len(s.prompt)
        reads = {"first_tokens": x}
        if self.policy.plans_ahead and self.kind is not None:
            ahead = self._plan_ahead(slots, st, x, last)
            if ahead is not None:
                reads["gamma_first"] = ahead
        return slots, reads

    def _first_tokens(self, slots, host: HostRead, finished):
        """On the host, after the read: each finished prompt's first token emitted, a planned-ahead γ kept."""
        now = time.perf_counter()
        for i, (b, t) in enumerate(zip(slots, host["first_tokens"])):
            s = self.state[b]
            self._emit(b, s, [t], now, finished)
            if "gamma_first" in host:
                s.gamma_next = host["gamma_first"][i]
