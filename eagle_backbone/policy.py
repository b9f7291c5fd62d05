"""The draft-policy protocol: what decides, at every step, how much each running sequence drafts.

A :class:`DraftPolicy` is batched: one instance serves every slot of an engine (batch 1 is one slot), and sees
the running rows as device tensors. Its core is three calls per step over the R running rows, as transformers'
``CandidateGenerator`` is two:

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
3. ``observe(rows, drafted, accepted, extra)`` after verification, with host lists from the step's one read.

Around them, the lifecycle: ``bind(view)`` once by each engine built with the policy, with an
:class:`EngineView` (the pair, the sampling, the device, how the engine drafts and its step-cost model: not
the engine); it may refuse the pair in one line. ``begin(slot, prompt_ids, max_new_tokens)`` when a prompt
enters a slot, before its clock starts; ``report()`` after a run. Two optional step hooks serve a policy that
learns from more than the counts: ``reads()`` (device tensors to ride in the step's one read, handed to
``observe`` as ``extra``) and ``timed(ms, shape)`` (the step's wall time: goodput feedback).

**Capabilities** are declared as attributes, and the engine and the benchmarks read them (never probe for
methods): ``reads_drafts``, ``plans_ahead``, ``needs_costs`` (it prices steps with the engine's step-cost
model), ``greedy_only`` (an upper bound defined for greedy decoding: the oracles) and ``fixed_gamma`` (a static
γ, the baseline results compare against; None for an adaptive policy, ``adaptive``).

**Trees.** A :class:`TreePolicy` holds a ``tree`` spec and the four tree hooks: the engine grows a draft tree
per row up to its planned depth and asks it which nodes the target scores.

**Host reads.** Every shipped policy reads the host at most once a step: the engine's own read after
verification carries the accept counts, the emitted tokens, the drafted counts and a planned-ahead γ.
Where a device read is no synchronisation (a CPU), the engine also reads the stop codes after each depth
to skip the rows that stopped (``early_exit``); on a GPU it drafts every row to its cap with the codes as
masks and verifies up to the caps (see :class:`~eagle_backbone.batched_engine.BatchedSpeculativeEngine`).
Replay (:mod:`ldlp.bench.harness.replay`) drives the same objects one sequence at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch

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


@dataclass(frozen=True)
class EngineView:
    """What a policy learns of the engine it is bound to (``bind``): the pair it drafts for, the sampling, the
    device, how the engine handles stop codes, and its step-cost model. ``attach_costs(table, **options)`` returns
    the engine's online :class:`~eagle_backbone.step_cost.OnlineCostModel`, warm-started from ``table`` (made when
    it has none); ``record_costs(model)`` makes a frozen model the one whose predictions the engine records, when
    it has none. A policy keeps what it needs from the view, never the engine."""

    target: object  # eagle_backbone.target.TargetModel (its hidden_size, dtype, models)
    candidates: object | None  # the engine's CandidateGenerator as given (None: nothing to draft with)
    sampling: object  # eagle_backbone.sampling.SamplingConfig
    device: torch.device
    attn: str = "sdpa"
    early_exit: bool = True  # stop codes are read after each depth (a CPU); False: they stay device masks
    attach_costs: Callable | None = None
    record_costs: Callable | None = None

    @property
    def kind(self) -> str | None:
        """The drafter kind (None: no drafter, every step is plain decoding)."""
        return None if self.candidates is None else self.candidates.kind

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy


class DraftPolicy:
    """Base class of the protocol (module docstring): subclasses set ``name`` and override ``plan`` (default:
    every row drafts to ``max_gamma``), and ``stop`` with ``reads_drafts = True``, ``observe`` and ``begin``
    where they keep state. ``bind`` refuses a pair the policy cannot serve, in one line."""

    name = "base"
    # ---- capabilities (module docstring) -------------------------------------------------------------
    fixed_gamma: int | None = None  # a static γ (results report it and compare the adaptive policies with it)
    reads_drafts = False  # stop() is called after every depth
    plans_ahead = False  # plan() reads device tensors only and is called right after verification
    needs_costs = False  # it prices steps by the engine's step-cost model (EngineView.attach_costs)
    greedy_only = False  # defined for greedy decoding only (the oracles: they know what the target accepts)
    max_gamma: int | None = None  # the most a row drafts (the default plan's depth)
    pricing = None  # with needs_costs: its step prices (ldlp.policies.pricing.StepPricing: .table, .costs)

    @property
    def adaptive(self) -> bool:
        return self.fixed_gamma is None

    # ---- lifecycle ----------------------------------------------------------------------------------
    def bind(self, view: EngineView) -> None:
        """Called once by each engine built with this policy (after its buffers, before any prompt): keep what
        the policy needs of ``view``; raise a one-line ValueError when it cannot serve the pair (a predictor
        trained for other sizes or another drafter)."""

    def begin(self, slot: int, prompt_ids: list[int], max_new_tokens: int | None = None) -> None:
        """A new prompt enters ``slot`` (before the clock starts), to generate at most ``max_new_tokens``."""

    def report(self) -> dict:
        """What the policy learnt while decoding, as plain numbers for the result files (read after a run; a
        host read is allowed here). Default: nothing."""
        return {}

    # ---- the core -----------------------------------------------------------------------------------
    def plan(self, rows: Rows) -> list[int] | torch.Tensor:
        return [self.max_gamma] * len(rows)

    def stop(self, d: Depth) -> torch.Tensor:
        return torch.full_like(d.tokens, GO)

    def observe(self, rows: Rows, drafted: list[int], accepted: list[int], extra: dict | None = None) -> None:
        """Called after each verification with the step's drafted and accepted counts per row, and the
        host values of :meth:`reads` (``extra``, by name)."""

    # ---- optional step hooks ------------------------------------------------------------------------
    def reads(self) -> dict[str, torch.Tensor]:
        """Device tensors this step's observation needs on the host: they ride in the step's one read."""
        return {}

    def timed(self, ms: float, shape) -> None:
        """The wall milliseconds the step took from throughput and its :class:`~eagle_backbone.step_cost.StepShape`,
        after ``observe`` (called only for a policy that overrides it: goodput feedback measures what its choices
        earn). ``ms`` is the step's clock plus the engine's work since the previous decode step's clock stopped
        (that step's cost-model upkeep and hooks, the caller's admissions; not a prompt's own step or an idle
        wait): about 2 ms a step on the embedded pair, 15% of a plain step at C = 16 and 3% of a γ = 5 one, which
        a step's clock alone would credit to the cheap steps."""


class TreePolicy(DraftPolicy):
    """A policy that grows draft trees (``tree``: a :class:`~eagle_backbone.tree_draft.TreeSpec`): the engine
    grows a tree per row up to the row's planned depth, calls ``select`` to choose the nodes the target scores,
    ``tree_width`` for the most a row may score when the selection stays on the device, and ``verified`` with
    the outcome (device tensors, no read) before ``observe``; ``tree_now`` may make a step a plain chain step."""

    tree = None  # the TreeSpec (set by each subclass or instance)

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


def as_draft_policy(policy) -> DraftPolicy:
    """A :class:`DraftPolicy` as it is, or a zero-argument factory of one called once (a benchmark's contender)."""
    if not isinstance(policy, DraftPolicy) and callable(policy):
        policy = policy()
    if not isinstance(policy, DraftPolicy):
        raise ValueError(f"policy must be a DraftPolicy (eagle_backbone/policy.py) or a factory of one, got {policy!r}")
    return policy


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
