"""Draft trees: representation, verification (greedy and lossless sampling) and selection, for R rows at once.

A step's drafts for one row are a tree rooted at the row's last accepted token (the *root*, which the
target scores too). Each row holds K node slots, padded:

* ``tokens[r, i]``  the drafted token of node i;
* ``parents[r, i]`` the index of node i's parent among the row's nodes, -1 for the root;
* ``valid[r, i]``   whether slot i holds a node (padding may sit anywhere; a valid node's parent is valid).

Nodes are in topological order: a node's parent has a smaller index (``parents[r, i] < i``). The order
among siblings is the order verification tries them in. A chain is ``parents = i - 1``, exactly the
engine's :class:`~eagle_backbone.step_records.DraftRecord`. The target scores ``[root, node 0, ..., node K-1]``,
so everything indexed by "verification position" has 1 + K entries, position 0 being the root.

Everything here is device tensor ops with no host reads: Python loops run over node slots or over
log2(K) pointer-jumping rounds, never over rows or the vocabulary.

Verification:

* greedy (:func:`verify_tree_greedy`): the longest path whose every token is the target's argmax at its
  parent; on a chain this is :func:`~eagle_backbone.sampling.verify_greedy_batch`.
* sampling (:func:`verify_tree_sampling`): SpecInfer's recursive rejection sampling. At a node, its
  children are tried in order against a residual r that starts as the target's p there. A
  *deterministic* child x (the drafter's top-k, not drawn at random) is accepted with probability
  r(x); on rejection r(x) = 0 and r is renormalised. A *sampled* child x ~ q is accepted with
  min(1, r(x)/q(x)); on rejection r = normalise(max(r - q, 0)). An accepted child is descended into; when
  no child is accepted the next token is drawn from r. Each step keeps "the token emitted here is
  distributed as r" true, which is why the whole is lossless (tests/test_tree.py enumerates it exactly).
  On a chain of sampled drafts it is :func:`~eagle_backbone.sampling.verify_sampling_batch`, uniform for
  uniform.

Selection (:func:`select_budget`, :func:`top_nodes`): a node's value is the probability that its whole
path is accepted, so it is never above its parent's, and the expected tokens a row emits are
1 + Σ values of its scored nodes. A top-n over values (ties: shallower first) is therefore closed under
ancestors, for one row or across the batch, and the batch-wide budget is the n that maximises
(R + top-n sum) / cost(R, R + n).

Static shapes: :data:`MC_SIM_7B_63`, the official EAGLE default tree, and :func:`paths_to_tree`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from eagle_backbone.sampling import ACCEPT, FINAL, accept_probability, residual, sample_rows, uniforms

# ---- static shapes ----------------------------------------------------------------------------------

# The official EAGLE default tree (SafeAILab/EAGLE, eagle/model/choices.py; the name is Medusa's, whose
# 63-node tree it was cut down from): 25 nodes, so 26 tokens a verification pass with the root, depth 5.
# A path [a, b, c] is: the a-th most likely draft after the root, then its b-th, then that node's c-th.
MC_SIM_7B_63 = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]


class TreeShape(NamedTuple):
    """A static tree as (K,) tensors, nodes sorted by (depth, path): parents before children, siblings by rank."""

    paths: list[tuple[int, ...]]
    parents: torch.Tensor  # (K,) long, -1 = root
    depth: torch.Tensor  # (K,) long, 1 for the root's children
    rank: torch.Tensor  # (K,) long, the node's top-k index among its parent's drafts (the path's last entry)


def paths_to_tree(paths: Sequence[Sequence[int]], device=None) -> TreeShape:
    """A list of index paths (EAGLE/Medusa ``tree_choices``) -> parents, depth and rank-among-siblings.

    Paths are sorted by (length, path) so that parents precede children and siblings are tried best rank
    first, whatever order the list came in. Every proper prefix of a path must be in the list too."""
    ps = sorted({tuple(int(t) for t in p) for p in paths}, key=lambda p: (len(p), p))
    if len(ps) != len(paths):
        raise ValueError("paths_to_tree: duplicate paths")
    if any(len(p) == 0 or min(p) < 0 for p in ps):
        raise ValueError("paths_to_tree: paths must be non-empty lists of ranks >= 0")
    index = {p: i for i, p in enumerate(ps)}
    missing = [p for p in ps if len(p) > 1 and p[:-1] not in index]
    if missing:
        raise ValueError(f"paths_to_tree: not closed under prefixes, e.g. {list(missing[0])} has no parent")
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in ps]
    as_t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return TreeShape(ps, as_t(parents), as_t([len(p) for p in ps]), as_t([p[-1] for p in ps]))


# ---- representation ---------------------------------------------------------------------------------


def ancestor_matrix(parents: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """(R, K) parents -> (R, K, K) bool, ``A[r, i, j]``: node j is node i or one of its ancestors.

    Pointer jumping: after round s every node knows its ancestors fewer than 2^s hops up and the node
    2^s hops up, so ceil(log2 K) rounds of gathers cover any depth. The root is a virtual node K that is
    its own parent (it stops the jumps) and is dropped at the end. Rows and columns of invalid nodes are
    False."""
    R, K = parents.shape
    dev = parents.device
    root = K
    up = torch.where(parents < 0, root, parents)
    if valid is not None:
        up = torch.where(valid, up, root)  # padding may hold any parent: hang it off the root
    up = torch.cat([up, torch.full((R, 1), root, dtype=up.dtype, device=dev)], 1)  # (R, K+1)
    A = torch.eye(K + 1, dtype=torch.bool, device=dev).expand(R, K + 1, K + 1)
    for _ in range((K - 1).bit_length()):
        A = A | A.gather(1, up[..., None].expand(R, K + 1, K + 1))
        up = up.gather(1, up)
    A = A[:, :K, :K]
    if valid is not None:
        A = A & valid[:, :, None] & valid[:, None, :]
    return A


def node_depth(ancestors: torch.Tensor) -> torch.Tensor:
    """(R, K, K) ancestor matrix -> (R, K) depth: 1 for the root's children, 0 for padding."""
    return ancestors.sum(-1)


def ancestor_closed(selected: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """(R, K) bool selection -> (R,) bool: every selected node's parent is the root or selected too
    (unselected nodes may hold any parent value)."""
    K = parents.shape[1]
    par_sel = (selected.gather(1, parents.clamp(0, max(K - 1, 0))) & (parents < K)) | (parents < 0)
    return ~(selected & ~par_sel).any(-1)


def is_tree(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(R,) bool: each row's valid nodes form a tree in topological order (-1 <= parent < own index, the
    parent valid)."""
    K = parents.shape[1]
    idx = torch.arange(K, device=parents.device)
    in_range = (parents >= -1) & (parents < idx)
    return ~(valid & ~in_range).any(-1) & ancestor_closed(valid, parents)


@dataclass(eq=False)
class DraftTree:
    """R rows of padded draft trees (see the module docstring). Derived tensors are computed once, on use."""

    tokens: torch.Tensor  # (R, K) long
    parents: torch.Tensor  # (R, K) long, -1 = the row's root (its last accepted token)
    valid: torch.Tensor  # (R, K) bool

    @classmethod
    def chain(cls, tokens: torch.Tensor, lengths: torch.Tensor) -> DraftTree:
        """Chains of ``lengths[r]`` drafts: node i's parent is i - 1 (the engine's DraftRecord today)."""
        R, K = tokens.shape
        ar = torch.arange(K, device=tokens.device)
        return cls(tokens, (ar - 1).expand(R, K), ar[None] < lengths[:, None])

    @classmethod
    def from_record(cls, rec) -> DraftTree:
        """From a :class:`~eagle_backbone.step_records.DraftRecord` (its ``lengths`` nodes per row come first)."""
        K = rec.tokens.shape[1]
        return cls(rec.tokens, rec.parents, torch.arange(K, device=rec.tokens.device)[None] < rec.lengths[:, None])

    @classmethod
    def static(cls, shape: TreeShape, tokens: torch.Tensor) -> DraftTree:
        """A static shape's (K,) parents for every row of ``tokens`` (R, K), all nodes valid."""
        R, K = tokens.shape
        par = shape.parents.to(tokens.device)
        return cls(tokens, par.expand(R, K), torch.ones(R, K, dtype=torch.bool, device=tokens.device))

    @property
    def R(self) -> int:
        return self.tokens.shape[0]

    @property
    def K(self) -> int:
        return self.tokens.shape[1]

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """(R, K, K) bool: node i sees node j (j is i or an ancestor of i); padding sees nothing."""
        return ancestor_matrix(self.parents, self.valid)

    @cached_property
    def depth(self) -> torch.Tensor:
        """(R, K) long: 1 for the root's children, 0 for padding."""
        return node_depth(self.ancestors)

    def attention_mask(self) -> torch.Tensor:
        """(R, 1+K, 1+K) bool over the verification input [root, nodes]: True where query i may attend
        key j (besides the row's cache, which every query sees). Every query sees the root and itself (so
        padded queries have a key and cannot produce NaNs); a node also sees its ancestors."""
        R, K = self.tokens.shape
        dev = self.tokens.device
        m = torch.zeros(R, 1 + K, 1 + K, dtype=torch.bool, device=dev)
        m[:, 1:, 1:] = self.ancestors
        m[:, :, 0] = True
        m |= torch.eye(1 + K, dtype=torch.bool, device=dev)
        return m

    def positions(self, lengths: torch.Tensor, pad: int | None = None) -> torch.Tensor:
        """(R, 1+K) positions of [root, nodes]: the root at ``lengths`` (the position of the row's last
        token), a node at that plus its depth. Padding gets ``pad`` (e.g. the engine's trash position)
        when given, else the root's position."""
        root = torch.zeros(self.R, 1, dtype=self.depth.dtype, device=self.depth.device)  # (also when K = 0)
        pos = lengths[:, None] + torch.cat([root, self.depth], 1)
        if pad is not None:
            keep = torch.cat([root == 0, self.valid], 1)
            pos = torch.where(keep, pos, pad)
        return pos

    def is_valid(self) -> torch.Tensor:
        """(R,) bool, :func:`is_tree` of this tree."""
        return is_tree(self.parents, self.valid)


def path_of(tree: DraftTree, node: torch.Tensor) -> torch.Tensor:
    """(R,) node index (-1 = root) -> (R, K) the nodes from the root's child down to ``node``, -1 padded."""
    R, K = tree.tokens.shape
    on = tree.ancestors.gather(1, node.clamp(min=0)[:, None, None].expand(R, 1, K))[:, 0] & (node >= 0)[:, None]
    # node j of the path sits at depth(j) - 1; the others go to a spare column that is cut off
    slot = torch.where(on, tree.depth - 1, K)
    path = torch.full((R, K + 1), -1, dtype=torch.long, device=node.device)
    path.scatter_(1, slot, torch.arange(K, device=node.device).expand(R, K))
    return path[:, :K]


def on_path(path: torch.Tensor) -> torch.Tensor:
    """(R, K) accepted path (node indices, -1 padded) -> (R, 1 + K) bool over [root, nodes]: the root and
    the nodes on the path."""
    R, K = path.shape
    on = torch.zeros(R, K + 1, dtype=torch.bool, device=path.device)
    on[:, 0] = True  # the root; padding (-1) lands there too
    return on.scatter_(1, path + 1, True)


def emitted_tokens(tree: DraftTree, path: torch.Tensor, accepted: torch.Tensor,
                   next_token: torch.Tensor) -> torch.Tensor:
    """(R, K+1) the step's new tokens per row: the accepted path's tokens, then the next token at index
    ``accepted`` (0 after it), as the chain engine's ``emitted``."""
    toks = torch.where(path >= 0, tree.tokens.gather(1, path.clamp(min=0)), 0)
    out = torch.cat([toks, torch.zeros_like(next_token)[:, None]], 1)
    return out.scatter_(1, accepted[:, None], next_token[:, None])


# ---- greedy verification ----------------------------------------------------------------------------


def verify_tree_greedy(tree: DraftTree, target_logits: torch.Tensor):
    """``target_logits`` (R, 1+K, V) at [root, nodes] -> (accepted (R,), path (R, K), next token (R,)).

    A node is kept when its token and all its ancestors' tokens are the target's argmax at their parents;
    the deepest kept node wins (among kept nodes of one depth, which only duplicate siblings make
    possible, the smallest index). ``path`` lists the accepted nodes root-side first, -1 padded; the next token is
    the argmax at the last accepted node (the bonus token)."""
    R, K = tree.tokens.shape
    best = target_logits.argmax(-1)  # (R, 1+K)
    if K == 0:
        z = torch.zeros(R, dtype=torch.long, device=best.device)
        return z, torch.zeros(R, 0, dtype=torch.long, device=best.device), best[:, 0]
    match = tree.valid & (tree.tokens == best.gather(1, tree.parents.clamp(-1, K - 1) + 1))
    A = tree.ancestors
    kept = tree.valid & ~(A & ~match[:, None, :]).any(-1)
    idx = torch.arange(K, device=best.device)
    score = torch.where(kept, tree.depth * (K + 1) + (K - idx), -1)
    node = torch.where(kept.any(-1), score.argmax(-1), -1)
    accepted = torch.where(node >= 0, tree.depth.gather(1, node.clamp(min=0)[:, None])[:, 0], 0)
    return accepted, path_of(tree, node), best.gather(1, (node + 1)[:, None])[:, 0]


# ---- sampling verification --------------------------------------------------------------------------


def _normalise(r: torch.Tensor) -> torch.Tensor:
    total = r.sum(-1, keepdim=True)
    return r / total.clamp_min(torch.finfo(r.dtype).tiny)


def _reject_deterministic(r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The residual after rejecting a deterministic draft x: r(x) = 0, renormalised. (A rejection had
    probability 1 - r(x) > 0, so something is left.)"""
    return _normalise(r.scatter(1, x[:, None], 0.0))


def _reject_sampled(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The residual after rejecting a draft x ~ q: normalise(max(r - q, 0)) (sampling.residual)."""
    return residual(r, q)


class TreeWalk(NamedTuple):
    """What :func:`tree_walk` did per row."""

    accepted: torch.Tensor  # (R,) accepted nodes (the path's length)
    path: torch.Tensor  # (R, K) accepted nodes, root side first, -1 padded
    node: torch.Tensor  # (R,) the last accepted node, -1 = the root
    residual: torch.Tensor  # (R, V) the distribution the next token is drawn from (need not sum to 1)
    tested: torch.Tensor  # (R, K) bool: the node was tried
    accept_prob: torch.Tensor  # (R, K) its acceptance probability when tried (0 otherwise)


def tree_walk(tree: DraftTree, p: torch.Tensor, q: torch.Tensor | None, deterministic: torch.Tensor | None,
              u_accept: torch.Tensor) -> TreeWalk:
    """Recursive rejection sampling down R trees at once, up to (not including) the final draw.

    ``p`` (R, 1+K, V) the target's distributions at [root, nodes]; ``q`` (R, K, V) the distribution each
    sampled node was drawn from (None: every node is deterministic); ``deterministic`` (R, K) bool, True
    for a node that was chosen, not drawn (the drafter's top-k; None: all sampled); ``u_accept``
    (R, K) node i's acceptance uniform (accepted when u < its acceptance probability).

    One pass over node slots in index order does the whole walk: a row's current node c starts at the
    root, node i is tried iff it is valid and its parent is c (so c's children are tried in index order,
    and once a child is accepted its siblings no longer match); accepting it moves c to i, whose
    children all have larger indices. Rows never wait on each other and nothing is read on the host.

    ``accept_prob`` of the tried nodes is what the target made of them: the online signal a calibrated
    acceptance estimate can learn from. ``q`` per node is what DraftRecord.probs holds for a chain; the
    rows of deterministic nodes may hold anything (their values never reach a result)."""
    R, K = tree.tokens.shape
    if K and q is None and deterministic is None:
        raise ValueError("tree_walk: sampled nodes need q (pass deterministic=all True for a top-k tree)")
    dev = p.device
    node = torch.full((R,), -1, dtype=torch.long, device=dev)
    accepted = torch.zeros(R, dtype=torch.long, device=dev)
    path = torch.full((R, K), -1, dtype=torch.long, device=dev)
    tested = torch.zeros(R, K, dtype=torch.bool, device=dev)
    accept_prob = torch.zeros(R, K, dtype=p.dtype, device=dev)
    cols = torch.arange(K, device=dev)
    r = p[:, 0]
    for i in range(K):
        try_i = tree.valid[:, i] & (tree.parents[:, i] == node)
        x = tree.tokens[:, i]
        r_x = r.gather(1, x[:, None])[:, 0]
        det = deterministic[:, i] if deterministic is not None else None
        if q is not None:
            q_x = q[:, i].gather(1, x[:, None])[:, 0]
            prob = accept_probability(r_x, q_x)
            r_rej = _reject_sampled(r, q[:, i])
        if det is not None:
            # r is a distribution here up to rounding (p, or a renormalised residual): divide by its sum so
            # that an unnormalised p cannot bias the test
            prob_det = r_x / r.sum(-1).clamp_min(torch.finfo(r.dtype).tiny)
            r_rej_det = _reject_deterministic(r, x)
            prob = prob_det if q is None else torch.where(det, prob_det, prob)
            r_rej = r_rej_det if q is None else torch.where(det[:, None], r_rej_det, r_rej)
        acc = try_i & (u_accept[:, i] < prob)
        rej = try_i & ~acc
        tested[:, i] = try_i
        accept_prob[:, i] = torch.where(try_i, prob, 0)
        # rejected: carry on with the residual at the same node; accepted: descend, starting over from p
        r = torch.where(rej[:, None], r_rej, r)
        r = torch.where(acc[:, None], p[:, i + 1], r)
        path = torch.where(acc[:, None] & (cols[None] == accepted[:, None]), i, path)
        accepted = accepted + acc.long()
        node = torch.where(acc, i, node)
    return TreeWalk(accepted, path, node, r, tested, accept_prob)


def verify_tree_sampling(tree: DraftTree, p: torch.Tensor, q: torch.Tensor | None, deterministic: torch.Tensor | None,
                         u_accept: torch.Tensor, u_final: torch.Tensor):
    """Lossless tree verification for R rows: :func:`tree_walk`, then the next token drawn from its
    residual with ``u_final`` (R,). Returns (accepted (R,), path (R, K), next token (R,)).

    With ``tree = DraftTree.chain(draft, lengths)``, ``deterministic=None`` and the same uniforms this is
    :func:`~eagle_backbone.sampling.verify_sampling_batch` (same counts, same tokens)."""
    w = tree_walk(tree, p, q, deterministic, u_accept)
    return w.accepted, w.path, sample_rows(w.residual, u_final)


def tree_uniforms(seeds: torch.Tensor, steps: torch.Tensor, K: int):
    """The rows' verification uniforms for a step with K node slots, from their own random streams:
    node i's acceptance test uses draw ``ACCEPT + i`` and the final token ``FINAL`` (for a chain, the
    draws the chain engine uses). A sampled node i is drafted with draw ``DRAFT + i``.
    Returns (u_accept (R, K), u_final (R,))."""
    if K > FINAL - ACCEPT:
        raise ValueError(f"tree_uniforms: at most {FINAL - ACCEPT} nodes a row, got {K}")
    draws = torch.cat([ACCEPT + torch.arange(K, device=seeds.device),
                       torch.tensor([FINAL], device=seeds.device)])
    u = uniforms(seeds, steps, draws)
    return u[:, :K], u[:, K]


# ---- selection --------------------------------------------------------------------------------------


def path_values(estimates: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """(R, K) per-node acceptance estimates (the chance a node is accepted given its parent is) -> (R, K)
    node values: the product along the node's path, the chance the whole path is accepted (0 for padding)."""
    prod = torch.where(tree.ancestors, estimates[:, None, :], torch.ones_like(estimates)[:, None, :]).prod(-1)
    return torch.where(tree.valid, prod, 0)


def _ranking_key(values: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """(R, K) the value a budget ranks nodes by: clamped to the minimum along the node's path (so a child
    never outranks its parent even when the given values are not monotone; products of estimates in
    [0, 1] already are), -inf for padding."""
    inf = torch.full_like(values, float("inf"))[:, None, :]
    v = torch.where(tree.ancestors, values[:, None, :], inf).amin(-1)
    return torch.where(tree.valid, v, float("-inf"))


def _order(key: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Indices sorting the last dim by key descending, then depth ascending (a parent before a child of
    equal value), then index: two stable sorts, the minor key first."""
    by_depth = torch.sort(depth, dim=-1, stable=True).indices
    by_value = torch.sort(key.gather(-1, by_depth), dim=-1, descending=True, stable=True).indices
    return by_depth.gather(-1, by_value)


def _rank(order: torch.Tensor) -> torch.Tensor:
    """The inverse permutation of ``order`` along its last dim: each element's place in the order."""
    places = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, places)


def top_nodes(values: torch.Tensor, tree: DraftTree, n: int | torch.Tensor, per_row: bool = False) -> torch.Tensor:
    """(R, K) bool, ancestor-closed: the n most valuable nodes over the whole batch, or with ``per_row`` the
    n most valuable of each row (``n`` an int or (R,) per-row caps; EAGLE-2's fixed total is an int).
    Fewer where fewer nodes are valid."""
    key = _ranking_key(values, tree)
    if per_row:
        n = torch.as_tensor(n, device=values.device)
        return (_rank(_order(key, tree.depth)) < (n[:, None] if n.dim() else n)) & tree.valid
    return (_rank(_order(key.flatten(), tree.depth.flatten())).view_as(key) < n) & tree.valid


class Selection(NamedTuple):
    chosen: torch.Tensor  # (R, K) bool, ancestor-closed per row
    n_drafts: torch.Tensor  # () long: chosen nodes over the batch; the budget N is R + n_drafts
    per_row: torch.Tensor  # (R,) chosen nodes per row
    objective: torch.Tensor  # () float64 expected tokens per second: (R + Σ chosen values) / cost(R, N)


def budget_costs(cost: Callable[[int, int], float] | torch.Tensor | Sequence[float], R: int, n_max: int,
                 device=None) -> torch.Tensor:
    """(n_max + 1,) float64: the cost of scoring N = R + n tokens, n = 0..n_max, for R rows.

    ``cost`` is a callable ``cost(R, N) -> seconds`` (e.g. a step's verification plus drafting from
    :class:`~eagle_backbone.cost.CostTable`) or a table indexed by N (``cost[N]``; past its end a
    budget is not allowed: inf). Both depend only on shapes: host work, no device read."""
    if callable(cost):
        vals = [float(cost(R, R + n)) for n in range(n_max + 1)]
        return torch.tensor(vals, dtype=torch.float64, device=device)
    table = torch.as_tensor(cost, dtype=torch.float64).flatten().to(device)
    out = torch.full((n_max + 1,), float("inf"), dtype=torch.float64, device=device)
    m = max(0, min(n_max + 1, table.numel() - R))
    out[:m] = table[R: R + m]
    return out


def select_budget(values: torch.Tensor, tree: DraftTree, cost, n_max: int | None = None,
                  per_row_cap: int | torch.Tensor | None = None) -> Selection:
    """One batch-wide budget: the n (0 <= n <= n_max, default R*K) maximising (R + top-n sum) / cost(R, R + n),
    and its top-n nodes. n = 0 (plain decoding, N = R) is always a candidate.

    For a fixed n the top-n values are the best sum over all n-node sets, and they are ancestor-closed
    (values never rise down a path; ties go to the shallower node), so the best budget and set come from
    one sort and one cumulative sum, on the device. ``per_row_cap`` (int or (R,)) first keeps only each
    row's best cap nodes (still closed). ``cost`` as in :func:`budget_costs`."""
    R, K = tree.tokens.shape
    n_max = R * K if n_max is None else min(n_max, R * K)
    if per_row_cap is not None:
        tree = DraftTree(tree.tokens, tree.parents, top_nodes(values, tree, per_row_cap, per_row=True))
    key = _ranking_key(values, tree).flatten()
    order = _order(key, tree.depth.flatten())
    sv = key[order]  # padding (-inf) last
    gain = torch.cat([sv.new_zeros(1), torch.where(torch.isfinite(sv), sv, 0).cumsum(0)])[: n_max + 1]
    costs = budget_costs(cost, R, n_max, device=values.device)
    n = torch.arange(n_max + 1, device=values.device)
    obj = torch.where(n <= tree.valid.sum(), (R + gain.to(torch.float64)) / costs, float("-inf"))
    best = obj.argmax()  # the first maximum: the smallest budget among equals
    chosen = (_rank(order).view(R, K) < best) & tree.valid
    # (obj[best] would read the host: a 0-d index tensor is turned into a Python int)
    return Selection(chosen, best, chosen.sum(-1), obj.gather(0, best.view(1))[0])


def prune(tree: DraftTree, keep: torch.Tensor, width: int | None = None):
    """The kept nodes (ancestor-closed) packed to the front of each row: (DraftTree of width ``width``
    (default K), index (R, width) each new node's old index, -1 padded). Order is kept, so parents still
    precede children and siblings keep their try order."""
    R, K = tree.tokens.shape
    width = K if width is None else width
    keep = keep & tree.valid
    new_idx = keep.long().cumsum(1) - 1  # (R, K) new index of each kept node
    slot = torch.where(keep, new_idx, width).clamp(max=width)
    index = torch.full((R, width + 1), -1, dtype=torch.long, device=keep.device)
    index.scatter_(1, slot, torch.arange(K, device=keep.device).expand(R, K))
    index = index[:, :width]
    has = index >= 0
    old = index.clamp(min=0)
    old_par = torch.where(has, tree.parents.gather(1, old), -1)  # (padding's old slot may hold junk)
    par = torch.where(old_par >= 0, new_idx.gather(1, old_par.clamp(min=0)), -1)
    toks = torch.where(has, tree.tokens.gather(1, old), 0)
    return DraftTree(toks, torch.where(has, par, -1), has), index
