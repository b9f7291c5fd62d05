"""The upper bounds, which know what the target will accept (greedy only): the chain oracle (``policy=oracle``:
drafts exactly what is accepted) and the batched oracle (``policy=oracle_budget``: each running row's true
accepted length, spent by the step's prices). Both look the counts up in one replay per prompt
(:class:`KnownAcceptance`, :func:`accepted_lengths`), made before any clock starts.

**The batched oracle.**

Each step, every running row b has a known accepted length L_b: how many drafts of a chain the target would keep
at the row's position (greedy decoding: the row's output is the target's own greedy sequence, so L_b is a function
of the position). Every draft up to L_b is then kept with certainty, and worth exactly one token. The policy
chooses γ_b ∈ [0, L_b] per row to maximise the batch's tokens per millisecond,

    (R + Σ_b γ_b) / step_ms(R, depth_rows, R + Σ_b γ_b, fed_per_row),

with the step's price from the same :class:`~eagle_backbone.cost.CostTable` the load-aware policies plan with
(:meth:`~eagle_backbone.cost.CostTable.step_ms`: the engine's bookkeeping, the target's verification of the
scored tokens, and when any row drafts the drafter's catch-up forward and one draft depth per entry of
``depth_rows``, the rows still drafting at that depth).

**The exact optimum** (:func:`allocate_budget`). The objective depends on the γ only through the depth profile
A_d = #{b: γ_b ≥ d} (d = 1..D): the tokens are R + Σ_d A_d and the price is a function of (Σ_d A_d, A_1..A_D).
A profile is reachable iff it is non-increasing with A_d ≤ n_d = #{b: L_b ≥ d} (give depth d to the A_d rows of
longest L). The uniform depth caps γ_b = min(L_b, g) do not always reach the optimum (a target price that jumps
past some token count can make a ragged profile best), so the allocation is a dynamic programme: for every
total S of scored drafts, the cheapest drafter cost Σ_d draft_ms(A_d) over the reachable profiles with
Σ_d A_d = S (layers d = 1..max L, a suffix minimum over A_{d-1} ≥ A_d), then the S with the best rate
(ties: the fewest drafts). ``tests/test_oracle_budget.py`` checks it against every γ vector on small cases.

**The accepted lengths** (:func:`accepted_lengths`) are found before any clock starts, as the chain oracle's
(:class:`~ldlp.policies.oracles.OraclePolicy`) are: a replay of the prompt at static γ = k_max gives the greedy output
and the counts at the positions that replay visits; this policy also stops at the others (it drafts fewer than
L_b where drafting does not pay), so every other position p is measured too, by admitting the prompt with the
output's first p - 1 tokens appended and recording the first step's accepted count (the same context and, in
exact arithmetic, the same target features behind the drafter). Defined for greedy decoding only.
"""

from __future__ import annotations

import weakref

import numpy as np

from eagle_backbone.cost import CostTable
from eagle_backbone.policy import DraftPolicy, EngineView, Rows, StaticPolicy, int_at_least
from ldlp.policies.pricing import FeedRate, StepPricing

# ---- the chain oracle ------------------------------------------------------------------------------------


class KnownAcceptance:
    """What the target accepts at each position of the prompts an oracle serves: the pair from the engine
    (``bind``), each slot's counts from one replay per prompt (``begin``; :func:`accepted_lengths`, shared by every
    instance through :data:`_REPLAYS`, so a benchmark's warm-up pays the replays before any clock starts)."""

    def __init__(self, policy: str, k_max: int, every_position: bool, slots: int = 8):
        self.policy, self.k_max, self.every_position, self.slots = policy, k_max, every_position, slots
        self.pair = None
        self.by_slot: dict[int, dict[int, int]] = {}  # slot -> position -> drafts the target accepts there

    def bind(self, view: EngineView) -> None:
        if not view.greedy:
            raise ValueError(f"{self.policy} policy: it is defined for greedy decoding only (generation.temperature=0); "
                             f"got temperature={view.sampling.temperature}")
        if view.candidates is None:
            raise ValueError(f"{self.policy} policy: it replays speculative decoding, and the engine has no drafter")
        self.pair = (view.target, view.candidates)

    def begin(self, slot: int, prompt_ids, max_new_tokens: int | None) -> None:
        if self.pair is None or max_new_tokens is None:
            raise ValueError(f"{self.policy} policy: it serves an engine's prompts (bind(view), then "
                             "begin(slot, prompt_ids, max_new_tokens)): it needs the models and the budget to know "
                             "what the target will accept")
        target, candidates = self.pair
        key = (id(target), self.k_max, int(max_new_tokens), self.every_position, tuple(prompt_ids))
        memo = _REPLAYS.setdefault(candidates, {})
        if key not in memo:
            memo[key] = accepted_lengths(target, candidates, list(prompt_ids), int(max_new_tokens), self.k_max,
                                         self.slots, self.every_position)[1]
        self.by_slot[slot] = memo[key]

    def at(self, slot: int, position: int) -> int:
        """What the target accepts at ``position`` of the prompt begun in ``slot`` (a chain of at most k_max)."""
        return self.by_slot[slot].get(position, 0)


_REPLAYS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # candidate generator -> replay key -> counts


class OraclePolicy(DraftPolicy):
    """Drafts exactly as many tokens as the target will accept (at most ``k_max``): zero waste.

    ``begin`` replays the generation with the same target and candidate generator at a static γ = k_max
    and records, at each decoding position, how many drafts the target accepted (:func:`accepted_lengths`).
    Under greedy decoding the replay visits the same positions as the oracle itself (drafting a tokens that
    are all accepted and adding the target's bonus token emits exactly what drafting k_max and keeping a
    emits), and the drafter's state at each of those positions holds the same true features, so the recorded
    count is exactly what will be accepted. ``begin`` runs before the clock starts: the replay is not timed,
    as befits an upper bound.
    """

    name = "oracle"
    greedy_only = True

    def __init__(self, k_max: int = 8):
        self.k_max = self.max_gamma = int_at_least(self.name, "k_max", k_max, 1)
        self.known = KnownAcceptance(self.name, self.k_max, every_position=False)

    def bind(self, view: EngineView) -> None:
        self.known.bind(view)

    def begin(self, slot: int, prompt_ids, max_new_tokens: int | None = None) -> None:
        self.known.begin(slot, prompt_ids, max_new_tokens)

    def plan(self, rows: Rows) -> list[int]:
        return [self.known.at(b, p) for b, p in zip(rows.slots, rows.positions)]


class AcceptedAtRecorder(StaticPolicy):
    """Static γ that remembers how many drafts were accepted at each position (one sequence)."""

    def __init__(self, gamma: int):
        super().__init__(gamma)
        self.accepted_at: dict[int, int] = {}

    def observe(self, rows: Rows, drafted: list[int], accepted: list[int], extra=None) -> None:
        for p, k in zip(rows.positions, accepted):
            self.accepted_at[p] = k


# ---- the allocation: a pure function of host numbers ------------------------------------------------------


def budget_rate(gammas: list[int], costs: CostTable, fed_per_row: float) -> float:
    """Tokens per millisecond of a step in which row b drafts ``gammas[b]`` drafts, all kept (the objective)."""
    R, S = len(gammas), sum(gammas)
    depth_rows = [sum(g >= d for g in gammas) for d in range(1, max(gammas, default=0) + 1)]
    return (R + S) / costs.step_ms(R, depth_rows, R + S, fed_per_row)


def allocate_budget(lengths: list[int], costs: CostTable, fed_per_row: float, memo: dict | None = None) -> list[int]:
    """γ_b ∈ [0, lengths[b]] per row maximising :func:`budget_rate` exactly (module docstring); ties go to the
    fewest drafts. ``memo``: a dict kept across calls (the answer depends on R, the profile n_d and the feed)."""
    R = len(lengths)
    L = [max(0, int(x)) for x in lengths]
    if R == 0 or max(L) == 0:
        return [0] * R
    order = sorted(range(R), key=lambda b: -L[b])  # rows by L, longest first: rank i drafts the first A_d >= i
    kmax = L[order[0]]
    n = tuple(sum(x >= d for x in L) for d in range(1, kmax + 1))
    key = (R, n, float(fed_per_row))
    if memo is not None and key in memo:
        profile = memo[key]
    else:
        profile = _best_profile(R, n, costs, float(fed_per_row), memo if memo is not None else {})
        if memo is not None:
            memo[key] = profile
    out = [0] * R
    for rank, b in enumerate(order, start=1):
        out[b] = sum(a >= rank for a in profile)
    return out


def _prices(costs: CostTable, R: int, S_max: int, memo: dict) -> tuple[np.ndarray, np.ndarray]:
    """(a draft depth over a = 0..R rows, the verification of R + s tokens for s = 0..S_max) at R rows, kept in
    ``memo`` (the table's lookups repeat every step)."""
    key = ("prices", R)
    dc, target = memo.get(key, (None, np.zeros(0)))
    if dc is None or len(target) <= S_max:
        dc = np.array([0.0] + [costs.draft_ms(a, R) for a in range(1, R + 1)])
        target = np.array([costs.target_ms(R, R + s) for s in range(max(S_max + 1, 8 * R + 1))])
        memo[key] = (dc, target)
    return dc, target


DP_CELLS = 4_000_000  # the most dynamic-programme cells a memo keeps (about 32 MB); then it starts afresh


def _drafter_dp(R: int, n: tuple[int, ...], costs: CostTable, memo: dict):
    """For every total s of scored drafts: the cheapest drafter cost Σ_d draft_ms(A_d) over the reachable profiles
    (``best[s]``), the last depth of one such profile (``best_depth[s]``) and the layers to walk it back: f[d][a, s],
    the cheapest cost of depths 1..d+1 ending with a rows at the last depth and s drafts in all. It does not depend
    on the drafter feed, so one is kept in ``memo`` per (R, n)."""
    key = ("dp", R, n)
    if key in memo:
        return memo[key]
    kmax, A, S_max = len(n), n[0], sum(n)
    dc, _ = _prices(costs, R, S_max, memo)
    dc = dc[: A + 1]  # a depth over a rows
    a_idx = np.arange(A + 1)[:, None]
    s_idx = np.arange(S_max + 1)[None, :]
    src = np.clip(s_idx - a_idx, 0, None)
    shift_ok = (s_idx - a_idx >= 0) & (a_idx >= 1)
    f0 = np.full((A + 1, S_max + 1), np.inf)
    f0[np.arange(1, A + 1), np.arange(1, A + 1)] = dc[1:]
    layers = [f0]
    best = f0.min(axis=0)  # the cheapest over every last depth, per total s
    best_depth = np.zeros(S_max + 1, dtype=int)
    for d in range(1, kmax):
        suf = np.minimum.accumulate(layers[-1][::-1], axis=0)[::-1]  # min over a' >= a (the profile never rises)
        nxt = np.where(shift_ok & (a_idx <= n[d]), np.take_along_axis(suf, src, axis=1) + dc[:, None], np.inf)
        layers.append(nxt)
        col = nxt.min(axis=0)
        better = col < best
        best = np.where(better, col, best)
        best_depth = np.where(better, d, best_depth)
    cells = memo.get("dp_cells", 0) + kmax * (A + 1) * (S_max + 1)
    if cells > DP_CELLS:
        for k in [k for k in memo if isinstance(k, tuple) and k[0] == "dp"]:
            del memo[k]
        cells = kmax * (A + 1) * (S_max + 1)
    memo["dp_cells"] = cells
    memo[key] = (best, best_depth, layers)
    return memo[key]


def _best_profile(R: int, n: tuple[int, ...], costs: CostTable, fed_per_row: float, memo: dict) -> list[int]:
    """The depth profile (A_1 >= ... >= A_D >= 1, A_d <= n[d-1]) of the best rate, [] for no drafts."""
    S_max = sum(n)
    best, best_depth, layers = _drafter_dp(R, n, costs, memo)
    _, target = _prices(costs, R, S_max, memo)
    drafts = np.arange(S_max + 1)
    price = costs.overhead_ms(R) + target[: S_max + 1] + np.where(drafts > 0, costs.feed_ms(R, fed_per_row) + best, 0.0)
    s = int(np.argmax((R + drafts) / price))  # the first best: the fewest drafts
    if s == 0:
        return []
    d = int(best_depth[s])
    a = int(np.argmin(layers[d][:, s]))
    profile = [a]
    while d > 0:  # walk back: the row count one depth up is one of those the suffix minimum took
        s -= a
        d -= 1
        a = a + int(np.argmin(layers[d][a:, s]))
        profile.append(a)
    return profile[::-1]


# ---- the accepted length at every position ----------------------------------------------------------------


def accepted_lengths(target, candidates, prompt_ids: list[int], max_new_tokens: int, k_max: int,
                     slots: int = 8, every_position: bool = True) -> tuple[list[int], dict[int, int]]:
    """(the greedy output, {position: drafts a chain of at most ``k_max`` gets accepted there}) for every
    position p = 1 .. len(output) - 1 at which a step can start (p tokens generated), capped at the output's EOS
    as the chain oracle caps it. The replay at γ = k_max gives the output and its own positions; each other p is
    the first step of the prompt with the output's first p - 1 tokens appended (its prefill emits token p - 1),
    ``slots`` of them at a time in one engine; ``every_position=False``: the replay's positions only (all that
    the chain oracle, drafting exactly what is accepted, ever visits)."""
    from eagle_backbone.batched_engine import BatchedSpeculativeEngine
    from eagle_backbone.decoder import SpeculativeDecoder

    prompt = list(prompt_ids)
    recorder = AcceptedAtRecorder(k_max)
    out = SpeculativeDecoder(target, candidates, recorder).generate(prompt, max_new_tokens).tokens
    eos = [i for i, t in enumerate(out) if t in target.eos_token_ids]
    stop = eos[0] if eos else len(out)
    at = {p: min(a, max(0, stop - p)) for p, a in recorder.accepted_at.items()}
    todo = [p for p in range(1, len(out)) if p not in at] if every_position else []
    if todo:
        capacity = len(prompt) + max_new_tokens + k_max + 4
        eng = BatchedSpeculativeEngine(target, candidates, slots=min(slots, len(todo)), policy=StaticPolicy(k_max),
                                       capacity=capacity)
        in_flight: dict[int, int] = {}
        while todo or in_flight:
            for b in eng.free_slots():
                if todo and b not in in_flight:
                    p = todo.pop(0)
                    room = min(k_max, max_new_tokens - p - 1)  # the drafts the real run may make at p
                    eng.admit(b, prompt + out[: p - 1], room + 2)
                    in_flight[b] = p
            for b in eng.step():
                p, s = in_flight.pop(b), eng.state[b]
                same = s.new[:1] == out[p - 1: p]  # the prefill's token is the output's (the same context)
                first = s.stats.accept_lengths[0] if s.stats.accept_lengths else 0
                at[p] = min(first, max(0, stop - p)) if same else 0
    return out, at


# ---- the policy --------------------------------------------------------------------------------------------


class OracleBudgetPolicy(DraftPolicy):
    """The batched oracle: knows each row's accepted length L_b and drafts γ_b ∈ [0, L_b] to maximise the batch's
    tokens per millisecond under the step's prices (module docstring). Greedy only. Its prices are found as the
    load-aware policies find theirs (:class:`~ldlp.policies.pricing.StepPricing` from its ``pricing`` node:
    ``cost_dir``, ``model``, ``cost_table``, ``profile_if_missing``, ``online_costs``, ``cost_model``)."""

    name = "oracle_budget"
    needs_costs = True
    greedy_only = True

    def __init__(self, pricing, k_max: int = 8, replay_slots: int = 8):
        self.k_max = self.max_gamma = int_at_least(self.name, "k_max", k_max, 1)
        replay_slots = int_at_least(self.name, "replay_slots", replay_slots, 1)
        self.pricing = StepPricing.of(self.name, pricing)
        self.known = KnownAcceptance(self.name, self.k_max, every_position=True, slots=replay_slots)
        self.feed = FeedRate()  # the running drafter feed (every draft is kept: no acceptance rate to learn)

    @property
    def costs(self):
        return self.pricing.costs

    def bind(self, view: EngineView) -> None:
        self.known.bind(view)
        self.pricing.bind(view)

    def begin(self, slot: int, prompt_ids, max_new_tokens: int | None = None) -> None:
        self.known.begin(slot, prompt_ids, max_new_tokens)

    def plan(self, rows: Rows) -> list[int]:
        caps = rows.caps if rows.caps is not None else [self.k_max] * len(rows)
        L = [max(0, min(self.known.at(b, p), c, self.k_max)) for b, p, c in zip(rows.slots, rows.positions, caps)]
        if self.costs is None:  # no table (nothing to draft with): every accepted draft
            return L
        # the running drafter feed, rounded as the load-aware plan rounds it: the allocation is exact at that feed
        return allocate_budget(L, self.costs, round(self.feed.value, 1), self.pricing.memo("oracle_budget"))

    def observe(self, rows: Rows, drafted: list[int], accepted: list[int], extra=None) -> None:
        self.feed.update(accepted)
