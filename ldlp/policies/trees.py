"""Draft-tree policies: the tree is the protocol's plan with width > 1 (eagle_backbone/tree_draft.py).

* :class:`StaticTreePolicy` (``policy=static_tree``): a fixed shape every step, by default the official
  EAGLE tree (:data:`~eagle_backbone.tree.MC_SIM_7B_63`, 25 nodes, 26 tokens a pass), the paper's setting.
* :class:`Eagle2TreePolicy` (``policy=eagle2_tree``): EAGLE-2's dynamic tree: expand the top-k frontier
  by cumulative draft log-probability for ``depth`` depths, then rerank every grown node and score the
  best ``total_tokens`` of each row (closed under ancestors), whatever the load.
* :class:`TreeBudgetPolicy` (``policy=tree_budget``): trees only where they pay. The depth is the load-aware
  γ at the running rate of the drafter's first choices; a step grows a tree only when a second choice pays
  for its scored token and the tree's own cost at this load, else it is a chain step; a tree step scores
  the batch's N most valuable nodes, N maximising (R + Σ chosen values) / cost(R, N) from the measured cost
  table, N = R (plain decoding) allowed (:func:`~eagle_backbone.tree.select_budget`).

A node's value is the product of calibrated per-node acceptance estimates along its path
(:func:`~eagle_backbone.tree.path_values`); the calibration (:class:`~ldlp.models.calibration.OnlineLogitCalibration`)
learns from every scored node whose parent the target accepted: kept if it is on the accepted path.
"""

from __future__ import annotations

import torch

from eagle_backbone.policy import EngineView, Rows, TreeOutcome, TreePolicy, int_at_least
from eagle_backbone.step_cost import OnlineCostModel
from eagle_backbone.tree import MC_SIM_7B_63, path_values, select_budget, top_nodes
from eagle_backbone.tree_draft import GrownTree, TreeSpec
from ldlp.models.calibration import OnlineLogitCalibration
from ldlp.policies.goodput import PLAN, StepReward, arm_priors, goodput_of
from ldlp.policies.pricing import DraftGate, FeedRate, RunningRate, StepPricing

SHAPES = {"mc_sim_7b_63": MC_SIM_7B_63}  # named static trees (EAGLE's tree_choices format)


class StaticTreePolicy(TreePolicy):
    """A fixed tree shape every step: ``paths`` a name in :data:`SHAPES` or a list of index paths
    (EAGLE/Medusa ``tree_choices``: [0] the top draft, [0, 1] its second child, ...)."""

    name = "static_tree"
    # no fixed_gamma: that marks a fixed chain γ (results compare against the best of those); a fixed tree is
    # no such baseline

    def __init__(self, paths="mc_sim_7b_63"):
        if isinstance(paths, str):
            if paths not in SHAPES:
                raise ValueError(f"static_tree policy: unknown shape {paths!r}; known: {sorted(SHAPES)} or a list of paths")
            paths = SHAPES[paths]
        if not paths:
            raise ValueError(f"static_tree policy: paths is empty; give a shape ({', '.join(sorted(SHAPES))}) or "
                             "a list of paths from the root, e.g. [[0], [1], [0, 0]]")
        try:
            self.tree = TreeSpec.static([list(p) for p in paths])
        except (TypeError, ValueError) as e:
            raise ValueError(f"static_tree policy: paths: {e}") from None
        self.max_gamma = self.tree.depth  # every row grows the whole shape



class Eagle2TreePolicy(TreePolicy):
    """EAGLE-2: ``top_k`` frontier and children, ``depth`` depths, the best ``total_tokens`` nodes of each row
    by cumulative draft log-probability (EAGLE-2's reranking)."""

    name = "eagle2_tree"

    def __init__(self, top_k: int = 4, depth: int = 6, total_tokens: int = 16):
        self.tree = TreeSpec(int_at_least(self.name, "top_k", top_k, 1), int_at_least(self.name, "depth", depth, 1))
        self.total_tokens = min(int_at_least(self.name, "total_tokens", total_tokens, 1), self.tree.max_nodes)
        self.max_gamma = self.tree.depth


    def select(self, grown: GrownTree, rows: Rows) -> torch.Tensor:
        score = torch.where(grown.valid, grown.score, float("-inf"))
        return top_nodes(score, grown.tree, self.total_tokens, per_row=True)

    def tree_width(self, rows: Rows) -> int:
        return self.total_tokens


class TreeBudgetPolicy(TreePolicy):
    """Dynamic trees under one batch-wide, cost-chosen budget (module docstring). Holds what the load-aware
    policies hold: the step's prices (:class:`~ldlp.policies.pricing.StepPricing`: ``cost_dir``/``cost_table``,
    profiled on first use when missing), the gate that decides whether a step drafts, and running rates.

    Per step:

    1. ``plan``: the depth D to grow (0: plain decoding), the load-aware γ for R rows
       (:func:`~ldlp.policies.load_aware.uniform_gamma`) at the running rate at which the target keeps the drafter's
       first choice (the tree's spine).
    2. ``tree_now``: does a tree pay this step? Its siblings add, per row, about the running kept rate of a
       second choice at depth 1, and cost the target's price of one more token a row plus the tree's own
       machinery (``tree_overhead_ms``: growing, selecting, moving the accepted path). If not, the step is a
       chain of D drafts, priced and run as a chain's; every ``explore_every``-th such step grows a tree
       anyway, to keep the siblings' rate current.
    3. A tree step: trees of ``top_k`` children a node, a frontier of ``width``, depth D; ``select``: node
       values (calibrated confidence products) and one budget N for the whole batch, at most ``max_nodes`` a
       row (:func:`~eagle_backbone.tree.select_budget`); ``verified``: the recalibration (one correction per
       sibling rank) and the kept/tested counts of first and second choices, on the device, read with the
       step's one read."""

    name = "tree_budget"
    needs_costs = True

    def __init__(self, pricing, top_k: int = 2, depth: int = 8, width: int | None = 1, max_nodes: int = 12,
                 recalibrate: bool = True, decay: float = 0.98, prior: float = 0.8, sibling_prior: float = 0.1,
                 tree_overhead_ms: float = 1.5, explore_every: int = 8, goodput=None):
        self.max_gamma = depth = int_at_least(self.name, "depth", depth, 1)
        # goodput feedback (ldlp/policies/goodput.py): the static chains are arms beside this policy's own plan,
        # so trees are kept only where they measurably pay
        self.goodput = goodput_of(self.name, goodput, self.max_gamma)
        self._reward = StepReward(self.goodput) if self.goodput is not None else None
        if not 0 < prior < 1:
            raise ValueError(f"{self.name} policy: prior must be in (0, 1), got {prior!r}")
        try:
            self.tree = TreeSpec(int_at_least(self.name, "top_k", top_k, 1), depth, width=width)
        except ValueError as e:
            raise ValueError(f"{self.name} policy: {e}") from None
        if not 0 <= sibling_prior < 1 or tree_overhead_ms < 0:
            raise ValueError(f"{self.name} policy: need 0 <= sibling_prior < 1 and tree_overhead_ms >= 0, got "
                             f"{sibling_prior!r}, {tree_overhead_ms!r}")
        self.max_nodes = min(int_at_least(self.name, "max_nodes", max_nodes, 1), self.tree.max_nodes)
        self.tree_overhead_ms = float(tree_overhead_ms)
        # the tree's own cost before a tree step is timed: the online model's prior for it
        self.pricing = StepPricing.of(self.name, pricing, model_options={"tree_prior_ms": self.tree_overhead_ms})
        self.gate = DraftGate(explore_every)
        self.explore_every = int(explore_every)
        self.accept = RunningRate(prior, 0.01, 0.99)  # P(the drafter's first choice kept), the tree's spine
        self.sibling = RunningRate(sibling_prior)  # P(second choice kept | its parent kept)
        self.feed = FeedRate()
        # one correction per sibling rank: under greedy decoding a node is kept only when its siblings before
        # it are not, so the second-best child of a confident parent is rarely kept whatever its confidence
        self.calibration = OnlineLogitCalibration(decay=decay, groups=self.tree.top_k) if recalibrate else None
        self.device = torch.device("cpu")
        self.tree_steps = self.chain_steps = 0
        self._depth, self._tree_now, self._chains = 0, False, 0
        self._counts: torch.Tensor | None = None  # this step's kept/tested first and second choices (device)

    @property
    def costs(self):
        return self.pricing.costs

    def bind(self, view: EngineView) -> None:
        super().bind(view)
        self.device = view.device
        self.pricing.bind(view)
        if self.calibration is not None:
            self.calibration.to(view.device)

    def tree_ms(self) -> float:
        """The tree machinery's own cost a step: the online model's (learned from timed tree steps, starting
        at ``tree_overhead_ms``), or ``tree_overhead_ms`` when the costs are a table."""
        return self.costs.tree_ms() if isinstance(self.costs, OnlineCostModel) else self.tree_overhead_ms

    # ---- plan: the depth, and whether a tree pays -------------------------------------------------------------
    def _step_ms(self, R: int, D: int, N: int, feed: float) -> float:
        """A step of R rows growing D depths (the first reads one token a row, deeper ones the frontier:
        ``width`` a row) and scoring N tokens: the cost table's one step formula (CostTable.step_ms)."""
        depth_rows = [R] + [R * self.tree.width] * (D - 1) if D else []
        return self.costs.step_ms(R, depth_rows, N, feed)

    def tree_pays(self, R: int, D: int) -> bool:
        """Whether a second choice at depth 1 on every row (the most valuable sibling) pays for one more scored
        token a row and the tree's own cost, against a chain of D at the spine's rate."""
        if D == 0 or self.tree.top_k < 2:
            return False
        c, a = self.costs, self.accept.value
        E = R * (1 + sum(a ** i for i in range(1, D + 1)))
        N = R * (D + 1)
        T = self._step_ms(R, D, N, self.feed.value)
        extra = c.target_ms(R, N + R) - c.target_ms(R, N) + self.tree_ms()
        return (E + R * self.sibling.value) / (T + extra) > E / T

    def plan(self, rows: Rows) -> list[int]:
        self._counts = None
        caps = [min(c, self.max_gamma) for c in rows.caps]
        if self.goodput is not None and self.costs is not None and any(caps):
            prior = arm_priors(self.pricing, len(caps), self.max_gamma, self.accept.value, self.feed.value)
            arm = self.goodput.choose(len(caps), prior)
            if arm != PLAN:  # a static chain this step
                out = [min(arm, c) for c in caps]
                self._depth, self._tree_now = max(out), False
                self.chain_steps += bool(self._depth)
                return out
        g = self.gate.gamma(self.pricing, caps, self.accept.value, self.feed.value)  # the load-aware γ, explore steps included
        out = [min(g, c) for c in caps]
        self._depth = D = max(out) if out else 0
        self._tree_now = False
        if D:
            if self.tree_pays(len(rows), D) or (self.explore_every and self._chains + 1 >= self.explore_every):
                self._tree_now, self._chains = True, 0
                self.tree_steps += 1
            else:
                self._chains += 1
                self.chain_steps += 1
        return out

    def tree_now(self) -> bool:
        return self._tree_now


    def timed(self, ms: float, shape) -> None:
        if self._reward is not None:
            self._reward.timed(ms, shape, self.costs)

    # ---- select: the budget -------------------------------------------------------------------------
    def values(self, grown: GrownTree) -> torch.Tensor:
        est = grown.confidence if self.calibration is None else self.calibration.calibrate(grown.confidence, grown.rank)
        return path_values(est.to(torch.float64), grown.tree)

    def _cost_vector(self, R: int, D: int, n_max: int) -> torch.Tensor:
        """cost[N] for N = 0 .. R + n_max scored tokens (ms; the fixed part included): a device vector per (R, D)."""
        key = (R, D, n_max, round(self.feed.value, 1))
        memo = self.pricing.memo("tree_cost_vector", shared=False)  # priced at this policy's running feed
        if key not in memo:
            tree_ms = self.tree_ms()
            memo[key] = torch.tensor([self._step_ms(R, D, N, self.feed.value) + tree_ms if N >= R else float("inf")
                                      for N in range(R + n_max + 1)], dtype=torch.float64, device=self.device)
        return memo[key]

    def select(self, grown: GrownTree, rows: Rows) -> torch.Tensor:
        R, K = grown.tokens.shape
        n_max = R * min(K, self.max_nodes)
        sel = select_budget(self.values(grown), grown.tree, self._cost_vector(R, self._depth, n_max), n_max=n_max,
                            per_row_cap=self.max_nodes)
        return sel.chosen

    def tree_width(self, rows: Rows) -> int:
        return self.max_nodes

    def verified(self, outcome: TreeOutcome) -> None:
        idx = outcome.index.clamp(min=0)
        tested = outcome.tested & (outcome.index >= 0)
        rank = outcome.grown.rank.gather(1, idx)
        first, second = tested & (rank == 0), tested & (rank == 1)
        self._counts = torch.stack([(outcome.kept & first).sum(), first.sum(), (outcome.kept & second).sum(),
                                    second.sum()])
        if self.calibration is not None:
            self.calibration.update(outcome.grown.confidence.gather(1, idx), outcome.kept, tested, rank)

    # ---- observe: the running rates ------------------------------------------------------------------------
    def reads(self) -> dict[str, torch.Tensor]:
        return {"choices": self._counts} if self._counts is not None else {}

    def observe(self, rows: Rows, drafted: list[int], accepted: list[int], extra: dict | None = None) -> None:
        self.feed.update(accepted)
        if self._reward is not None:
            self._reward.observed(accepted, drafted)
        counts = (extra or {}).get("choices")
        if counts:  # a tree step: the first and second choices' outcomes
            kept, n, kept2, n2 = counts
            self.sibling.update(kept2, n2)
        elif self._depth:  # a chain step: drafts 1..k kept, draft k + 1 (if drafted) the first rejection
            kept = sum(min(a, d) for a, d in zip(accepted, drafted))
            n = sum(min(d, a + 1) for a, d in zip(accepted, drafted))
        else:
            return
        self.accept.update(kept, n)
