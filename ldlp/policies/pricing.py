"""What the cost-driven policies hold rather than inherit: the price of a step (:class:`StepPricing`: the cost
table profiled on this machine, the engine's online step-cost model warm-started from it, and one cache of
what is computed from them) and the running rates they learn from verification (:class:`RunningRate`,
:class:`FeedRate`).

``policy=load_aware``, ``load_aware_step``, ``tree_budget`` and ``oracle_budget`` each hold one
:class:`StepPricing` (``policy.pricing``) and their rates; the benchmarks read ``policy.pricing`` of a
policy that declares ``needs_costs``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_backbone.cost import CostTable, cost_key, load_or_profile
from eagle_backbone.errors import mismatch
from eagle_backbone.step_cost import OnlineCostModel, key_mismatch

log = logging.getLogger(__name__)


# ---- the running rates ---------------------------------------------------------------------------------


class RunningRate:
    """A probability learned from verification outcomes: an EMA whose step grows with the evidence (``0.2 ·
    min(1, n / 32)`` for ``kept`` of ``n`` outcomes), clipped to ``[low, high]``."""

    def __init__(self, prior: float, low: float = 0.0, high: float = 1.0):
        self.value, self.low, self.high = float(prior), low, high

    def update(self, kept: float, n: int) -> None:
        if n:
            step = 0.2 * min(1.0, n / 32) * (kept / n - self.value)
            self.value = min(self.high, max(self.low, self.value + step))


class FeedRate:
    """The tokens a row feeds the drafter a step (its accepted drafts + 1), as an EMA: the drafter's catch-up
    forward is priced by it."""

    def __init__(self, prior: float = 2.0):
        self.value = float(prior)

    def update(self, accepted: list[int]) -> None:
        self.value += 0.1 * (sum(accepted) / max(1, len(accepted)) + 1 - self.value)


# ---- the price of a step ---------------------------------------------------------------------------------

# a cost-driven policy's ``pricing`` node (conf/policy/*.yaml): what StepPricing is built from
PRICING_KEYS = ("cost_dir", "model", "cost_table", "profile_if_missing", "online_costs", "cost_model")


def flat_pricing(config) -> dict:
    """A policy config (a dict, or an OmegaConf node's items) with its ``pricing`` node's keys lifted to the top, where they stand in
    the records of earlier runs (results' ``policy_config``, the head to head's settings)."""
    if not hasattr(config.get("pricing"), "keys"):  # a dict, or an OmegaConf node read item by item
        return dict(config)
    out = {}
    for k, v in config.items():
        out.update({p: v[p] for p in v.keys()} if k == "pricing" else {k: v})
    return out


class StepPricing:
    """The prices a cost-driven policy plans with, bound to an engine (:meth:`bind`):

    * ``table``: the :class:`~eagle_backbone.cost.CostTable` profiled on this machine for this setup (from
      ``cost_table``, else found or profiled under ``cost_dir``);
    * ``costs``: what steps are priced by: the engine's online model warm-started from the table (default), a
      model fitted in hindsight (``cost_model=FILE``, frozen), or the table as profiled (``online=False``).

    :meth:`memo` is the one cache of what policies compute from ``costs`` (device lookups, memoised choices),
    emptied whenever the online model refits: shared by every policy on the same table contents (a sweep reads
    the table afresh for every engine), or this policy's own where an entry depends on its running state."""

    def __init__(self, policy: str, cost_dir: str, model: str, cost_table: str | None = None,
                 profile_if_missing: bool = True, online: bool = True, cost_model: str | None = None,
                 model_options: dict | None = None):
        if cost_table is not None and not Path(cost_table).is_file():
            raise ValueError(f"{policy} policy: cost_table={cost_table} does not exist")
        if cost_model is not None and not Path(cost_model).is_file():
            raise ValueError(f"{policy} policy: cost_model={cost_model} does not exist (a step cost model fitted "
                             "by scripts/bench_batch.py: step_costs.json)")
        if cost_model is not None:  # its values checked now, before anything loads: one line naming file and key
            try:
                OnlineCostModel.load(cost_model)
            except ValueError as e:
                raise ValueError(f"{policy} policy: cost_model={e}") from None
        if not isinstance(online, bool):  # a YAML 'maybe' is a string: not true
            raise ValueError(f"{policy} policy: online_costs must be true or false, got {online!r}")
        self.policy = policy
        self.cost_dir, self.model_name, self.cost_table_path = str(cost_dir), str(model), cost_table
        self.profile_if_missing, self.online, self.cost_model_path = bool(profile_if_missing), bool(online), cost_model
        self.model_options = dict(model_options or {})
        self.table: CostTable | None = None
        self.costs: CostTable | OnlineCostModel | None = None
        self.device = torch.device("cpu")
        self._own: dict[str, dict] = {}

    @classmethod
    def of(cls, policy: str, pricing, model_options: dict | None = None) -> StepPricing:
        """The prices of ``policy`` from its ``pricing`` node (a mapping of :data:`PRICING_KEYS`, ``online_costs`` the
        constructor's ``online``; ``cost_dir`` and ``model`` find the table when it is bound); a StepPricing is
        taken as it is."""
        if isinstance(pricing, StepPricing):
            return pricing
        if pricing is not None and not hasattr(pricing, "keys"):
            raise ValueError(f"{policy} policy: pricing must be a node of {', '.join(PRICING_KEYS)}, got {pricing!r}")
        p = {k: pricing[k] for k in pricing.keys()} if pricing is not None else {}  # None: priced by a replay's table
        unknown = sorted(set(p) - set(PRICING_KEYS))
        if unknown:
            raise ValueError(f"{policy} policy: pricing.{unknown[0]} is not a pricing key ({', '.join(PRICING_KEYS)})")
        return cls(policy, p.get("cost_dir"), p.get("model"), p.get("cost_table"), p.get("profile_if_missing", True),
                   p.get("online_costs", True), p.get("cost_model"), model_options)

    def bind(self, view) -> None:
        """The table for this engine's setup (an :class:`~eagle_backbone.policy.EngineView`; profiled with engines
        like it, when missing) and the costs."""
        self.device = view.device
        if view.kind is None:
            return  # nothing to draft with: every step is plain decoding
        self.table = self._table(view.target, view.candidates, view.attn)
        if self.cost_model_path is not None:
            self.costs = OnlineCostModel.load(self.cost_model_path)
            wrong = key_mismatch(self.costs.key, getattr(self.table, "key", None))
            if wrong:  # costs measured on another setup would price this one's steps wrong, silently
                mismatch(f"{self.policy} policy: cost_model={self.cost_model_path} was measured on another setup "
                         f"than this engine's ({'; '.join(wrong[:4])}); fit one on this setup "
                         "(scripts/bench_batch.py writes step_costs.json)")
            view.record_costs(self.costs)  # the engine records the frozen model's predictions
        elif not self.online:
            self.costs = self.table
        else:
            self.costs = view.attach_costs(self.table, **self.model_options)

    def _table(self, target, candidates, attn: str) -> CostTable:
        from eagle_backbone.batched_engine import BatchedSpeculativeEngine

        def factory(R: int, policy=None):
            return BatchedSpeculativeEngine(target, candidates, slots=R, capacity=256, attn=attn, policy=policy)

        key = cost_key(self.model_name, target.dtype, target.device, torch.get_num_threads())
        if self.cost_table_path is not None:
            return CostTable.load(self.cost_table_path, key)
        return load_or_profile(self.cost_dir, key, factory, self.profile_if_missing, log=log.info)

    def memo(self, kind: str, shared: bool = True) -> dict:
        """The cache of ``kind`` for the current costs (emptied when the online model refits); ``shared=False``:
        this instance's own (its entries are computed from the policy's running state, rounded in the key)."""
        if shared:
            return memo_for(self.costs, kind)
        version = (id(self.costs), getattr(self.costs, "version", 0))
        memo = self._own.setdefault(kind, {"version": version})
        if memo["version"] != version:
            memo.clear()
            memo["version"] = version
        return memo


_TABLE_MEMOS: dict[tuple[str, str], dict] = {}  # (a table's contents, kind) -> its cache
_MODEL_MEMOS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # online model -> kind -> its cache


def memo_for(costs: CostTable | OnlineCostModel, kind: str) -> dict:
    """One cache per (cost contents, ``kind``): a table's lasts as long as its contents (equal tables read for
    different engines share it); an online model's lasts one version of its fit."""
    if isinstance(costs, OnlineCostModel):
        by_kind = _MODEL_MEMOS.setdefault(costs, {})
        memo = by_kind.setdefault(kind, {"version": costs.version})
        if memo["version"] != costs.version:
            memo.clear()
            memo["version"] = costs.version
        return memo
    cells = (costs.slots, costs.tokens, costs.target, costs.draft, costs.feed, costs.overhead, costs.depth_overhead)
    return _TABLE_MEMOS.setdefault((hashlib.sha256(json.dumps(cells).encode()).hexdigest(), kind), {})


# ---- a step's plan and its prices ------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """A step's plan so far: ``E`` expected emitted tokens, ``N`` scored tokens, ``T`` milliseconds (0-d
    device tensors inside a step; floats where a caller builds one by hand)."""

    E: torch.Tensor | float
    N: torch.Tensor | float
    T: torch.Tensor | float


@dataclass(frozen=True)
class DepthCosts:
    """What one draft depth's choices cost, for a depth of A drafting rows in a step of R: ``draft_ms`` this
    depth's drafter forward (already spent, whatever is kept), ``token_ms`` (m) the target's milliseconds
    per scored token at the plan's N (the secant over this depth's A tokens), and ``next_depth_ms[k]`` the
    next depth's drafter forward and bookkeeping over k rows (k = 0..R)."""

    draft_ms: torch.Tensor | float
    token_ms: torch.Tensor | float
    next_depth_ms: torch.Tensor

    @classmethod
    def from_table(cls, costs: CostTable, R: int, A, N) -> DepthCosts:
        """From the table's lookups over integer counts (:class:`StepTables`); A and N may be device scalars."""
        device = A.device if isinstance(A, torch.Tensor) else torch.device("cpu")
        return StepTables.of(costs, R, device).depth(A, N)


class StepTables:
    """The costs' lookups for a step of R rows as device vectors over integer counts: ``target[n]`` the
    verification of n scored tokens in all, ``draft[k]`` a draft depth over k rows. A depth's costs are then
    indexing, with no host read."""

    def __init__(self, costs: CostTable | OnlineCostModel, R: int, n_max: int, device):
        self.R = R
        self.target = torch.tensor([costs.target_ms(R, n) for n in range(n_max + 1)], dtype=torch.float64, device=device)
        self.draft = torch.tensor([costs.draft_ms(k, R) for k in range(R + 1)], dtype=torch.float64, device=device)

    @classmethod
    def of(cls, costs: CostTable | OnlineCostModel, R: int, device) -> StepTables:
        """Built once per cost version, R and device (a step scores at most R · (γ + 1) tokens, γ ≤ 32 in the
        engine)."""
        memo = memo_for(costs, "step_tables")
        key = (R, str(device))
        if key not in memo:
            memo[key] = cls(costs, R, 34 * R, device)
        return memo[key]

    def depth(self, A, N) -> DepthCosts:
        A = torch.as_tensor(A, device=self.draft.device)
        N = torch.as_tensor(N, device=self.draft.device).to(torch.long)
        token = (self.target[N + A] - self.target[N]) / A.clamp_min(1)
        return DepthCosts(self.draft[A], token, self.draft)


def uniform_gamma(costs: CostTable | OnlineCostModel, R: int, cap: int, accept: float, feed_tokens: float) -> int:
    """The γ ≤ ``cap`` that maximises expected tokens per ms for R slots drafting alike at acceptance rate
    ``accept`` (0: plain decoding), with the drafter's catch-up forward over ``feed_tokens`` a row."""
    best_g, best_rate = 0, R / costs.step_ms(R, [], R, feed_tokens)
    value = 0.0
    for g in range(1, cap + 1):
        value += accept ** g
        rate = R * (1 + value) / costs.step_ms(R, [R] * g, R * (g + 1), feed_tokens)
        if rate > best_rate:
            best_g, best_rate = g, rate
    return best_g


def best_uniform_gamma(pricing: StepPricing, R: int, cap: int, accept: float, feed_tokens: float) -> int:
    """:func:`uniform_gamma` memoised on its arguments rounded (the answer changes in steps)."""
    key = (R, cap, round(accept, 3), round(feed_tokens, 1))
    memo = pricing.memo("uniform_gamma", shared=False)  # the feed is the policy's own, unrounded below
    if key not in memo:
        memo[key] = uniform_gamma(pricing.costs, R, cap, key[2], feed_tokens)
    return memo[key]


class DraftGate:
    """Whether a step drafts, and how deep alike: the best uniform γ for the step's rows at the running
    acceptance rate and drafter feed (0: a plain decoding step, batched AR under heavy load); after
    ``explore_every`` plain steps in a row, one short draft, so that the rate can follow the text."""

    def __init__(self, explore_every: int):
        self.explore_every = int(explore_every)
        self.steps = self.drafting_steps = self._idle = 0

    def gamma(self, pricing: StepPricing, caps: list[int], accept: float, feed_tokens: float) -> int:
        self.steps += 1
        if pricing.costs is None or not any(caps):
            return 0
        g = best_uniform_gamma(pricing, len(caps), max(caps), accept, feed_tokens)
        if g == 0 and self.explore_every and self._idle + 1 >= self.explore_every:
            g = 1
        self._idle = 0 if g else self._idle + 1
        self.drafting_steps += bool(g)
        return g
