"""The load-aware allocation at one draft depth: which drafts to score and which rows draft on, to maximise
the batch's expected tokens per millisecond (:func:`allocate_depth` on the device, :func:`allocate_depth_host`
on host floats; pure functions of the estimates and the step's prices, tested against brute force)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_backbone.policy import DROP, GO, STOP
from ldlp.policies.pricing import Budget, DepthCosts


@dataclass(frozen=True)
class DepthAllocation:
    """Per drafted row of a depth: ``codes`` (0 drop, 1 keep and stop, 2 keep and draft on); ``budget`` the
    plan after this depth (its forward and the kept drafts added)."""

    codes: torch.Tensor
    budget: Budget


def marginal_prefix(values_desc: torch.Tensor, E, T, m) -> torch.Tensor:
    """How many of ``values_desc`` (expected tokens, sorted descending, each costing ``m`` ms) to add to a
    plan of E expected tokens in T ms so that E / T is largest: add while value / m is at least the rate
    so far (each addition then raises the rate, and the first that would lower it ends the prefix). On the
    device: the condition for every prefix at once, then the length of the run of passes."""
    k = torch.arange(values_desc.shape[0], device=values_desc.device, dtype=torch.float64)
    E_before = E + torch.cumsum(values_desc, 0) - values_desc
    ok = values_desc * (T + m * k) >= E_before * m
    return torch.cumprod(ok.to(torch.long), 0).sum()


def allocate_depth(survival: torch.Tensor, accept: torch.Tensor, can_continue: torch.Tensor,
                   budget: Budget, costs: DepthCosts) -> DepthAllocation:
    """The load-aware allocation at one draft depth, for the A rows that drafted there, on the device.

    ``survival[j]``: S_j, the probability that row j's draft at this depth survives verification (its
    earlier drafts' and its own acceptance estimates multiplied); ``accept[j]``: a_j, the estimate behind
    it, so that S_j · a_j predicts the survival of row j's next draft; ``can_continue[j]``: whether row j
    may draft another depth (its cap). ``budget``: the plan before this depth; ``costs``: see
    :class:`DepthCosts`. The objective, in two parts (each maximised exactly, tested against brute force):

    1. Scored drafts K ⊆ rows: maximise the plan's rate ρ = (E + Σ_K S_j) / (T + draft_ms + m · |K|),
       every scored token costing m ≥ 0 (the global greedy budget of DSpark and vLLM's adaptive
       verification, taken in descending S: :func:`marginal_prefix`).
    2. Rows that draft on, C ⊆ {j ∈ K: can_continue[j]}: maximise, at the rate ρ of part 1,
       Σ_C S_j · a_j − ρ · (m · |C| + next_depth_ms[|C|]): the predicted next survivals net of their
       target tokens and the next depth's forward (C empty scores 0; ties go to the smaller C).

    Rows outside K get code 0, K \\ C code 1, C code 2."""
    S, a = survival.to(torch.float64), accept.to(torch.float64)
    A, dev = S.shape[0], S.device
    E, N, T = budget.E, budget.N, budget.T + costs.draft_ms  # this depth's drafter forward is spent
    m = costs.token_ms
    order = torch.sort(S, descending=True, stable=True).indices
    n_kept = marginal_prefix(S[order], E, T, m)
    kept = torch.zeros(A, dtype=torch.bool, device=dev)
    kept[order] = torch.arange(A, device=dev) < n_kept
    E = E + torch.where(kept, S, 0.0).sum()
    N = N + n_kept
    T = T + m * n_kept
    # who drafts on: the best prefix of the predicted next survivals, net of the next depth's forward
    on = kept & can_continue
    value = torch.where(on, S * a, -1.0)  # candidates first (values >= 0), in descending value
    order2 = torch.sort(value, descending=True, stable=True).indices
    k = torch.arange(1, A + 1, device=dev)
    net = torch.cumsum(value[order2].clamp_min(0.0), 0) - (E / T) * (k * m + costs.next_depth_ms[k])
    net = torch.where(k <= on.sum(), net, float("-inf"))
    best_k = torch.argmax(torch.cat([net.new_zeros(1), net]))  # the first best: ties go to the smaller C
    go = torch.zeros(A, dtype=torch.bool, device=dev)
    go[order2] = k <= best_k
    codes = torch.where(kept, torch.where(go, GO, STOP), DROP)
    return DepthAllocation(codes, Budget(E, N, T))


def allocate_depth_host(survival: list[float], accept: list[float], can_continue: list[bool], budget: Budget,
                        costs: DepthCosts) -> tuple[list[int], Budget]:
    """:func:`allocate_depth` on host floats (the same objective, the same ties), for a step of a few rows on a
    CPU, where a read costs nothing and a handful of Python float operations beat twenty small tensor ops."""
    A = len(survival)
    E, N, T, m = budget.E, budget.N, budget.T + costs.draft_ms, costs.token_ms
    order = sorted(range(A), key=lambda j: -survival[j])  # stable, as the device's sort
    kept_n, E_run = 0, E
    for k, j in enumerate(order):  # marginal_prefix: add while value / m is at least the rate so far
        if survival[j] * (T + m * k) < E_run * m:
            break
        kept_n, E_run = kept_n + 1, E_run + survival[j]
    kept = set(order[:kept_n])
    E, N, T = E + sum(survival[j] for j in order[:kept_n]), N + kept_n, T + m * kept_n
    value = [survival[j] * accept[j] if j in kept and can_continue[j] else -1.0 for j in range(A)]
    order2 = sorted(range(A), key=lambda j: -value[j])
    best, best_k, run = 0.0, 0, 0.0
    for k in range(1, sum(v >= 0 for v in value) + 1):
        run += max(value[order2[k - 1]], 0.0)
        net = run - (E / T) * (k * m + costs.next_depth_ms[k])
        if net > best:  # the first best: ties go to the smaller set
            best, best_k = net, k
    go = set(order2[:best_k])
    return [(GO if j in go else STOP) if j in kept else DROP for j in range(A)], Budget(E, N, T)
