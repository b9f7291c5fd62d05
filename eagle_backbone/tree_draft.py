"""Growing draft trees with a candidate generator, depth by depth, on the device (EAGLE-2's expansion).

A tree policy (:class:`~eagle_backbone.policy.DraftPolicy` with a ``tree`` spec) makes the engine grow a tree
for every running row instead of a chain:

1. **Depth 1**: the generator's distribution after the row's last token (``start``); its top-k tokens
   are the root's children.
2. **Each next depth**: the *frontier*, W nodes a row, runs through the generator in one forward for the
   whole batch (``extend_tree``): each frontier node sees the row's accepted prefix and its own ancestors
   fed at earlier depths, never its siblings or cousins. Each frontier node's top-k tokens become its
   children.

   * dynamic (:class:`TreeSpec` with ``shape=None``): the frontier is the ``width`` newest nodes of the
     highest cumulative log-probability (EAGLE-2: k expanded nodes with k children each, k² candidates a
     depth; ``width=1``: the top path, each of its nodes with k children);
   * static (``shape``, e.g. :data:`~eagle_backbone.tree.MC_SIM_7B_63`): the shape's nodes that have
     children, and the children the shape lists (rank r = the parent's r-th most likely token).

Greedy, every node is a deterministic choice (a top-k token). Sampling, a node's children are independent
draws from the drafter's distribution q with the row's random stream, verified by recursive rejection
sampling (SpecInfer: :func:`~eagle_backbone.tree.tree_walk`); deterministic top-k children would be
lossless too, but are accepted only with the target's own probability, far less often at T = 1. The grown tree holds every node
of every depth up to each row's depth cap; the policy then selects which nodes the target scores
(:meth:`~eagle_backbone.policy.DraftPolicy.select`), closed under ancestors. Nothing here reads the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from eagle_backbone.sampling import ACCEPT, DRAFT, probs_from_logits, sample_rows, uniforms
from eagle_backbone.tree import DraftTree, paths_to_tree


@dataclass(frozen=True)
class TreeSpec:
    """How a policy's trees grow: ``top_k`` children per expanded node, at most ``depth`` depths, and a
    frontier of ``width`` nodes expanded a depth (default ``top_k``, EAGLE-2's; 1: the drafter runs a chain,
    the top path, and every node on it keeps its top-k as leaves: a chain's drafting cost, a tree's
    coverage); ``shape`` (paths, EAGLE's ``tree_choices`` format) fixes the tree instead."""

    top_k: int = 4
    depth: int = 6
    shape: tuple[tuple[int, ...], ...] | None = None
    width: int | None = None

    def __post_init__(self):
        if self.shape is not None:
            tree = paths_to_tree(self.shape)  # checks the paths (closed under prefixes, no duplicates)
            object.__setattr__(self, "top_k", max(p[-1] for p in tree.paths) + 1)
            object.__setattr__(self, "depth", max(len(p) for p in tree.paths))
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"tree: top_k must be an integer >= 1, got {self.top_k!r}")
        if not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"tree: depth must be an integer >= 1, got {self.depth!r}")
        if self.width is None:
            object.__setattr__(self, "width", self.top_k)
        if not isinstance(self.width, int) or not 1 <= self.width <= self.top_k:
            raise ValueError(f"tree: width must be an integer in [1, top_k={self.top_k}], got {self.width!r}")
        if self.max_nodes > ACCEPT - DRAFT:
            raise ValueError(f"tree: {self.max_nodes} nodes a row (top_k={self.top_k}, depth={self.depth}, "
                             f"width={self.width}), more than the {ACCEPT - DRAFT} a row's random stream can draw for; "
                             "lower policy.top_k, policy.depth or policy.width (or give a smaller policy.shape)")

    @classmethod
    def static(cls, paths) -> TreeSpec:
        return cls(shape=tuple(tuple(int(x) for x in p) for p in paths))

    @functools.cached_property
    def levels(self) -> list[list[tuple[int, int, int]]] | None:
        """A static shape by depth, as host ints: per depth, (node index, parent index or -1, rank)."""
        if self.shape is None:
            return None
        paths = sorted(self.shape, key=lambda p: (len(p), p))  # paths_to_tree's node order
        index = {p: i for i, p in enumerate(paths)}
        out = [[] for _ in range(max(len(p) for p in paths))]
        for i, p in enumerate(paths):
            out[len(p) - 1].append((i, index[p[:-1]] if len(p) > 1 else -1, p[-1]))
        return out

    @property
    def max_nodes(self) -> int:
        """Nodes a row's grown tree holds at full depth."""
        if self.shape is not None:
            return len(self.shape)
        return self.top_k + (self.depth - 1) * self.width * self.top_k

    @property
    def fed(self) -> int:
        """Nodes a row feeds the generator at full depth (the frontiers of depths 1 .. depth - 1)."""
        if self.shape is not None:
            parents = {p[:-1] for p in self.shape if len(p) > 1}
            return len(parents)
        return (self.depth - 1) * self.width


@dataclass
class GrownTree:
    """R rows of grown trees, K nodes each in topological order (parents first, siblings by rank)."""

    tokens: torch.Tensor  # (R, K) long
    parents: torch.Tensor  # (R, K) long, -1 = the root (the row's last accepted token)
    depth: torch.Tensor  # (R, K) long, 1 for the root's children
    logq: torch.Tensor  # (R, K) float32: the drafter's log-probability of the node's token at its parent
    score: torch.Tensor  # (R, K) float32: logq summed along the node's path
    valid: torch.Tensor  # (R, K) bool: within the row's depth cap
    rank: torch.Tensor  # (R, K) long: the node's place among its parent's top-k (0: the most likely), or draws
    q: torch.Tensor | None = None  # (R, K, V) sampling only: the distribution each node was drawn from

    @functools.cached_property
    def tree(self) -> DraftTree:
        """The grown nodes as a :class:`~eagle_backbone.tree.DraftTree` (one object: its ancestors are computed once)."""
        return DraftTree(self.tokens, self.parents, self.valid)

    @property
    def confidence(self) -> torch.Tensor:
        """(R, K) the drafter's probability of each node's token at its parent."""
        return self.logq.exp()


def _frontier_visibility(fed_anc, parent_fed, W: int, offset: int, R: int, device):
    """The new frontier's rows of the fed-ancestor matrix: its parent's row (the parent and its ancestors,
    all fed earlier) and itself. Returns (visible (R, W, offset + W), the whole matrix (R, offset + W, offset + W))."""
    eye = torch.eye(W, dtype=torch.bool, device=device).expand(R, W, W)
    if offset == 0:
        return eye, eye
    up = fed_anc.gather(1, parent_fed[..., None].expand(R, W, offset))  # (R, W, offset)
    vis = torch.cat([up, eye], 2)
    grown = torch.cat([torch.nn.functional.pad(fed_anc, (0, W)), vis], 1)
    return vis, grown


def _children(logits: torch.Tensor, k: int, first: int, sampling, seeds, steps):
    """Each parent's k children from its generator logits (R, W, V): greedy, its top-k (sorted); sampling, k
    independent draws from the drafter's distribution q (temperature, top-k, top-p as the target's), node
    ``first + w·k + j`` drawn with its row's stream at ``DRAFT + node``. Returns tokens (R, W, k), their
    log-probabilities (R, W, k) and q (R, W, V) (None when greedy)."""
    if sampling is None or sampling.greedy:
        lp, tok = torch.log_softmax(logits.float(), -1).topk(k, -1)
        return tok, lp, None
    R, W, V = logits.shape
    q = probs_from_logits(logits, sampling)
    nodes = first + torch.arange(W * k, device=logits.device)
    u = uniforms(seeds, steps, DRAFT + nodes)  # (R, W·k)
    tok = sample_rows(q.repeat_interleave(k, 1).reshape(R * W * k, V), u.reshape(-1)).view(R, W, k)
    return tok, q.gather(2, tok).clamp_min(torch.finfo(q.dtype).tiny).log().float(), q


def grow_tree(cand, slots: list[int], tlens: list[int], caps: list[int], spec: TreeSpec, sampling=None,
              seeds: torch.Tensor | None = None, steps: torch.Tensor | None = None) -> GrownTree:
    """Grow one tree per row with the candidate generator ``cand`` (its ``start`` and ``extend_tree``):
    ``caps`` the most depths each row may draft (the plan's γ; 0: no node is valid). Greedy (``sampling``
    None or greedy) the children are the top-k; sampling, draws from q with the rows' random streams
    (``seeds``, ``steps``), and the grown tree keeps each node's q for verification."""
    R, k = len(slots), spec.top_k
    D = max(1, min(spec.depth, max(caps)))
    logits, state = cand.start(slots, tlens)
    dev = logits.device
    shape = spec.shape
    if shape is not None:
        by_depth = spec.levels  # the shape's nodes by depth: (index, parent index, rank), host ints
        has_child = {p for level in by_depth for _, p, _ in level if p >= 0}
    t, s, q = _children(logits[:, None], k, 0, sampling, seeds, steps)
    t, s = t[:, 0], s[:, 0]  # (R, k)
    if shape is not None:
        ranks = torch.tensor([r for _, _, r in by_depth[0]], device=dev)
        s, t = s[:, ranks], t[:, ranks]
    qs = None if q is None else [q.expand(R, t.shape[1], q.shape[-1])]
    toks, pars, lqs, scores, depths = [t], [torch.full_like(t, -1)], [s], [s], [1] * t.shape[1]
    ranks = [r for _, _, r in by_depth[0]] if shape is not None else list(range(k))
    n = t.shape[1]  # nodes so far
    # the frontier: its node ids, tokens, cumulative scores, parents' states, and its parents' fed indices
    # which nodes to expand: greedy, by cumulative log-probability (EAGLE-2); sampling, draws are exchangeable
    # but verification tries a parent's children in draw order and the first is kept far more often, so by
    # the sum of draw ranks along the path first (width 1: the chain of first draws), then log-probability
    sampled = q is not None
    order = (lambda sc, rk: sc - 1e4 * rk) if sampled else (lambda sc, rk: sc)
    if shape is None:  # the `width` best root children
        root_rank = torch.arange(k, device=dev).expand(R, k)
        fid = order(s, root_rank).topk(spec.width, -1).indices
        ftok, fsc, frank = t.gather(1, fid), s.gather(1, fid), root_rank.gather(1, fid)
    else:
        front = [i for i, _, _ in by_depth[0] if i in has_child]
        pick = torch.tensor(front, device=dev, dtype=torch.long)
        fid, ftok, fsc = pick.expand(R, len(front)), t[:, pick], s[:, pick]
    fstate = None if state is None else state[:, None].expand(R, fid.shape[1], state.shape[-1])
    fed_anc, parent_fed, offset = None, None, 0
    for d in range(1, D):
        W = fid.shape[1]
        if W == 0:
            break
        vis, fed_anc = _frontier_visibility(fed_anc, parent_fed, W, offset, R, dev)
        logits, h = cand.extend_tree(slots, ftok, tlens, d, fstate, offset, vis)
        ct, cs, q = _children(logits, k, n, sampling, seeds, steps)  # (R, W, k)
        cum = fsc[..., None] + cs
        if shape is None:
            child_tok, child_lq, child_sc = ct.flatten(1), cs.flatten(1), cum.flatten(1)  # (R, W·k)
            child_par = fid[..., None].expand(R, W, k).flatten(1)
            child_front = torch.arange(W, device=dev).repeat_interleave(k)  # each child's parent in the frontier
        else:
            col = {i: j for j, i in enumerate(front)}  # shape index -> place in the frontier
            kids = by_depth[d]
            fp = torch.tensor([col[p] for _, p, _ in kids], device=dev, dtype=torch.long)
            rk = torch.tensor([r for _, _, r in kids], device=dev, dtype=torch.long)
            child_tok, child_lq, child_sc = ct[:, fp, rk], cs[:, fp, rk], cum[:, fp, rk]
            child_par, child_front = fid[:, fp], fp
        toks.append(child_tok)
        pars.append(child_par)
        lqs.append(child_lq)
        scores.append(child_sc)
        if qs is not None:
            qs.append(q[:, child_front])  # each child's q is its parent's distribution
        depths += [d + 1] * child_tok.shape[1]
        ranks += [r for _, _, r in by_depth[d]] if shape is not None else list(range(k)) * W
        if d + 1 < D:  # the next frontier
            if shape is None:
                child_rank = (frank[..., None] + torch.arange(k, device=dev)).flatten(1)  # (R, W·k)
                best = order(child_sc, child_rank).topk(spec.width, -1).indices  # (R, width)
                src = child_front[best]
                fid, ftok, fsc = n + best, child_tok.gather(1, best), child_sc.gather(1, best)
                frank = child_rank.gather(1, best)
            else:
                nxt = [j for j, (i, _, _) in enumerate(kids) if i in has_child]
                front = [kids[j][0] for j in nxt]
                sel = torch.tensor(nxt, device=dev, dtype=torch.long)
                src = child_front[sel].expand(R, len(nxt))
                fid = child_par.new_tensor(front).expand(R, len(nxt))
                ftok, fsc = child_tok[:, sel], child_sc[:, sel]
            parent_fed = offset + src
            fstate = None if h is None else h.gather(1, src[..., None].expand(*src.shape, h.shape[-1]))
        offset += W
        n += child_tok.shape[1]
    depth_rank = torch.tensor(depths + ranks, device=dev)
    depth, rank = depth_rank[:n].expand(R, n), depth_rank[n:].expand(R, n)
    cap = torch.as_tensor(caps, device=dev)
    return GrownTree(torch.cat(toks, 1), torch.cat(pars, 1), depth, torch.cat(lqs, 1), torch.cat(scores, 1),
                     depth <= cap[:, None], rank, None if qs is None else torch.cat(qs, 1))
