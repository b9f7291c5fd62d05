"""The draft-policy protocol: what decides, at every step, how much each running sequence drafts.

A :class:`DraftPolicy` is batched first: one instance serves every slot of an engine, and sees the running
rows as device tensors. Per step over the R running rows the engine calls:

1. ``plan(rows) -> list[int] | Tensor (R,)``: the most each row drafts this step (its depth cap; 0 is a
   plain decoding step for that row). ``rows`` (:class:`Rows`) carries the last tokens and their target
   features on the device, and on the host what the engine knows without reading the device: the slots,
   the caps (budgets, context), the tokens generated so far and the past accept counts. A host list costs
   no read; a device tensor is read with the step's one host read when the policy ``plans_ahead`` (the
   engine then calls ``plan`` right after verification, for the next step, with ``caps=None``: the LDLP).
2. ``stop(d) -> Tensor (A,)`` after each draft depth, only when ``reads_drafts``: a code per row that drafted
   at this depth (:class:`Depth`: its tokens, the drafter's distributions and states, the chain's
   log-probability), computed on the device: ``DROP`` (drop this draft and stop), ``STOP`` (keep it and
   stop) or ``GO`` (keep it and draft on). Threshold rules are masks: ``go_while(mask)``. A host list of
   codes is taken too (a policy that decided on host floats, where the engine reads the codes anyway).
3. ``observe(rows, drafted, accepted)`` after verification, with host lists from the step's one read.

``bind(engine)`` is called once by each engine built with the policy (its models, sampling, device and
step-cost model); it may refuse the pair in one line. ``begin(slot, prompt_ids, max_new_tokens)`` is called
when a prompt enters a slot, before its clock starts.

**Capabilities** are declared as attributes, and the engine and the benchmarks read them (never probe for
methods): ``reads_drafts``, ``plans_ahead``, ``needs_costs`` (it prices steps with the engine's step-cost
model), ``greedy_only`` (an upper bound defined for greedy decoding: the oracles), ``tree`` (grows draft
trees; ``grows_trees``) and ``fixed_gamma`` (a static γ, the baseline results compare against; None for an
adaptive policy, ``adaptive``).

**Host reads.** Every shipped policy reads the host at most once a step: the engine's own read after
verification carries the accept counts, the emitted tokens, the drafted counts and a planned-ahead γ.
Where a device read is no synchronisation (a CPU), the engine also reads the stop codes after each depth
to skip the rows that stopped (``early_exit``); on a GPU it drafts every row to its cap with the codes as
masks and verifies up to the caps (see :class:`~eagle_backbone.batched_engine.BatchedSpeculativeEngine`).

**The per-sequence path.** A :class:`DraftLengthPolicy` (``gamma(ctx)``, ``keep_drafting(ctx, i, token,
probs)``, ``observe(ctx, drafted, accepted)`` on host values) runs through :class:`PerSlot`, one copy per slot.
It costs no read where the policy decides on host counts alone (``policy=heuristic``, transformers' schedule,
is written this way); one that overrides ``keep_drafting`` reads every depth's drafts on the host, so a policy
meant to be measured under load implements :class:`DraftPolicy`. :class:`OneRow` drives a :class:`DraftPolicy`
one sequence at a time (replay of oracle labels).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch

from eagle_backbone.runtime import to_device
from eagle_backbone.sampling import confidence
from eagle_backbone.tree import on_path

DROP, STOP, GO = 0, 1, 2  # stop()'s codes per row


def go_while(mask: torch.Tensor) -> torch.Tensor:
    """Codes from a device mask: GO where ``mask`` holds (keep drafting), STOP elsewhere (keep this draft, stop)."""
    return torch.where(mask, GO, STOP)


@dataclass
class Rows:
    """The running rows of a step, as a policy sees them at ``plan`` (and ``observe``)."""

    slots: list[int]  # engine slot of each row (host)
    caps: list[int] | None  # the most each row may draft (budget, context); None when planning ahead
    positions: list[int]  # tokens generated so far per row, the last one included (host)
    last_tokens: torch.Tensor  # (R,) the last token of each row, not yet seen by the target
    features: torch.Tensor  # (R, d) the target feature at the position that produced it
    accepted: list[list[int]] = field(default_factory=list)  # per row, accepted drafts of past steps (host)
    drafted: list[list[int]] = field(default_factory=list)  # per row, drafted tokens of past steps (host)
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None
    last_ids: list[int] | None = None  # the last tokens on the host, where the engine has them without a read
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None  # the target's: features -> logits
    given_target_stats: torch.Tensor | None = None  # (R, 3) where known without the LM head (replay: the stored)
    # planning ahead (after verification, before the step's read): the step just verified, on the device; its
    # emitted tokens are not yet in ``positions``, ``accepted`` or ``drafted`` (None: every step is there)
    step_accepted: torch.Tensor | None = None  # (R,)
    step_drafted: torch.Tensor | None = None  # (R,)
    last_logits: torch.Tensor | None = None  # (R, V) the verify logits behind each last token, where the engine has them

    def __len__(self) -> int:
        return len(self.slots)

    @cached_property
    def embeddings(self) -> torch.Tensor:
        """(R, d) the target's input embeddings of the last tokens (computed on first use)."""
        return self.embed(self.last_tokens)

    @cached_property
    def target_stats(self) -> torch.Tensor:
        """(R, 3) :func:`~eagle_backbone.sampling.confidence` of the target's distribution that produced each
        last token: the verify logits where the engine hands them over, else ``lm_head(features)``, the verify
        logits again (the same bits on a CPU, where the engine is
        batch-invariant; computed on first use, a policy that reads none pays nothing)."""
        if self.given_target_stats is not None:
            return self.given_target_stats
        if self.last_logits is not None:  # planning ahead after a chain step: the verify logits themselves
            return confidence(self.last_logits)
        return confidence(self.lm_head(self.features))


@dataclass
class Depth:
    """One draft depth, for the A rows that drafted at it (``rows``: their positions in the step's rows)."""

    depth: int  # 1-based
    rows: list[int]
    slots: torch.Tensor  # (A,) their engine slots (device)
    tokens: torch.Tensor  # (A,) the drafted tokens
    probs: torch.Tensor  # (A, V) the drafter's distributions they came from
    states: torch.Tensor | None  # (A, d) the drafter states behind probs (None for a draft LM)
    logp: torch.Tensor  # (A,) log-probability of each row's chain up to this depth (this token included)


@dataclass
class TreeOutcome:
    """What the target made of a step's trees (device tensors): the grown trees, the selected nodes as
    scored (``scored``: pruned, ``index`` each scored node's index in ``grown``, -1 padding), the accepted
    path in ``scored`` (-1 padded), its length, and the scored nodes the target judged (``tested``: their
    parent was accepted; a tested node is kept iff it is on the path)."""

    grown: object  # eagle_backbone.tree_draft.GrownTree
    index: torch.Tensor  # (R, W)
    scored: object  # eagle_backbone.tree.DraftTree, (R, W)
    path: torch.Tensor  # (R, W)
    accepted: torch.Tensor  # (R,)
    tested: torch.Tensor  # (R, W) bool

    @property
    def kept(self) -> torch.Tensor:
        """(R, W) bool: the scored node is on the accepted path."""
        return on_path(self.path)[:, 1:]


class DraftPolicy:
    """Base class of the batched protocol (module docstring): subclasses set ``name`` and override ``plan``
    (default: every row drafts to ``max_gamma``), and ``stop`` with ``reads_drafts = True``, ``observe`` and
    ``begin`` where they keep state.

    A *tree policy* sets ``tree`` (a :class:`~eagle_backbone.tree_draft.TreeSpec`): the engine then grows a
    draft tree per row, up to the row's planned depth, and calls ``select`` to choose the nodes the target
    scores, ``tree_width`` for the most a row may score when the selection stays on the device, and
    ``verified`` with the outcome (device tensors, no read) before ``observe``; ``tree_now`` may make a step a
    plain chain step instead."""

    name = "base"
    # ---- capabilities (module docstring) -------------------------------------------------------------
    fixed_gamma: int | None = None  # a static γ (results report it and compare the adaptive policies with it)
    reads_drafts = False  # stop() is called after every depth
    plans_ahead = False  # plan() reads device tensors only and is called right after verification
    needs_costs = False  # it prices steps by the engine's step-cost model (engine.attach_costs)
    greedy_only = False  # defined for greedy decoding only (the oracles: they know what the target accepts)
    tree = None  # a TreeSpec: grow draft trees instead of chains
    max_gamma: int | None = None  # the most a row drafts (the default plan's depth)
    pricing = None  # with needs_costs: its step prices (ldlp.policies.pricing.StepPricing: .table, .costs)

    @property
    def adaptive(self) -> bool:
        return self.fixed_gamma is None

    @property
    def grows_trees(self) -> bool:
        return self.tree is not None

    def bind(self, engine) -> None:
        """Called once by each engine built with this policy (after its buffers, before any prompt)."""
        self.check_pair(engine.target, engine.candidates)

    def check_pair(self, target, candidates) -> None:
        """Raise a one-line ValueError when the policy cannot serve this pair (a predictor trained for others)."""

    def begin(self, slot: int, prompt_ids: list[int], max_new_tokens: int | None = None) -> None:
        """A new prompt enters ``slot`` (before the clock starts), to generate at most ``max_new_tokens``."""

    def plan(self, rows: Rows) -> list[int] | torch.Tensor:
        return [self.max_gamma] * len(rows)

    def stop(self, d: Depth) -> torch.Tensor:
        return torch.full_like(d.tokens, GO)

    def reads(self) -> dict[str, torch.Tensor]:
        """Device tensors this step's observation needs on the host: they ride in the step's one read."""
        return {}

    def observe(self, rows: Rows, drafted: list[int], accepted: list[int], extra: dict | None = None) -> None:
        """Called after each verification with the step's drafted and accepted counts per row, and the
        host values of :meth:`reads` (``extra``, by name)."""

    def report(self) -> dict:
        """What the policy learnt while decoding, as plain numbers for the result files (read after a run; a
        host read is allowed here). Default: nothing."""
        return {}

    def timed(self, ms: float, shape) -> None:
        """The wall milliseconds the step took from throughput and its :class:`~eagle_backbone.step_cost.StepShape`,
        after ``observe`` (called only for a policy that overrides it: goodput feedback measures what its choices
        earn). ``ms`` is the step's clock plus the engine's work since the previous decode step's clock stopped
        (that step's cost-model upkeep and hooks, the caller's admissions; not a prompt's own step or an idle
        wait): about 2 ms a step on the embedded pair, 15% of a plain step at C = 16 and 3% of a γ = 5 one, which
        a step's clock alone would credit to the cheap steps."""

# ---- tree policies --------------------------------------------------------------------------------
    def select(self, grown, rows: Rows) -> torch.Tensor:
        """(R, K) bool, closed under ancestors: the grown nodes the target scores (default: every valid one)."""
        return grown.valid

    def tree_now(self) -> bool:
        """Whether this step grows a tree (asked after ``plan``); False: the step drafts chains of the planned
        depths, as a chain policy's, and ``verified`` is not called (default: always a tree)."""
        return True

    def tree_width(self, rows: Rows) -> int:
        """The most nodes a row scores (host int): the padded width when the selection stays on the device."""
        return self.tree.max_nodes

    def verified(self, outcome: TreeOutcome) -> None:
        """The step's tree outcome on the device (e.g. to recalibrate the node values), before ``observe``."""


class StaticPolicy(DraftPolicy):
    """A fixed γ every step: EAGLE's and most papers' default."""

    name = "static"

    def __init__(self, gamma: int = 4):
        self.fixed_gamma = self.max_gamma = int_at_least("static", "gamma", gamma, 0)


def int_at_least(policy: str, key: str, value, low: int) -> int:
    """``value`` when it is an integer >= ``low``; else a one-line error naming the policy and the key (the one
    check of every policy's integer settings)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{policy} policy: {key} must be an integer >= {low}, got {value!r}")
    return value


# ---- the per-sequence path: policies on host values ---------------------------------------------


@dataclass
class DraftContext:
    """What a per-sequence policy sees (host values, the feature on the device)."""

    step: int  # 0-based decoding step (one target forward each)
    last_token: int  # the last accepted token, not yet seen by the target
    feature: torch.Tensor  # (d,) target feature at the position that produced last_token
    accepted_history: list[int] = field(default_factory=list)  # accepted drafts per past step
    drafted_history: list[int] = field(default_factory=list)  # drafted tokens per past step
    position: int = 0  # number of tokens generated so far (last_token included)
    max_gamma: int = 0  # what the context and max_new_tokens still allow
    draft_state: torch.Tensor | None = None  # (d,) during keep_drafting: the drafter state behind ``probs``
    _embed: Callable[[torch.Tensor], torch.Tensor] | None = None
    _embedding: torch.Tensor | None = None
    _target_stats: Callable[[], torch.Tensor] | torch.Tensor | None = None

    @property
    def target_stats(self) -> torch.Tensor:
        """(3,) :attr:`Rows.target_stats` of this sequence (computed on first use)."""
        if callable(self._target_stats):
            self._target_stats = self._target_stats()
        return self._target_stats

    @property
    def embedding(self) -> torch.Tensor:
        """(d,) target input embedding of ``last_token`` (computed on first use)."""
        if self._embedding is None:
            ids = to_device([self.last_token], self.feature.device)
            self._embedding = self._embed(ids)[0]
        return self._embedding


class DraftLengthPolicy:
    """A per-sequence policy on host values (the slow path, through :class:`PerSlot`): override ``gamma``
    and optionally ``keep_drafting`` (False stops the chain after draft ``i``, keeping it), ``observe``
    and ``begin``."""

    name = "per_slot"
    fixed_gamma: int | None = None

    @property
    def adaptive(self) -> bool:
        return self.fixed_gamma is None

    def check_pair(self, target, candidates) -> None:
        """Raise a one-line ValueError when the policy cannot serve this pair."""

    def begin(self, prompt_ids: list[int]) -> None:
        """Called once per generation, before timing starts."""

    def gamma(self, ctx: DraftContext) -> int:
        raise NotImplementedError

    def keep_drafting(self, ctx: DraftContext, i: int, token: int, probs: torch.Tensor) -> bool:
        return True

    def observe(self, ctx: DraftContext, drafted: int, accepted: int) -> None:
        """Called after each verification."""


def _overrides(obj, name: str) -> bool:
    return getattr(type(obj), name) is not getattr(DraftLengthPolicy, name)


class PerSlot(DraftPolicy):
    """Runs per-sequence policies (:class:`DraftLengthPolicy`), one copy per slot (``factory()`` each time a
    prompt enters a slot). The slow path: a context per row and step, and, for a policy that reads drafts,
    a host read of every depth's tokens and distributions."""

    def __init__(self, factory: Callable[[], DraftLengthPolicy]):
        self.factory = factory
        probe = factory()
        self.name, self.fixed_gamma = probe.name, probe.fixed_gamma
        self.reads_drafts = _overrides(probe, "keep_drafting")
        self._probe = probe
        self.per_slot: dict[int, DraftLengthPolicy] = {}
        self._ctx: dict[int, DraftContext] = {}

    @classmethod
    def of(cls, policy: DraftLengthPolicy) -> PerSlot:
        return cls(lambda: copy.deepcopy(policy))

    def check_pair(self, target, candidates) -> None:
        self._probe.check_pair(target, candidates)

    def begin(self, slot: int, prompt_ids: list[int], max_new_tokens: int | None = None) -> None:
        p = self.factory()
        p.begin(prompt_ids)
        self.per_slot[slot] = p

    def _context(self, rows: Rows, i: int, cap: int) -> DraftContext:
        # the feature is a copy: a policy may keep its contexts, and the engine's buffer row changes every step
        last = rows.last_ids[i] if rows.last_ids is not None else int(rows.last_tokens[i])
        return DraftContext(step=len(rows.accepted[i]) if rows.accepted else 0, last_token=last,
                            feature=rows.features[i].clone(), accepted_history=rows.accepted[i] if rows.accepted else [],
                            drafted_history=rows.drafted[i] if rows.drafted else [], position=rows.positions[i],
                            max_gamma=cap, _embed=rows.embed, _target_stats=lambda: rows.target_stats[i])

    def plan(self, rows: Rows) -> list[int]:
        out = []
        for i, b in enumerate(rows.slots):
            ctx = self._ctx[b] = self._context(rows, i, rows.caps[i] if rows.caps is not None else 0)
            out.append(self.per_slot[b].gamma(ctx))
        return out

    def stop(self, d: Depth) -> torch.Tensor:
        toks = d.tokens.tolist()  # the slow path's host read of this depth
        codes = []
        for j, b in enumerate(d.slots.tolist()):
            ctx = self._ctx[b]
            ctx.draft_state = None if d.states is None else d.states[j]
            codes.append(GO if self.per_slot[b].keep_drafting(ctx, d.depth, toks[j], d.probs[j]) else STOP)
        return to_device(codes, d.tokens.device)

    def observe(self, rows: Rows, drafted: list[int], accepted: list[int], extra: dict | None = None) -> None:
        for i, b in enumerate(rows.slots):
            p = self.per_slot[b]
            if _overrides(p, "observe"):
                p.observe(self._ctx.get(b) or self._context(rows, i, 0), drafted[i], accepted[i])


def as_draft_policy(policy) -> DraftPolicy:
    """A :class:`DraftPolicy` as it is; a per-sequence policy (or a zero-argument factory of one) through
    :class:`PerSlot`; a factory of a :class:`DraftPolicy` called once."""
    if isinstance(policy, DraftPolicy):
        return policy
    if isinstance(policy, DraftLengthPolicy):
        return PerSlot.of(policy)
    if callable(policy):
        first = policy()
        if isinstance(first, DraftPolicy):
            return first
        if isinstance(first, DraftLengthPolicy):
            return PerSlot(policy)
    raise ValueError(f"policy must be a DraftPolicy, a DraftLengthPolicy or a factory of one, got {policy!r}")


class OneRow:
    """A :class:`DraftPolicy` driven one sequence at a time through the per-sequence calls (``begin(prompt)``,
    ``gamma(ctx)``, ``keep_drafting(ctx, i, token, probs)``, ``observe(ctx, drafted, accepted)``): replay
    and per-sequence tools ask a batched policy what it would do for one row (slot 0)."""

    def __init__(self, policy: DraftPolicy, slot: int = 0):
        self.policy, self.slot = policy, slot
        self.name, self.adaptive = policy.name, policy.adaptive
        self._rows: Rows | None = None
        self._logp = 0.0

    def begin(self, prompt_ids) -> None:
        self.policy.begin(self.slot, list(prompt_ids))

    def _rows_of(self, ctx: DraftContext, caps) -> Rows:
        dev = ctx.feature.device
        given = ctx._target_stats
        return Rows([self.slot], caps, [ctx.position], to_device([ctx.last_token], dev), ctx.feature[None],
                    [list(ctx.accepted_history)], [list(ctx.drafted_history)], ctx._embed, [ctx.last_token],
                    given_target_stats=None if given is None or callable(given) else given[None])

    def gamma(self, ctx: DraftContext) -> int:
        self._logp = 0.0
        self._rows = self._rows_of(ctx, None if self.policy.plans_ahead else [ctx.max_gamma])
        g = self.policy.plan(self._rows)
        return int(g[0])

    def keep_drafting(self, ctx: DraftContext, i: int, token: int, probs: torch.Tensor) -> bool:
        if not self.policy.reads_drafts:
            return True
        dev = probs.device
        p = float(probs[token])
        self._logp += float(torch.log(torch.tensor(p, dtype=torch.float64))) if p > 0 else float("-inf")
        d = Depth(i, [0], to_device([self.slot], dev), to_device([token], dev), probs[None],
                  None if ctx.draft_state is None else ctx.draft_state[None],
                  torch.tensor([self._logp], dtype=torch.float32, device=dev))
        return int(self.policy.stop(d)[0]) == GO

    def observe(self, ctx: DraftContext, drafted: int, accepted: int) -> None:
        extra = {k: v.tolist() for k, v in self.policy.reads().items()}
        self.policy.observe(self._rows or self._rows_of(ctx, [ctx.max_gamma]), [drafted], [accepted], extra)
        self._rows = None


class OwnTime:
    """The seconds a policy spends in its own calls, summed (``engine.policy_s``): perf_counter around each
    call, which on a GPU times the launches (the host's share)."""

    def __init__(self):
        self.s = 0.0

    def call(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.s += time.perf_counter() - t0
        return out
