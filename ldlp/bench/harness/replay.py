"""Replay draft-length policies on oracle rows, and tune their thresholds against measured costs.

Under greedy chain drafting everything a policy can see and everything that follows from its choice
is in the oracle rows: at a position the drafter's k_max-token chain is fixed (its top-1 probability
and entropy per step are stored), and drafting k tokens there keeps ``min(label, k)`` of them and
moves ``min(label, k) + 1`` positions on. :func:`replay` therefore walks each collected sequence the
way the engine would, asking the *real* policy objects (``plan``, ``stop``, ``observe`` on one row: :class:`OneSequence`), and
counts target forwards, drafted and accepted tokens exactly, without running a model. Only time is
modelled, by anything with the step formula of :meth:`CostTable.step_ms <eagle_backbone.cost.CostTable.step_ms>`,
read at one slot (:func:`step_seconds`). ``scripts/tune_policies.py`` prices by the engines' step-cost model,
:class:`~eagle_backbone.step_cost.OnlineCostModel` (``costs.model``: one fitted in hindsight; else one warm-started
from this setup's profiled :class:`~eagle_backbone.cost.CostTable`, profiled at one slot when missing:
:func:`ldlp.bench.harness.loaders.replay_costs`); :meth:`CostTable.linear <eagle_backbone.cost.CostTable.linear>` builds
a synthetic linear table, and :func:`fit_costs` fits one to timed generations.

``stop`` receives a stand-in for the drafter's distribution with the stored top-1
probability as its largest entry and (to rounding) the stored entropy: enough for the rules that read
the drafted token's probability, the top probability or the entropy; a policy that reads more of the
distribution cannot be replayed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from eagle_backbone.cost import CostTable
from eagle_backbone.policy import GO, Depth, DraftPolicy, EngineView, Rows
from eagle_backbone.runtime import to_device
from eagle_backbone.sampling import SamplingConfig
from eagle_backbone.step_cost import nonnegative_least_squares
from ldlp.bench.harness.stats import headroom_captured
from ldlp.policies.learned import step_seconds  # noqa: F401  (replay prices a step as the learned policy does)


def costs_record(costs) -> dict:
    """What priced the steps, for tuning.json: a linear table's three terms, a step-cost model's costs and its
    prior table (or file), or a measured table's file, key and its plain step and draft depth at one slot."""
    from eagle_backbone.step_cost import OnlineCostModel

    if isinstance(costs, OnlineCostModel):
        prior = costs.prior_meta or {}
        return {"source": "step_cost_model", "path": prior.get("path"), "key": prior.get("key"), "slots": 1,
                "costs_ms": costs.costs, "step_ms": costs.step_ms(1, [], 1, 1), "draft_ms": costs.draft_ms(1, 1)}
    if "linear" in (costs.meta or {}):
        return {"source": "linear", **costs.meta["linear"]}
    return {"source": "cost_table", "path": (costs.meta or {}).get("path"), "key": costs.key, "slots": 1,
            "step_ms": costs.step_ms(1, [], 1, 1), "draft_ms": costs.draft_ms(1, 1)}


class OneSequence:
    """Drives a batched policy over one sequence the way the engine drives one of its rows (slot ``slot``): replay's
    walk, and any tool that asks what a policy would do for one row. ``plan`` builds the step's :class:`Rows` of one
    row, ``go_on`` hands ``stop`` each drafted depth (the chain's log-probability summed in float64, as the engine
    does), ``observe`` the step's counts with the host values of the policy's ``reads()``."""

    def __init__(self, policy: DraftPolicy, embed=None, slot: int = 0):
        self.policy, self.embed, self.slot = policy, embed, slot
        self._rows: Rows | None = None
        self._logp = 0.0

    def begin(self, prompt_ids=()) -> None:
        self.policy.begin(self.slot, list(prompt_ids))

    def plan(self, last_token: int, feature: torch.Tensor, position: int = 0, cap: int = 0, accepted=(), drafted=(),
             target_stats: torch.Tensor | None = None) -> int:
        """The depth the policy plans for this row (``cap``: what budget and context allow, as the engine's
        ``rows.caps``; a policy that plans ahead sees none, as in the engine)."""
        self._logp = 0.0
        self._rows = Rows([self.slot], None if self.policy.plans_ahead else [cap], [position],
                          to_device([last_token], feature.device), feature[None], [list(accepted)], [list(drafted)],
                          self.embed, [last_token], given_target_stats=None if target_stats is None else target_stats[None])
        return int(self.policy.plan(self._rows)[0])

    def go_on(self, depth: int, probs: torch.Tensor, token: int = 0, state: torch.Tensor | None = None) -> bool:
        """Whether the chain drafts past ``depth`` (1-based) after drafting ``token`` from ``probs``."""
        if not self.policy.reads_drafts:
            return True
        dev, p = probs.device, float(probs[token])
        self._logp += float(torch.log(torch.tensor(p, dtype=torch.float64))) if p > 0 else float("-inf")
        d = Depth(depth, [0], to_device([self.slot], dev), to_device([token], dev), probs[None],
                  None if state is None else state[None], torch.tensor([self._logp], dtype=torch.float32, device=dev))
        return int(self.policy.stop(d)[0]) == GO

    def observe(self, drafted: int, accepted: int) -> None:
        extra = {k: v.tolist() for k, v in self.policy.reads().items()}
        self.policy.observe(self._rows, [drafted], [accepted], extra)
        self._rows = None


def replay_view(feature_size: int, state_size: int | None = None) -> EngineView:
    """What a policy bound in replay sees: a target of ``feature_size`` features and a drafter of ``state_size``
    states (no models, no drafter kind: nothing to profile), greedy, on the CPU."""
    from types import SimpleNamespace

    candidates = SimpleNamespace(kind=None, drafter=SimpleNamespace(hidden_size=state_size))
    return EngineView(SimpleNamespace(hidden_size=feature_size), candidates, SamplingConfig(), torch.device("cpu"))


@dataclass
class ReplayResult:
    new_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        return self.new_tokens / max(self.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else float("nan")

    @property
    def wasted(self) -> int:
        return self.drafted - self.accepted


def stand_in_probs(top1: float, entropy: float, vocab_size: int) -> torch.Tensor:
    """A distribution whose top entry (index 0) is ``top1`` and whose entropy is close to ``entropy``:
    ``top1`` plus ``n`` equal entries, with ``n`` chosen for the entropy and limited by the vocabulary."""
    p = min(max(float(top1), 1.0 / vocab_size), 1.0)
    if p >= 1.0 - 1e-9:
        return torch.tensor([1.0], dtype=torch.float64)
    h_p = -p * math.log(p) - (1 - p) * math.log(1 - p)  # entropy of (p, 1 - p); n entries add (1-p) log n
    log_n = min((max(float(entropy), h_p) - h_p) / (1 - p), 30.0)
    lo, hi = max(1, math.ceil((1 - p) / p - 1e-9)), vocab_size - 1  # no other entry may exceed p
    n = min(max(round(math.exp(log_n)), lo), hi)
    rest = (1 - p) / n
    return torch.tensor([p] + [rest] * n, dtype=torch.float64)


class OracleRows:
    """Oracle rows grouped by sequence, as arrays: seq_id, index, last_token, label, remaining,
    draft_top1_prob and draft_entropy (rows, k_max), feature when stored and draft_state (rows, k_max, d)
    when stored."""

    COLUMNS = ("seq_id", "index", "last_token", "label", "remaining", "draft_top1_prob", "draft_entropy")
    OPTIONAL = ("feature", "draft_state", "target_stats")

    def __init__(self, columns: dict, max_new_tokens: int | None = None):
        self.max_new_tokens = max_new_tokens  # the responses' budget: the engine caps γ by it, not by EOS
        missing = [c for c in self.COLUMNS if c not in columns]
        if missing:
            raise ValueError(f"oracle rows lack the columns {missing}")
        cols = {c: np.asarray(v) for c, v in columns.items() if c in self.COLUMNS + self.OPTIONAL}
        if len(cols["label"]) == 0:
            raise ValueError("no oracle rows to replay")
        self.k_max = int(cols["draft_top1_prob"].shape[1])
        order = np.lexsort((cols["index"], cols["seq_id"]))
        self.cols = {c: v[order] for c, v in cols.items()}
        seq = self.cols["seq_id"]
        starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
        self.sequences = list(zip(starts.tolist(), np.r_[starts[1:], len(seq)].tolist()))
        self.has_features = "feature" in self.cols
        if "draft_state" in self.cols:
            # float32 once, here: replay hands one state per drafted token to the policy
            self.cols["draft_state"] = self.cols["draft_state"].reshape(len(order), self.k_max, -1).astype(np.float32)

    @classmethod
    def load(cls, oracle_dir, split: str | None = "validation", with_features: bool = True) -> "OracleRows":
        """From a collection folder (``scripts/collect_oracle.py``), one split or all."""
        from ldlp.labels.store import read_rows

        data, manifest = read_rows(oracle_dir, cls.COLUMNS, split,
                                   optional=cls.OPTIONAL if with_features else ("target_stats",))
        return cls(data, manifest.get("max_new_tokens"))

    @classmethod
    def from_sequences(cls, rows_per_sequence: list[dict], max_new_tokens: int | None = None) -> "OracleRows":
        """From :func:`ldlp.labels.oracle.oracle_labels` outputs, one per sequence (tensors)."""
        cols: dict[str, list] = {}
        for seq_id, rows in enumerate(rows_per_sequence):
            n = len(rows["label"])
            cols.setdefault("seq_id", []).append(np.full(n, seq_id))
            for c in cls.COLUMNS[1:] + cls.OPTIONAL:
                if c in rows:
                    cols.setdefault(c, []).append(rows[c].float().numpy() if rows[c].is_floating_point()
                                                  else rows[c].numpy())
        return cls({c: np.concatenate(v) for c, v in cols.items()}, max_new_tokens)

    def __len__(self) -> int:
        return len(self.cols["label"])


def replay(rows: OracleRows, policy: DraftPolicy | str, costs: CostTable, embed=None, vocab_size: int = 2 ** 15,
           oracle_cap: int = 8, on_step=None) -> ReplayResult:
    """Walk every sequence as the engine would under ``policy`` (or ``"oracle"``: draft exactly what the
    target accepts, at most ``oracle_cap``). ``embed`` maps token ids to target embeddings (the LDLP
    reads them); the row's stored feature is ``rows.features``, its stored target_stats ``rows.target_stats``, and
    its stored drafter states are ``Depth.states`` (acceptance heads read them).
    As in the engine, a policy that reads drafts sees every drafted depth, the last one too.
    ``on_step(row, drafted, accepted)``, when given, is called after each step with the row it started at."""
    c, res = rows.cols, ReplayResult()
    stats = c.get("target_stats")
    states = c.get("draft_state")
    if isinstance(policy, DraftPolicy) and rows.has_features and states is not None:
        # a predictor or head of other sizes than the stored rows fails here, not at the first step
        policy.bind(replay_view(np.asarray(c["feature"][0]).shape[-1], states.shape[-1]))
    pricing = getattr(policy, "pricing", None)
    if pricing is not None and pricing.costs is None:  # a policy that prices its choices as the engine does
        pricing.costs = costs  # (policy=learned): by the table that prices replay's steps, no engine to bind
    if isinstance(policy, DraftPolicy):
        policy = OneSequence(policy, embed)  # a batched policy asked one sequence at a time
    for start, end in rows.sequences:
        index = c["index"][start:end]
        first = int(index[0])
        where = {int(i): start + j for j, i in enumerate(index)}
        if not isinstance(policy, str):
            policy.begin()
        accepted_hist: list[int] = []
        drafted_hist: list[int] = []
        pos = first
        while pos in where:
            r = where[pos]
            label, remaining = int(c["label"][r]), int(c["remaining"][r])
            position = pos - first + 1  # tokens generated so far, as the engine's rows.positions
            # the engine caps γ by the budget (a response that ended with EOS had room for more drafts)
            left = rows.max_new_tokens - position if rows.max_new_tokens else remaining
            max_gamma = max(0, min(rows.k_max, left - 1))
            if isinstance(policy, str):
                k = min(label, max_gamma, oracle_cap)
            else:
                feature = torch.from_numpy(np.asarray(c["feature"][r], dtype=np.float32)) if rows.has_features \
                    else torch.zeros(1)
                gamma = min(policy.plan(int(c["last_token"][r]), feature, position, max_gamma, accepted_hist,
                                        drafted_hist, None if stats is None else torch.from_numpy(np.asarray(stats[r]))),
                            max_gamma)
                k = 0
                for i in range(1, gamma + 1):
                    k = i
                    probs = stand_in_probs(c["draft_top1_prob"][r][i - 1], c["draft_entropy"][r][i - 1], vocab_size)
                    state = torch.from_numpy(states[r, i - 1]) if states is not None else None
                    if not policy.go_on(i, probs, 0, state) or i == gamma:  # the last depth is kept either way
                        break
            a = min(label, k)
            res.steps += 1
            res.drafted += k
            res.accepted += a
            res.new_tokens += min(a + 1, remaining)  # a draft that ends on EOS leaves no room for a bonus token
            res.seconds += step_seconds(costs, k, a)
            if not isinstance(policy, str):
                accepted_hist.append(a)
                drafted_hist.append(k)
                policy.observe(k, a)
            if on_step is not None:
                on_step(r, k, a)
            pos += a + 1
    return res


def fit_costs(stats) -> CostTable:
    """A linear cost table (:meth:`~eagle_backbone.cost.CostTable.linear`) fitted by non-negative least squares
    of generation seconds on target forwards, drafted and accepted tokens: how timed generations split their
    time (the head to head reports it for its own).

    ``stats``: GenerationStats of timed static-γ generations (several γ, so the terms separate)."""
    X = np.array([[s.target_forwards, s.drafted_tokens, s.accepted_tokens] for s in stats], dtype=float)
    y = np.array([s.wall_s for s in stats])
    if len(stats) < 3 or np.linalg.matrix_rank(X) < 3:
        raise ValueError("fit_costs needs timed generations at several static γ (at least 3 that differ)")
    coef = nonnegative_least_squares(X, y)
    return CostTable.linear(*(1e3 * max(0.0, float(c)) for c in coef))


def grid(params: dict) -> list[dict]:
    """Every combination of ``{field: [values]}`` (a scalar is one value)."""
    import itertools

    keys = list(params)
    values = [v if isinstance(v, (list, tuple)) else [v] for v in params.values()]
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def tune(rows: OracleRows, costs: CostTable, policies: dict, embed=None, vocab_size: int = 2 ** 15,
         oracle_cap: int = 8, progress: bool = True) -> list[dict]:
    """Replay every policy config in ``policies`` ({name: (build(params) -> policy, [params, ...])}) and
    the oracle; one dict per config with its τ, tokens/s, drafted and wasted tokens and the share of
    the oracle's headroom over the best static γ it captures. Best first within each policy."""
    from tqdm.auto import tqdm

    jobs = [(name, params, build) for name, (build, param_list) in policies.items() for params in param_list]
    out = []
    for name, params, build in tqdm(jobs, desc="replay", disable=not progress):
        r = replay(rows, build(params), costs, embed, vocab_size, oracle_cap)
        out.append({"policy": name, "params": params, "tau": r.tau, "tokens_per_s": r.tokens_per_s,
                    "steps": r.steps, "drafted": r.drafted, "wasted": r.wasted})
    o = replay(rows, "oracle", costs, oracle_cap=oracle_cap)
    oracle = {"policy": "oracle", "params": {"k_max": oracle_cap}, "tau": o.tau, "tokens_per_s": o.tokens_per_s,
              "steps": o.steps, "drafted": o.drafted, "wasted": o.wasted}
    static = [r["tokens_per_s"] for r in out if r["policy"] == "static"]
    best_static = max(static) if static else float("nan")
    for r in out + [oracle]:
        r["headroom_captured"] = headroom_captured(r["tokens_per_s"], best_static, oracle["tokens_per_s"])
    out.sort(key=lambda r: (r["policy"], -r["tokens_per_s"]))
    return out + [oracle]


def best_per_policy(results: list[dict]) -> dict[str, dict]:
    best: dict[str, dict] = {}
    for r in results:
        if r["policy"] not in best or r["tokens_per_s"] > best[r["policy"]]["tokens_per_s"]:
            best[r["policy"]] = r
    return best
