"""Draft trees (eagle_backbone.tree): representation, greedy and lossless sampling verification, selection.

The sampling proofs: an exact enumeration of every draft outcome and every accept/reject branch on a
4-token vocabulary (the first two emitted tokens have exactly the target's joint distribution, and three
broken residual updates do not), and a chi-square test over many seeds in one batched call at T = 0.7
and 1.0 that passes the real verifier and fails a broken one."""

import itertools

import pytest
import torch
from conftest import pooled_grid_chi2_pvalue

from eagle_backbone import tree as T
from eagle_backbone.sampling import (
    DRAFT,
    FINAL,
    SamplingConfig,
    accept_probability,
    probs_from_logits,
    residual,
    sample_rows,
    uniforms,
    verify_greedy_batch,
    verify_sampling_batch,
)
from eagle_backbone.tree import (
    MC_SIM_7B_63,
    DraftTree,
    ancestor_closed,
    budget_costs,
    emitted_tokens,
    is_tree,
    path_values,
    paths_to_tree,
    prune,
    select_budget,
    top_nodes,
    tree_uniforms,
    tree_walk,
    verify_tree_greedy,
    verify_tree_sampling,
)


# ---- helpers ----------------------------------------------------------------------------------------


def random_trees(R, K, V, gen, p_valid=0.8):
    """R random padded trees of K slots: padding anywhere (with junk parents), a valid node's parent a
    random earlier valid node or the root."""
    tokens = torch.randint(0, V, (R, K), generator=gen)
    valid = torch.rand(R, K, generator=gen) < p_valid
    parents = torch.randint(-1, K + 3, (R, K), generator=gen)  # junk for padding
    for r in range(R):
        for i in range(K):
            if valid[r, i]:
                choices = [-1] + [j for j in range(i) if valid[r, j]]
                parents[r, i] = choices[int(torch.randint(len(choices), (1,), generator=gen))]
    return DraftTree(tokens, parents, valid)


def naive_ancestors(tree):
    R, K = tree.tokens.shape
    A = torch.zeros(R, K, K, dtype=torch.bool)
    for r in range(R):
        for i in range(K):
            if tree.valid[r, i]:
                j = i
                while j >= 0:
                    A[r, i, j] = True
                    j = int(tree.parents[r, j])
    return A


def children(tree, r, c):
    return [i for i in range(tree.K) if tree.valid[r, i] and int(tree.parents[r, i]) == c]


def naive_greedy(tree, logits):
    """Per row: every path of nodes matching the argmax at their parents; the longest (among equals, the
    one ending at the smallest index: only duplicate siblings make equals), then the argmax after it."""
    best = logits.argmax(-1)
    out = []
    for r in range(tree.R):
        def paths(c):
            for i in children(tree, r, c):
                if int(tree.tokens[r, i]) == int(best[r, c + 1]):
                    yield [i]
                    for rest in paths(i):
                        yield [i] + rest

        path = min(paths(-1), key=lambda pa: (-len(pa), pa[-1]), default=[])
        out.append((len(path), path, int(best[r, (path[-1] if path else -1) + 1])))
    return out


def naive_sampling(tree, p, q, det, u_acc, u_fin):
    """The issue's rule, literally, one row at a time."""
    out = []
    for r in range(tree.R):
        c, path, res = -1, [], p[r, 0].clone()
        while True:
            for i in children(tree, r, c):
                x = int(tree.tokens[r, i])
                if det is not None and det[r, i]:
                    if u_acc[r, i] < res[x] / res.sum():
                        break
                    res[x] = 0
                    res = res / res.sum()
                else:
                    if u_acc[r, i] < accept_probability(res[x], q[r, i, x]):
                        break
                    res = residual(res, q[r, i])
            else:
                out.append((len(path), path, int(sample_rows(res[None], u_fin[r:r + 1])[0])))
                break
            c = i
            path.append(i)
            res = p[r, i + 1].clone()
    return out


def rand_dists(shape, gen, scale=2.0, zero_frac=0.0, dtype=torch.float64):
    logits = torch.randn(*shape, generator=gen, dtype=dtype) * scale
    if zero_frac:
        logits = logits.masked_fill(torch.rand(*shape, generator=gen) < zero_frac, float("-inf"))
        logits[..., 0] = logits[..., 0].clamp_min(-1.0)  # never all -inf
    return torch.softmax(logits, -1)


# ---- shapes and representation ----------------------------------------------------------------------


def test_mc_sim_7b_63_shape():
    s = paths_to_tree(MC_SIM_7B_63)
    assert len(s.paths) == 25  # 26 tokens a pass with the root, as the issue measured
    assert torch.bincount(s.depth).tolist() == [0, 4, 8, 8, 3, 2]
    # parents precede children, and a node's path is its parent's path plus its rank
    for i, path in enumerate(s.paths):
        par = int(s.parents[i])
        assert par < i
        assert path == ((s.paths[par] if par >= 0 else ()) + (int(s.rank[i]),))
        assert int(s.depth[i]) == len(path)
    assert sorted(map(tuple, MC_SIM_7B_63)) == sorted(s.paths)
    # any order in, the same tree out
    assert paths_to_tree(list(reversed(MC_SIM_7B_63))).paths == s.paths
    t = DraftTree.static(s, torch.zeros(3, 25, dtype=torch.long))
    assert torch.equal(t.depth, s.depth.expand(3, 25))
    assert bool(t.is_valid().all())
    with pytest.raises(ValueError, match="closed"):
        paths_to_tree([[0], [1, 0]])
    with pytest.raises(ValueError, match="duplicate"):
        paths_to_tree([[0], [0]])


def test_ancestors_depth_mask_positions():
    gen = torch.Generator().manual_seed(0)
    for K in (1, 2, 5, 9, 17):
        t = random_trees(40, K, 7, gen)
        A = naive_ancestors(t)
        assert torch.equal(t.ancestors, A)
        assert torch.equal(t.depth, A.sum(-1))
        m = t.attention_mask()
        assert m.shape == (40, K + 1, K + 1)
        assert bool(m[:, :, 0].all()) and bool(m.diagonal(dim1=1, dim2=2).all())
        assert torch.equal(m[:, 1:, 1:] | torch.eye(K, dtype=torch.bool), A | torch.eye(K, dtype=torch.bool))
        lengths = torch.randint(5, 50, (40,), generator=gen)
        pos = t.positions(lengths, pad=999)
        assert torch.equal(pos[:, 0], lengths)
        assert torch.equal(pos[:, 1:], torch.where(t.valid, lengths[:, None] + t.depth, 999))
        assert bool(t.is_valid().all())


def test_chain_is_lower_triangular():
    lengths = torch.tensor([0, 3, 6])
    t = DraftTree.chain(torch.zeros(3, 6, dtype=torch.long), lengths)
    for r, n in enumerate(lengths.tolist()):
        want = torch.zeros(6, 6, dtype=torch.bool)
        want[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        assert torch.equal(t.ancestors[r], want)
        assert t.depth[r].tolist() == [i + 1 if i < n else 0 for i in range(6)]


def test_closure_checks():
    parents = torch.tensor([[-1, 0, 1, 0], [-1, 0, 1, 0], [-1, 2, 0, -1], [-1, -1, 0, 5]])
    valid = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    # row 1: node 2's parent is padding; row 2: node 1's parent comes after it; row 3: junk under padding only
    assert is_tree(parents, valid).tolist() == [True, False, False, True]
    sel = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 0], [1, 0, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    assert ancestor_closed(sel, parents).tolist() == [True, False, True, False]


# ---- greedy verification ----------------------------------------------------------------------------


def test_greedy_tree_equals_chain_verifier():
    gen = torch.Generator().manual_seed(1)
    V = 5
    for K in (0, 1, 4, 8):
        R = 300
        logits = torch.randn(R, K + 1, V, generator=gen)
        best = logits.argmax(-1)
        # drafts that mostly match, so long accepts happen
        noise = torch.randint(0, V, (R, K), generator=gen)
        draft = torch.where(torch.rand(R, K, generator=gen) < 0.7, best[:, :K], noise)
        lengths = torch.randint(0, K + 1, (R,), generator=gen)
        a, x = verify_greedy_batch(draft, lengths, logits)
        ta, path, tx = verify_tree_greedy(DraftTree.chain(draft, lengths), logits)
        assert torch.equal(a, ta) and torch.equal(x, tx)
        ar = torch.arange(K)
        assert torch.equal(path, torch.where(ar < a[:, None], ar, -1))


def test_greedy_tree_matches_reference():
    gen = torch.Generator().manual_seed(2)
    V, K, R = 3, 10, 300  # a small vocabulary: duplicate siblings and deep matches happen
    t = random_trees(R, K, V, gen, p_valid=0.9)
    logits = torch.randn(R, K + 1, V, generator=gen)
    a, path, x = verify_tree_greedy(t, logits)
    for r, (na, npath, nx) in enumerate(naive_greedy(t, logits)):
        assert int(a[r]) == na and int(x[r]) == nx
        assert path[r].tolist() == npath + [-1] * (K - na)
    em = emitted_tokens(t, path, a, x)
    for r in range(R):
        n = int(a[r])
        assert em[r, :n].tolist() == t.tokens[r, path[r, :n]].tolist() and int(em[r, n]) == int(x[r])


# ---- sampling verification: agreement ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sampling_tree_equals_chain_verifier(dtype):
    """A chain of sampled drafts: the same counts and tokens as verify_sampling_batch, uniform for uniform."""
    gen = torch.Generator().manual_seed(3)
    V, R = 6, 3000
    for K in (0, 1, 3, 6):
        p = rand_dists((R, K + 1, V), gen, zero_frac=0.2).to(dtype)
        q = rand_dists((R, K, V), gen, zero_frac=0.2).to(dtype) if K else None
        seeds, steps = torch.arange(R) * 7 + 1, torch.full((R,), 5)
        draft = torch.stack([sample_rows(q[:, i], uniforms(seeds, steps, torch.tensor([DRAFT + i]))[:, 0])
                             for i in range(K)], 1) if K else torch.zeros(R, 0, dtype=torch.long)
        lengths = torch.randint(0, K + 1, (R,), generator=gen)
        u_acc, u_fin = tree_uniforms(seeds, steps, K)
        a, x = verify_sampling_batch(draft, lengths, q, p, u_acc, u_fin)
        ta, path, tx = verify_tree_sampling(DraftTree.chain(draft, lengths), p, q, None, u_acc, u_fin)
        assert torch.equal(a, ta) and torch.equal(x, tx)
        assert 0 < float(a.float().mean()) or K == 0


def test_sampling_tree_matches_reference():
    gen = torch.Generator().manual_seed(4)
    V, K, R = 4, 9, 400
    t = random_trees(R, K, V, gen, p_valid=0.9)
    p = rand_dists((R, K + 1, V), gen, zero_frac=0.2)
    q = rand_dists((R, K, V), gen, zero_frac=0.2)
    det = torch.rand(R, K, generator=gen) < 0.5
    u_acc, u_fin = tree_uniforms(torch.arange(R), torch.zeros(R, dtype=torch.long), K)
    for d in (det, None):
        a, path, x = verify_tree_sampling(t, p, q, d, u_acc, u_fin)
        for r, (na, npath, nx) in enumerate(naive_sampling(t, p, q, d, u_acc, u_fin)):
            assert (int(a[r]), path[r, :na].tolist(), int(x[r])) == (na, npath, nx)
        assert float(a.float().mean()) > 0.3
    # a top-k tree needs no q
    all_det = torch.ones(R, K, dtype=torch.bool)
    a1, _, x1 = verify_tree_sampling(t, p, None, all_det, u_acc, u_fin)
    a2, _, x2 = verify_tree_sampling(t, p, q, all_det, u_acc, u_fin)
    assert torch.equal(a1, a2) and torch.equal(x1, x2)


# ---- sampling verification: exact distribution ------------------------------------------------------

# (parent, kind, rank): "d" = the drafter's rank-th most likely token at the parent, "s" = drawn from it.
# Siblings at several depths, deterministic and sampled mixed (also a sampled child after deterministic
# rejections and a deterministic one after sampled rejections).
EXACT_TREES = {
    # a sampled child after a deterministic rejection (1), a deterministic one after a sampled rejection
    # (2, 5), two sampled siblings (3, 4: the recursive residual), a child of a sampled node (6), depth 3 (7)
    "mixed": [(-1, "d", 0), (-1, "s", 0), (-1, "d", 1), (0, "s", 0), (0, "s", 0), (0, "d", 0),
              (1, "d", 0), (3, "s", 0)],
    "sampled": [(-1, "s", 0), (-1, "s", 0), (0, "s", 0), (0, "s", 0), (2, "s", 0)],
    "topk": [(-1, "d", 0), (-1, "d", 1), (-1, "d", 2), (0, "d", 0), (0, "d", 1), (1, "d", 0), (3, "d", 0)],
}


def prefix_tables(V, depth, gen, zero_frac=0.25):
    """Distributions for every prefix of up to ``depth`` tokens: level d is (V^d, V); prefix (t1..td) is
    row ((t1 V + t2) V + ...) + td."""
    return [rand_dists((V ** d, V), gen, zero_frac=zero_frac) for d in range(depth + 1)]


def build_rows(spec, tokens_for, P, Q, V):
    """Draft the tree for every row: ``tokens_for(i, qdist)`` (O,) is node i's token given the drafter's
    distribution at its parent. Returns (DraftTree, p (O, 1+K, V), q (O, K, V), deterministic (O, K))."""
    K = len(spec)
    O = tokens_for(None, None)
    pid = [None] * K  # prefix id of each node
    depth = [0] * K
    tok, ps, qs = [], [P[0][0].expand(O, V)], []
    for i, (par, kind, rank) in enumerate(spec):
        depth[i] = 1 if par < 0 else depth[par] + 1
        ppid = torch.zeros(O, dtype=torch.long) if par < 0 else pid[par]
        qd = Q[depth[i] - 1][ppid]
        x = qd.topk(rank + 1, -1).indices[:, rank] if kind == "d" else tokens_for(i, qd)
        pid[i] = ppid * V + x
        tok.append(x)
        qs.append(qd)
        ps.append(P[depth[i]][pid[i]])
    parents = torch.tensor([s[0] for s in spec]).expand(O, K)
    det = torch.tensor([s[1] == "d" for s in spec]).expand(O, K)
    return (DraftTree(torch.stack(tok, 1), parents, torch.ones(O, K, dtype=torch.bool)),
            torch.stack(ps, 1), torch.stack(qs, 1), det)


def exact_first_two(spec, P, Q, V):
    """The exact joint distribution (V, V) of the first two tokens emitted, enumerating every draft
    outcome (each sampled node's every token, with its probability) and every accept/reject branch.

    A branch is forced through the verifier itself: u = 0 accepts a node whenever its acceptance
    probability is > 0, u = 1 - 2^-53 rejects it whenever it is < 1. Every decision vector over the K
    nodes is run; a row counts when the nodes the walk tried decided as forced and the untried ones were
    forced to reject (each branch exactly once), weighted by the product of the tried nodes' acceptance
    (or rejection) probabilities. Fewer than two tokens emitted: the next comes from the residual, then
    (none accepted) the token after from the target given the first, as the next step would draw it."""
    K = len(spec)
    sampled = [i for i, s in enumerate(spec) if s[1] == "s"]
    outcomes = (torch.cartesian_prod(*[torch.arange(V)] * len(sampled)).reshape(-1, len(sampled))
                if sampled else torch.zeros(1, 0, dtype=torch.long))
    O = outcomes.shape[0]
    col = {i: j for j, i in enumerate(sampled)}
    tree, p, q, det = build_rows(spec, lambda i, qd: O if i is None else outcomes[:, col[i]], P, Q, V)
    w_draft = torch.ones(O, dtype=torch.float64)
    for i in sampled:
        w_draft = w_draft * q[:, i].gather(1, tree.tokens[:, i:i + 1])[:, 0]

    bits = torch.tensor(list(itertools.product([False, True], repeat=K)))  # (2^K, K)
    D = bits.shape[0]
    rep = lambda x: x.repeat_interleave(D, 0)  # noqa: E731  rows: outcome-major, decisions inside
    big = DraftTree(rep(tree.tokens), rep(tree.parents), rep(tree.valid))
    force = bits.repeat(O, 1)
    u_acc = torch.where(force, 0.0, 1.0 - 2.0 ** -53).to(torch.float64)
    w = tree_walk(big, rep(p), rep(q), rep(det), u_acc)
    on_path = torch.zeros_like(force)
    for j in range(K):
        on_path |= (w.path[:, j:j + 1] == torch.arange(K)[None])
    consistent = torch.where(w.tested, on_path == force, ~force).all(-1)
    branch = torch.where(w.tested, torch.where(on_path, w.accept_prob, 1 - w.accept_prob), 1.0).prod(-1)
    weight = rep(w_draft) * branch * consistent

    r = w.residual / w.residual.sum(-1, keepdim=True)
    first = big.tokens.gather(1, w.path[:, :1].clamp(min=0))[:, 0]
    second = big.tokens.gather(1, w.path[:, 1:2].clamp(min=0))[:, 0]
    eye = torch.eye(V, dtype=torch.float64)
    e1 = torch.where((w.accepted >= 1)[:, None], eye[first], r)  # (N, V) first token
    f2 = torch.where((w.accepted >= 2)[:, None, None], eye[second][:, None, :],  # (N, V, V) second given first
                     torch.where((w.accepted == 1)[:, None, None], r[:, None, :], P[1][None]))
    return torch.einsum("n,nx,nxy->xy", weight, e1, f2), float(weight.sum())


BROKEN = {
    "deterministic rejection not zeroed": ("_reject_deterministic", lambda r, x: r),
    "deterministic rejection not renormalised": ("_reject_deterministic", lambda r, x: r.scatter(1, x[:, None], 0.0)),
    "sampled rejection keeps r": ("_reject_sampled", lambda r, q: r),
    "sampled rejection not renormalised": ("_reject_sampled", lambda r, q: (r - q).clamp_min(0)),
}


def test_exact_distribution_of_first_two_tokens(monkeypatch):
    V = 4
    gen = torch.Generator().manual_seed(5)
    P = prefix_tables(V, 4, gen)
    Q = prefix_tables(V, 3, gen)
    want = P[0][0][:, None] * P[1]  # p(x1) p(x2 | x1)
    for name, spec in EXACT_TREES.items():
        got, total = exact_first_two(spec, P, Q, V)
        assert abs(total - 1) < 1e-9, name  # the branches partition the probability space
        assert torch.allclose(got, want, atol=1e-6, rtol=0), (name, (got - want).abs().max())
    # every broken residual update is caught by at least one of the trees
    for label, (fn, broken) in BROKEN.items():
        with monkeypatch.context() as m:
            m.setattr(T, fn, broken)
            err = max(float((exact_first_two(spec, P, Q, V)[0] - want).abs().max()) for spec in EXACT_TREES.values())
        assert err > 1e-3, label


# ---- sampling verification: chi-square --------------------------------------------------------------


def monte_carlo_first_two(spec, P, Q, V, N, seed0):
    """N rows, one seed each, drafted and verified in one batched call: counts (V, V) of the first two tokens."""
    seeds = torch.arange(N) + seed0
    steps = torch.full((N,), 3)

    def draw(i, qd):
        if i is None:
            return N
        return sample_rows(qd, uniforms(seeds, steps, torch.tensor([DRAFT + i]))[:, 0])

    tree, p, q, det = build_rows(spec, draw, P, Q, V)
    u_acc, u_fin = tree_uniforms(seeds, steps, tree.K)
    a, path, x = verify_tree_sampling(tree, p, q, det, u_acc, u_fin)
    em = emitted_tokens(tree, path, a, x)
    # one emitted token: the second is the next step's first, drawn from the target given it
    nxt = sample_rows(P[1][em[:, 0]], uniforms(seeds, steps + 1, torch.tensor([FINAL]))[:, 0])
    second = torch.where(a >= 1, em[:, 1], nxt)
    return torch.bincount(em[:, 0] * V + second, minlength=V * V).reshape(V, V)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_chi_square_first_two_tokens(temperature, monkeypatch):
    V, N = 5, 40_000
    gen = torch.Generator().manual_seed(6)
    cfg = SamplingConfig(temperature=temperature)
    # target and drafter from related logits, through the sampling pipeline's own temperature
    logits = [torch.randn(V ** d, V, generator=gen, dtype=torch.float64) * 1.5 for d in range(5)]
    P = [probs_from_logits(lg, cfg) for lg in logits]
    Q = [probs_from_logits(lg + torch.randn(lg.shape, generator=gen, dtype=torch.float64), cfg) for lg in logits[:4]]
    want = P[0][0][:, None] * P[1]
    spec = EXACT_TREES["mixed"]
    counts = monte_carlo_first_two(spec, P, Q, V, N, seed0=int(temperature * 1000))
    assert pooled_grid_chi2_pvalue(counts, want) > 1e-3
    # a broken residual (rejected drafts keep their mass) fails the same check
    monkeypatch.setattr(T, "_reject_deterministic", BROKEN["deterministic rejection not zeroed"][1])
    monkeypatch.setattr(T, "_reject_sampled", BROKEN["sampled rejection keeps r"][1])
    counts = monte_carlo_first_two(spec, P, Q, V, N, seed0=int(temperature * 1000))
    assert pooled_grid_chi2_pvalue(counts, want) < 1e-6


# ---- selection --------------------------------------------------------------------------------------


def closed_subsets(tree, r):
    """Every ancestor-closed subset of row r's valid nodes, as (K,) bool tensors."""
    nodes = [i for i in range(tree.K) if tree.valid[r, i]]
    out = []
    for k in range(len(nodes) + 1):
        for sub in itertools.combinations(nodes, k):
            s = torch.zeros(tree.K, dtype=torch.bool)
            s[list(sub)] = True
            if bool(ancestor_closed(s[None], tree.parents[r:r + 1])[0]):
                out.append(s)
    return out


def test_selection_brute_force():
    gen = torch.Generator().manual_seed(7)
    for trial in range(40):
        R, K = (2, 4) if trial % 2 else (3, 3)
        t = random_trees(R, K, 5, gen, p_valid=0.85)
        est = torch.rand(R, K, generator=gen, dtype=torch.float64)
        est = torch.where(torch.rand(R, K, generator=gen) < 0.2, 1.0, est)  # ties along paths
        est = torch.where(torch.rand(R, K, generator=gen) < 0.1, 0.5, est)  # ties across nodes
        v = path_values(est, t)
        a, b, c = (torch.rand(3, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 0.3, 0.05])).tolist()
        knee = int(torch.randint(R, R * K + 2, (1,), generator=gen))
        cost = lambda R_, N: 1.0 + a * N + b * max(0, N - knee) + c * N * N  # noqa: E731
        table = budget_costs(cost, 0, R + R * K)  # the same costs as a table indexed by N
        cap = torch.randint(0, K + 1, (R,), generator=gen)
        per_row = [closed_subsets(t, r) for r in range(R)]
        best_obj, best_capped, best_by_n = -1.0, -1.0, {}
        for combo in itertools.product(*per_row):
            n = sum(int(s.sum()) for s in combo)
            val = sum(float(v[r][s].sum()) for r, s in enumerate(combo))
            obj = (R + val) / cost(R, R + n)
            best_obj = max(best_obj, obj)
            if all(int(s.sum()) <= int(cap[r]) for r, s in enumerate(combo)):
                best_capped = max(best_capped, obj)
            best_by_n[n] = max(best_by_n.get(n, -1.0), val)
        for c_, cap_, want in ((cost, None, best_obj), (table, None, best_obj), (cost, cap, best_capped)):
            sel = select_budget(v, t, c_, per_row_cap=cap_)
            assert abs(float(sel.objective) - want) < 1e-12
            assert bool(ancestor_closed(sel.chosen, t.parents).all()) and not bool((sel.chosen & ~t.valid).any())
            n = int(sel.n_drafts)
            assert n == int(sel.chosen.sum()) == int(sel.per_row.sum())
            assert abs((R + float(v[sel.chosen].sum())) / cost(R, R + n) - want) < 1e-12
            if cap_ is not None:
                assert bool((sel.per_row <= cap).all())
        # a fixed total n: the top-n sum is the best closed n-set's
        for n, val in best_by_n.items():
            ch = top_nodes(v, t, n)
            assert int(ch.sum()) == n and bool(ancestor_closed(ch, t.parents).all())
            assert abs(float(v[ch].sum()) - val) < 1e-12
        # per row: n each, closed, the row's best
        for n in range(K + 1):
            ch = top_nodes(v, t, n, per_row=True)
            assert bool(ancestor_closed(ch, t.parents).all())
            for r in range(R):
                fits = [s for s in per_row[r] if int(s.sum()) == min(n, int(t.valid[r].sum()))]
                assert abs(float(v[r][ch[r]].sum()) - max(float(v[r][s].sum()) for s in fits)) < 1e-12


def test_selection_plain_decoding_and_all():
    t = DraftTree.static(paths_to_tree(MC_SIM_7B_63), torch.zeros(4, 25, dtype=torch.long))
    est = torch.full((4, 25), 0.6, dtype=torch.float64)
    v = path_values(est, t)
    # drafts cost more than they can return: N = R, nothing chosen
    sel = select_budget(v, t, lambda R, N: float(N))
    assert int(sel.n_drafts) == 0 and not bool(sel.chosen.any()) and abs(float(sel.objective) - 1.0) < 1e-12
    # free drafts: everything
    sel = select_budget(v, t, lambda R, N: 1.0)
    assert bool(sel.chosen.all())
    # a table that ends early caps the budget
    sel = select_budget(v, t, torch.ones(4 + 10))
    assert int(sel.n_drafts) == 9 and bool(ancestor_closed(sel.chosen, t.parents).all())


def test_prune_keeps_paths():
    gen = torch.Generator().manual_seed(8)
    t = random_trees(50, 12, 9, gen)
    v = path_values(torch.rand(50, 12, generator=gen, dtype=torch.float64), t)
    keep = top_nodes(v, t, 5, per_row=True)
    small, index = prune(t, keep, width=6)
    assert bool(small.is_valid().all())
    assert torch.equal(small.valid.sum(-1), keep.sum(-1))

    def token_paths(tr, r):
        return sorted(tuple(tr.tokens[r, tr.ancestors[r, i]].tolist()) for i in range(tr.K) if tr.valid[r, i])

    for r in range(50):
        assert token_paths(small, r) == token_paths(DraftTree(t.tokens, t.parents, keep), r)
        assert index[r][small.valid[r]].tolist() == keep[r].nonzero()[:, 0].tolist()


def test_no_host_reads():
    """On the meta device tensors have no values: any host read (.item(), bool(t), indexing by a 0-d
    tensor, nonzero) raises. Verification and selection run there end to end."""
    dev, R, K, V = "meta", 3, 6, 5
    t = DraftTree(torch.zeros(R, K, dtype=torch.long, device=dev), torch.zeros(R, K, dtype=torch.long, device=dev),
                  torch.zeros(R, K, dtype=torch.bool, device=dev))
    f64 = dict(device=dev, dtype=torch.float64)
    lengths = torch.zeros(R, dtype=torch.long, device=dev)
    assert t.attention_mask().shape == (R, K + 1, K + 1) and t.positions(lengths, pad=9).shape == (R, K + 1)
    assert t.is_valid().shape == (R,)
    assert [x.shape for x in verify_tree_greedy(t, torch.zeros(R, K + 1, V, device=dev))] == [(R,), (R, K), (R,)]
    u_acc, u_fin = tree_uniforms(lengths, lengths, K)
    a, path, x = verify_tree_sampling(t, torch.zeros(R, K + 1, V, **f64), torch.zeros(R, K, V, **f64), t.valid,
                                      u_acc, u_fin)
    assert emitted_tokens(t, path, a, x).shape == (R, K + 1)
    v = path_values(torch.zeros(R, K, **f64), t)
    sel = select_budget(v, t, lambda R, N: 1.0 + N, per_row_cap=2)
    assert sel.chosen.shape == (R, K) and sel.objective.shape == ()
    assert top_nodes(v, t, 3).shape == (R, K) and prune(t, sel.chosen)[1].shape == (R, K)
