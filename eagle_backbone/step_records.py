"""The records a speculative step passes between its phases: the plan (:class:`StepPlan`), the drafts
(:class:`Drafts`, :class:`DraftRecord`), the verification (:class:`Verification`), the acceptance
(:class:`Acceptance`) and the step's one host read (:class:`HostRead`); a sequence's host-side state in its
slot (:class:`Slot`, its prompt checked by :func:`check_prompt`) and what a finished sequence gives back
(:class:`GenerationOutput`). The engine (:class:`~eagle_backbone.batched_engine.BatchedSpeculativeEngine`)
runs the phases.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle_backbone.metrics import GenerationStats
from eagle_backbone.policy import DROP, GO, Rows
from eagle_backbone.target import TargetModel


@dataclass
class GenerationOutput:
    tokens: list[int]  # new tokens only, EOS included when generated
    stats: GenerationStats


def check_prompt(prompt_ids, target: TargetModel) -> list[int]:
    ids = prompt_ids.flatten().tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
    if not ids:
        raise ValueError("empty prompt: give at least one token (e.g. the BOS token)")
    if len(ids) >= target.max_length:
        raise ValueError(f"prompt has {len(ids)} tokens but the target's context is {target.max_length}: "
                         "no position is left to generate")
    bad = [t for t in ids if not 0 <= t < target.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the target vocabulary [0, {target.vocab_size})")
    return ids


@dataclass
class DraftRecord:
    """One step's drafts for R rows. ``parents[r, i]`` is the index of draft i's parent in this record,
    -1 for the slot's last accepted token: a chain is i-1; a tree later sets other parents (and a tree
    mask) without changing the record's shape."""

    tokens: torch.Tensor  # (R, K) drafted tokens (0 past a row's length)
    lengths: torch.Tensor  # (R,) drafts per row (device)
    parents: torch.Tensor  # (R, K)
    probs: torch.Tensor | None = None  # (R, K, V) drafter distributions (sampling only)


@dataclass
class StepPlan:
    """The plan phase's output: the step's running slots and what each may draft."""

    run: list[int]  # slot indices (host)
    slots: list[Slot]
    gammas: list[int]  # drafts each row may make (0: a plain decoding step for that slot)
    view: Rows  # what the policy saw (and sees again at observe)
    rows: torch.Tensor  # (R,) the slot indices on the device
    tlens: list[int]  # position of each slot's last token
    tl: torch.Tensor  # (R,) the same on the device
    seeds: torch.Tensor | None  # (R,) the slots' random streams (None when greedy)
    steps: torch.Tensor | None  # (R,)

    @property
    def max_gamma(self) -> int:
        return max(self.gammas) if self.gammas else 0


@dataclass
class Drafts:
    """The draft phase's output: chains of drafted tokens (R, G), the count per row on the host (exact, or
    each row's cap when the stop codes stayed on the device) and, then, the exact counts on the device
    (``lengths``); when sampling, the distributions the drafts were drawn from (R, G, V)."""

    tokens: torch.Tensor
    drafted: list[int]
    probs: torch.Tensor | None = None
    lengths: torch.Tensor | None = None  # (R,) exact counts when the host has only the caps
    going: torch.Tensor | None = None  # (R,) rows whose codes still say GO (device mode)
    depth_rows: list[int] = field(default_factory=list)  # rows the drafter ran at each depth (the step's shape)

    @staticmethod
    def none(plan: StepPlan, device) -> Drafts:
        return Drafts(torch.zeros(len(plan.run), 0, dtype=torch.long, device=device), [0] * len(plan.run))

    def add(self, depth: int, idx, active: list[int], tok, probs, greedy: bool) -> None:
        """Depth ``depth``'s drafts for rows ``active`` (``idx``: their index, a slice when all rows)."""
        self.tokens[idx, depth - 1] = tok
        if not greedy:
            if self.probs is None:
                R, G = self.tokens.shape
                self.probs = probs.new_zeros(R, G, probs.shape[-1])
            self.probs[idx, depth - 1] = probs
        for i in active:
            self.drafted[i] = depth
        self.depth_rows.append(len(active))

    def apply_codes(self, depth: int, idx, active: list[int], codes, on_host: bool) -> None:
        """A policy's stop codes for this depth's rows: on the host (the counts become exact), or as device
        masks (``lengths`` and ``going``; the host keeps the caps)."""
        if on_host:
            for i, c in zip(active, codes):
                if c == DROP:
                    self.drafted[i] = depth - 1
            return
        if self.lengths is None:
            R = self.tokens.shape[0]
            self.lengths = torch.zeros(R, dtype=torch.long, device=self.tokens.device)
            self.going = torch.ones(R, dtype=torch.bool, device=self.tokens.device)
        going = self.going[idx]
        self.lengths[idx] = torch.where(going & (codes != DROP), depth, self.lengths[idx])
        self.going[idx] = going & (codes == GO)


@dataclass
class Verification:
    """The verify phase's output: the drafts as verified, the target's logits and hidden states at each
    row's last token and drafts (R, T, ·), the rows' positions (device) and, when prompt chunks joined the
    forward, the chunks (slot, start, count), their tokens, batch, hidden states and features."""

    record: DraftRecord
    logits: torch.Tensor
    hidden: torch.Tensor
    tlens: torch.Tensor
    prefill: tuple | None = None
    feats: torch.Tensor | None = None  # (R, T, F) the generator's features when not ``hidden`` (EAGLE-3's layers)


@dataclass
class Acceptance:
    """The accept phase's output (device): accepted drafts per row (R,), the token after them (R,), and
    the emitted tokens (R, T): the accepted drafts then the next token."""

    accepted: torch.Tensor
    next_token: torch.Tensor
    emitted: torch.Tensor


class HostRead(dict):
    """The step's one device-to-host read: named device tensors packed into one transfer, read back by
    name (a (R, T) tensor comes back as R lists)."""

    @classmethod
    def read(cls, parts: dict[str, torch.Tensor]) -> HostRead:
        # float64 carries the integers exactly (token ids, counts) and a policy's floats
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in parts.values()]).tolist()
        out, o = cls(), 0
        for name, t in parts.items():
            vals = flat[o: o + t.numel()]
            if not t.is_floating_point():
                vals = [int(x) for x in vals]
            o += t.numel()
            out[name] = [vals[i: i + t.shape[1]] for i in range(0, len(vals), t.shape[1])] if t.dim() == 2 else vals
        return out


@dataclass
class Slot:
    """Host-side state of one sequence in a slot."""

    prompt: list[int]
    max_new: int
    seed: int
    request: object = None  # the caller's handle (e.g. a prompt index)
    new: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    step: int = 0  # decoding steps done (prefill = step 0)
    tlen: int = 0  # target positions cached; the last token sits at position tlen
    gamma_next: int | None = None  # planned ahead (plans_ahead policies), read with the accept counts
    done: bool = False
    t_admit: float = 0.0
    token_times: list[float] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens the target has read (chunked prefill reads a prompt over several steps)
