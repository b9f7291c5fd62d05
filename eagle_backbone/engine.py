"""The speculative engine: S slots decode at once, each with its own prompt, position, γ and budget.
Batch 1 is the same engine with one slot (:class:`SpeculativeDecoder`, :func:`autoregressive_generate`).

A step runs in named phases over the running slots (:meth:`BatchedSpeculativeEngine._spec_step`), each a
method with typed inputs and outputs:

1. **plan** (:class:`StepPlan`): γ per slot from the policy (:mod:`eagle_backbone.policy`): its ``plan``
   over the running rows, or, for a policy that ``plans_ahead`` (the LDLP), the γ it computed right after
   the last verification and the host read with the accept counts. The step's host-to-device copy
   (slots, positions, random streams) is one transfer.
2. **draft** (:class:`Drafts`): the candidate generator (:mod:`eagle_backbone.candidates`) first reads what
   the target accepted since the last step, then drafts one depth per forward for the rows still drafting.
   A policy that reads drafts gives stop codes on the device after each depth; with ``early_exit`` (a CPU,
   where reading is no synchronisation) the engine reads them to skip the rows that stopped, otherwise
   they stay masks and the rows draft to their caps.
3. **verify** (:class:`Verification`): one target forward over a ragged batch
   (:class:`~eagle_backbone.llama.RaggedBatch`): slot b brings its last token and its drafts, nothing
   padded; γ_b = 0 is a plain decoding step. Each slot attends over its own cache in place.
4. **accept** (:class:`Acceptance`): greedy or speculative-sampling acceptance, batched on the device,
   bounded by each row's drafted count.
5. **commit**: bookkeeping on the device, then the step's one host read (:class:`HostRead`: accept counts,
   emitted tokens, drafted counts kept on the device, a planned-ahead γ, what the policy's observation
   needs, the first tokens of prompts admitted this step), then budgets, EOS, counters and the policy's
   ``observe`` on the host. Rollback is setting lengths: the target keeps the accepted prefix, the
   generator what it needs. Finished slots are free for the next prompt.

**Prefill scheduling** (``prefill``). "chunked" (the default, vLLM's default scheduling): a step's target
forward scores at most ``max_batched_tokens`` tokens (2048 by default), the running rows' last tokens and
drafts first and then, in the room left, chunks of the prompts still being read, oldest admission first,
each a ragged row of the same batch (projections and MLPs over all tokens at once) starting where its slot's
prefill stopped (``Slot.prefilled``); when nothing runs, a step is the prompts' chunks alone. A chunk that
does not finish its prompt emits nothing and its slot is not running (the policy does not see it); the chunk
that finishes it picks the first token. "joined": a prompt admitted while other slots run is prefilled whole
inside the step's target forward. "separate": the new prompts' own forward, a step before the others'. In
every mode the drafter's prefill needs the first token, so it is a forward of its own right after the
target's, over the whole prompt (the target's features of earlier chunks read back from the engine's feature
buffer). Each sequence draws from its own random stream (its seed and step), so the schedule changes when a
prompt is read, not what a sampled sequence draws.

Bookkeeping writes past a slot's length go to a trash position (the last of the buffers) that no real
query can see. Greedy output equals each sequence's own greedy decoding by the target
(:meth:`~eagle_backbone.target.TargetModel.reference_greedy`; float32 bit for bit, and bfloat16 with
eager attention on the embedded pair); sampled output has the target's distribution, with a random stream
per sequence.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from eagle_backbone.llama import BatchedLlama, RaggedBatch, Span
from eagle_backbone.candidates import CandidateGenerator, make_candidates
from eagle_backbone.metrics import GenerationStats
from eagle_backbone.policy import (
    DROP,
    GO,
    Depth,
    DraftPolicy,
    OwnTime,
    Rows,
    StaticPolicy,
    TreeOutcome,
    as_draft_policy,
    go_while,
)
from eagle_backbone.runtime import to_device
from eagle_backbone.step_cost import OnlineCostModel, StepRecord, StepShape, attended_keys
from eagle_backbone.sampling import (
    ACCEPT,
    DRAFT,
    FINAL,
    SamplingConfig,
    probs_from_logits,
    sample_rows,
    uniforms,
    verify_greedy_batch,
    verify_sampling_batch,
)
from eagle_backbone.target import TargetModel
from eagle_backbone.tree import (
    DraftTree,
    emitted_tokens,
    on_path,
    prune,
    tree_uniforms,
    tree_walk,
    verify_tree_greedy,
)
from eagle_backbone.tree_draft import TreeSpec, grow_tree


STEP_LOG = 100_000  # the most step records an engine keeps (the newest): a long-lived engine's log stays bounded
PREFILL_MODES = ("joined", "chunked", "separate")
MAX_BATCHED_TOKENS = 2048  # chunked prefill's token budget per target forward (docs/batched.md#chunked-prefill)


def check_prefill(prefill, max_batched_tokens) -> None:
    """One-line errors for a prefill schedule the engine does not have."""
    if prefill not in PREFILL_MODES:
        raise ValueError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {prefill!r}")
    if not isinstance(max_batched_tokens, int) or isinstance(max_batched_tokens, bool) or max_batched_tokens < 1:
        raise ValueError(f"max_batched_tokens must be an integer >= 1, got {max_batched_tokens!r}")


@dataclass
class GenerationOutput:
    tokens: list[int]  # new tokens only, EOS included when generated
    stats: GenerationStats


def check_prompt(prompt_ids, target: TargetModel) -> list[int]:
    ids = prompt_ids.flatten().tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
    if not ids:
        raise ValueError("empty prompt: give at least one token (e.g. the BOS token)")
    if len(ids) >= target.max_length:
        raise ValueError(f"prompt has {len(ids)} tokens but the target's context is {target.max_length}: "
                         "no position is left to generate")
    bad = [t for t in ids if not 0 <= t < target.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the target vocabulary [0, {target.vocab_size})")
    return ids


@dataclass
class DraftRecord:
    """One step's drafts for R rows. ``parents[r, i]`` is the index of draft i's parent in this record,
    -1 for the slot's last accepted token: a chain is i-1; a tree later sets other parents (and a tree
    mask) without changing the record's shape."""

    tokens: torch.Tensor  # (R, K) drafted tokens (0 past a row's length)
    lengths: torch.Tensor  # (R,) drafts per row (device)
    parents: torch.Tensor  # (R, K)
    probs: torch.Tensor | None = None  # (R, K, V) drafter distributions (sampling only)


@dataclass
class StepPlan:
    """The plan phase's output: the step's running slots and what each may draft."""

    run: list[int]  # slot indices (host)
    slots: list[Slot]
    gammas: list[int]  # drafts each row may make (0: a plain decoding step for that slot)
    view: Rows  # what the policy saw (and sees again at observe)
    rows: torch.Tensor  # (R,) the slot indices on the device
    tlens: list[int]  # position of each slot's last token
    tl: torch.Tensor  # (R,) the same on the device
    seeds: torch.Tensor | None  # (R,) the slots' random streams (None when greedy)
    steps: torch.Tensor | None  # (R,)

    @property
    def max_gamma(self) -> int:
        return max(self.gammas) if self.gammas else 0


@dataclass
class Drafts:
    """The draft phase's output: chains of drafted tokens (R, G), the count per row on the host (exact, or
    each row's cap when the stop codes stayed on the device) and, then, the exact counts on the device
    (``lengths``); when sampling, the distributions the drafts were drawn from (R, G, V)."""

    tokens: torch.Tensor
    drafted: list[int]
    probs: torch.Tensor | None = None
    lengths: torch.Tensor | None = None  # (R,) exact counts when the host has only the caps
    going: torch.Tensor | None = None  # (R,) rows whose codes still say GO (device mode)
    depth_rows: list[int] = field(default_factory=list)  # rows the drafter ran at each depth (the step's shape)

    @staticmethod
    def none(plan: StepPlan, device) -> Drafts:
        return Drafts(torch.zeros(len(plan.run), 0, dtype=torch.long, device=device), [0] * len(plan.run))

    def add(self, depth: int, idx, active: list[int], tok, probs, greedy: bool) -> None:
        """Depth ``depth``'s drafts for rows ``active`` (``idx``: their index, a slice when all rows)."""
        self.tokens[idx, depth - 1] = tok
        if not greedy:
            if self.probs is None:
                R, G = self.tokens.shape
                self.probs = probs.new_zeros(R, G, probs.shape[-1])
            self.probs[idx, depth - 1] = probs
        for i in active:
            self.drafted[i] = depth
        self.depth_rows.append(len(active))

    def apply_codes(self, depth: int, idx, active: list[int], codes, on_host: bool) -> None:
        """A policy's stop codes for this depth's rows: on the host (the counts become exact), or as device
        masks (``lengths`` and ``going``; the host keeps the caps)."""
        if on_host:
            for i, c in zip(active, codes):
                if c == DROP:
                    self.drafted[i] = depth - 1
            return
        if self.lengths is None:
            R = self.tokens.shape[0]
            self.lengths = torch.zeros(R, dtype=torch.long, device=self.tokens.device)
            self.going = torch.ones(R, dtype=torch.bool, device=self.tokens.device)
        going = self.going[idx]
        self.lengths[idx] = torch.where(going & (codes != DROP), depth, self.lengths[idx])
        self.going[idx] = going & (codes == GO)


@dataclass
class Verification:
    """The verify phase's output: the drafts as verified, the target's logits and hidden states at each
    row's last token and drafts (R, T, ·), the rows' positions (device) and, when prompt chunks joined the
    forward, the chunks (slot, start, count), their tokens, batch, hidden states and features."""

    record: DraftRecord
    logits: torch.Tensor
    hidden: torch.Tensor
    tlens: torch.Tensor
    prefill: tuple | None = None
    feats: torch.Tensor | None = None  # (R, T, F) the generator's features when not ``hidden`` (EAGLE-3's layers)


@dataclass
class Acceptance:
    """The accept phase's output (device): accepted drafts per row (R,), the token after them (R,), and
    the emitted tokens (R, T): the accepted drafts then the next token."""

    accepted: torch.Tensor
    next_token: torch.Tensor
    emitted: torch.Tensor


@dataclass
class _Walk:
    path: torch.Tensor  # (R, K) accepted nodes, root side first, -1 padded
    tested: torch.Tensor  # (R, K) bool: nodes the target judged


class HostRead(dict):
    """The step's one device-to-host read: named device tensors packed into one transfer, read back by
    name (a (R, T) tensor comes back as R lists)."""

    @classmethod
    def read(cls, parts: dict[str, torch.Tensor]) -> HostRead:
        # float64 carries the integers exactly (token ids, counts) and a policy's floats
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in parts.values()]).tolist()
        out, o = cls(), 0
        for name, t in parts.items():
            vals = flat[o: o + t.numel()]
            if not t.is_floating_point():
                vals = [int(x) for x in vals]
            o += t.numel()
            out[name] = [vals[i: i + t.shape[1]] for i in range(0, len(vals), t.shape[1])] if t.dim() == 2 else vals
        return out


@dataclass
class Slot:
    """Host-side state of one sequence in a slot."""

    prompt: list[int]
    max_new: int
    seed: int
    request: object = None  # the caller's handle (e.g. a prompt index)
    new: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    step: int = 0  # decoding steps done (prefill = step 0)
    tlen: int = 0  # target positions cached; the last token sits at position tlen
    gamma_next: int | None = None  # planned ahead (plans_ahead policies), read with the accept counts
    done: bool = False
    t_admit: float = 0.0
    token_times: list[float] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens the target has read (chunked prefill reads a prompt over several steps)


class _Profile:
    """Per-component seconds in profiled mode only (the timed mode never marks). On a GPU, CUDA events
    recorded at each mark and read once at the end of the step (one synchronisation a step, not one a
    component); on a CPU, perf_counter (the work is done when the call returns)."""

    def __init__(self, device, on: bool):
        self.on, self.cuda = on, device.type == "cuda"
        self.s: dict[str, float] = {}
        self._t = None
        self._events: list[tuple[str, object, object]] = []

    def start(self):
        if not self.on:
            return
        if self.cuda:
            self._t = torch.cuda.Event(enable_timing=True)
            self._t.record()
        else:
            self._t = time.perf_counter()

    def mark(self, name: str):
        if not self.on:
            return
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self._events.append((name, self._t, e))
            self._t = e
        else:
            t = time.perf_counter()
            self.s[name] = self.s.get(name, 0.0) + t - self._t
            self._t = t

    def flush(self):
        """Add the step's CUDA event intervals (one synchronisation)."""
        if self.on and self._events:
            self._events[-1][2].synchronize()
            for name, a, b in self._events:
                self.s[name] = self.s.get(name, 0.0) + a.elapsed_time(b) / 1e3
            self._events = []


class _StepClock:
    """A step's milliseconds for the step-cost records: on a CPU a wall clock and the thread's CPU clock read
    at the start and the end (torch on one thread computes on this thread; another process on the core
    stretches the wall time, not the CPU time); on a GPU a CUDA event at the start and one just before the
    step's host read, read after it (the read has synchronised, so no extra synchronisation), plus the host's
    time after the read, and no CPU time."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self._t0 = self._t_read = self._c0 = 0.0
        self._ev = None

    def start(self):
        self._t0 = time.perf_counter()
        self._c0 = time.thread_time()
        if self.cuda:
            self._ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._ev[0].record()

    def before_read(self):
        if self.cuda:
            self._ev[1].record()
            self._t_read = time.perf_counter()

    def ms(self) -> tuple[float, float | None]:
        """(wall ms, CPU ms or None on a GPU)."""
        now = time.perf_counter()
        if self.cuda:  # the events finished before the host read returned
            return self._ev[0].elapsed_time(self._ev[1]) + 1e3 * (now - self._t_read), None
        return 1e3 * (now - self._t0), 1e3 * (time.thread_time() - self._c0)


def default_attn(target: TargetModel) -> str:
    """The attention math the target was loaded with (eager or sdpa; any other kernel runs as sdpa)."""
    impl = getattr(target.model.config, "_attn_implementation", None)
    return impl if impl in ("eager", "sdpa") else "sdpa"


class BatchedSpeculativeEngine:
    """``slots`` sequences at once over ``target`` and an optional candidate generator.

    ``candidates``: a :class:`~eagle_backbone.candidates.CandidateGenerator` (the engine binds its own copy),
    or a drafter model with its ``kind`` (eagle | draft_lm); None decodes without drafts.

    ``policy``: a :class:`~eagle_backbone.policy.DraftPolicy` (one instance for every slot), a per-sequence
    :class:`~eagle_backbone.policy.DraftLengthPolicy` (copied per slot: the slow path) or a zero-argument
    factory of either; None means γ = 0 (batched autoregressive decoding). ``capacity``: positions per slot
    (default: the target's context). ``prefill``: "chunked" (default: a step's forward scores at most
    ``max_batched_tokens`` tokens, default :data:`MAX_BATCHED_TOKENS`: the running rows' first, then chunks of
    the prompts being read in the room left), "joined" (new prompts ride whole in the step's target forward as
    more rows of its ragged batch) or "separate" (their own target forward before the step); the module
    docstring has the schedule, docs/batched.md#chunked-prefill the measurement that chose it.
    ``early_exit``: read a policy's stop codes after each draft depth, so that rows that stopped draft and
    score nothing more (default: where a read is no synchronisation, a CPU); off, the codes stay on the
    device as masks, every row drafts to its cap and the target scores up to the caps (the step's only read
    is then the one after verification).

    ``cost_model``: an :class:`~eagle_backbone.step_cost.OnlineCostModel` that learns from this engine's timed
    steps (one may be shared by the engines of a run; a cost-driven policy that gets none makes its own from
    its cost table, :meth:`attach_costs`). ``record_steps``: keep every speculative step's shape and wall
    time (``step_log``, :class:`~eagle_backbone.step_cost.StepRecord`, with the model's prediction; the newest
    :data:`STEP_LOG`).
    """

    def __init__(self, target: TargetModel, candidates=None, kind: str | None = None, slots: int = 8,
                 policy=None, sampling: SamplingConfig | None = None, capacity: int | None = None,
                 attn: str | None = None, prefill: str = "chunked", profile: bool = False, max_draft: int = 32,
                 early_exit: bool | None = None, cost_model=None, record_steps: bool = True,
                 max_batched_tokens: int = MAX_BATCHED_TOKENS):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"batch size (slots) must be an integer >= 1, got {slots!r}")
        check_prefill(prefill, max_batched_tokens)
        self.max_batched_tokens = max_batched_tokens
        attn = attn or default_attn(target)
        if candidates is not None and not isinstance(candidates, CandidateGenerator):
            candidates = make_candidates(kind, candidates, target, attn)
        # as given, unbound: a batch policy builds engines like this one to profile its costs
        self.candidates, self.attn = candidates, attn
        self.target, self.kind, self.slots = target, candidates.kind if candidates is not None else None, slots
        self.sampling = sampling or SamplingConfig()  # greedy by default
        self.limit = min(target.max_length, capacity or target.max_length)  # positions a sequence may use
        self.trash = self.limit  # padded positions write here; no real query (position < limit) sees it
        buf = self.limit + 1
        self.device, self.prefill, self.max_draft = target.device, prefill, max_draft
        self.cost_model, self.record_steps = cost_model, bool(record_steps)
        self.step_log: deque[StepRecord] = deque(maxlen=STEP_LOG)
        self._clock = _StepClock(self.device)
        self._unfed = [0] * slots  # tokens accepted per slot since the drafter's last catch-up forward
        self.tm = BatchedLlama(target.model, buf, attn)
        self.tcache = self.tm.new_cache(slots)
        self.eos = to_device(sorted(target.eos_token_ids) or [-1], self.device)
        self.seq = torch.zeros(slots, buf, dtype=torch.long, device=self.device)  # tokens by position
        self.last_feat = torch.zeros(slots, target.hidden_size, dtype=target.dtype, device=self.device)
        # the target layers whose states the generator reads (EAGLE-3); () : the last hidden state (EAGLE-1)
        self.feature_layers = tuple(candidates.feature_layers) if candidates is not None else ()
        if candidates is not None and candidates.needs_features:
            width = target.hidden_size * max(1, len(self.feature_layers))
            self.feat = torch.zeros(slots, buf, width, dtype=target.dtype, device=self.device)
        self.policy: DraftPolicy = StaticPolicy(0) if policy is None else as_draft_policy(policy)
        # a tree policy makes every step grow and verify draft trees (eagle_backbone/tree_draft.py)
        self.tree: TreeSpec | None = self.policy.tree if candidates is not None else None
        self.tree_room = self.tree.fed if self.tree is not None else 0  # generator positions a tree feeds
        self.cand = candidates.bound(self) if candidates is not None else None
        self.early_exit = self.device.type != "cuda" if early_exit is None else bool(early_exit)
        self.policy.bind(self)  # its costs, its models' sizes against the pair: now, not mid-run
        self.own = OwnTime()  # the policy's own seconds (plan, stop, observe)
        self._timed = type(self.policy).timed is not DraftPolicy.timed  # it measures its steps (goodput feedback)
        # the plan's host-to-device copy goes through one pinned staging buffer on a GPU: reusing it each step
        # is safe because the previous step's copy finished before that step's host read returned
        self._stage = (torch.empty(4 * slots, dtype=torch.long, pin_memory=True) if self.device.type == "cuda"
                       else None)
        self.state: list[Slot | None] = [None] * slots
        self._admitted: list[int] = []  # slots whose prompt the target has not read to its end, oldest first
        self.prof = _Profile(self.device, profile)
        self.steps = 0

    # ---- admission ------------------------------------------------------------------------------
    def free_slots(self) -> list[int]:
        return [b for b, s in enumerate(self.state) if s is None or s.done]

    def admit(self, slot: int, prompt_ids, max_new_tokens: int, seed: int = 0, request=None) -> None:
        """Put a new sequence into a free ``slot``; it is prefilled from the next :meth:`step` on."""
        ids = check_prompt(prompt_ids, self.target)
        if len(ids) >= self.limit:
            raise ValueError(f"prompt has {len(ids)} tokens but the cache holds {self.limit} positions per slot: "
                             "no position is left to generate (raise capacity or shorten the prompt)")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} does not exist (the engine has {self.slots})")
        if self.state[slot] is not None and not self.state[slot].done:
            raise ValueError(f"slot {slot} is busy")
        self.own.call(self.policy.begin, slot, ids, max_new_tokens)
        self._unfed[slot] = 0  # the drafter's prefill reads the prompt
        s = Slot(ids, max_new_tokens, int(seed), request, t_admit=time.perf_counter())
        self.state[slot] = s
        if max_new_tokens == 0:
            s.done = True
        else:
            self._admitted.append(slot)

    def running(self) -> list[int]:
        return [b for b, s in enumerate(self.state) if s is not None and not s.done and b not in self._admitted]

    def busy(self) -> bool:
        return any(s is not None and not s.done for s in self.state)

    # ---- helpers ----------------------------------------------------------------------------------
    def rows(self, slots: list[int]):
        """An index tensor for a row subset, or None when the rows are all slots in order (views, no gather)."""
        if slots == list(range(self.slots)):
            return None
        return to_device(slots, self.device)

    def attach_costs(self, prior, **kw):
        """The engine's step-cost model, warm-started from ``prior`` (a :class:`~eagle_backbone.cost.CostTable`):
        the one given to the engine (warm-started now if it has no prior yet), else a new one; a policy that
        plans by costs reads this model."""
        if self.cost_model is None:
            self.cost_model = OnlineCostModel(prior, **kw)
        elif not self.cost_model.has_prior and not self.cost_model.frozen and prior is not None:
            self.cost_model.warm_start(prior)
        return self.cost_model

    @property
    def policy_s(self) -> float:
        """The policy's own seconds so far (its plan, stop and observe calls)."""
        return self.own.s

    def _pick(self, logits, seeds, steps, draw: int, need_probs: bool):
        """Token per row from (R, V) logits: argmax (greedy; softmax only if asked) or a draw of its stream."""
        if self.sampling.greedy:
            tok = logits.argmax(-1)
            return tok, (probs_from_logits(logits, self.sampling) if need_probs else None)
        probs = probs_from_logits(logits, self.sampling)
        u = uniforms(seeds, steps, to_device([draw], self.device))[:, 0]
        return sample_rows(probs, u), probs

    # ---- prefill --------------------------------------------------------------------------------
    def _take_chunks(self, budget: int | None) -> list[tuple[int, int, int]]:
        """The prompt chunks this forward reads, as (slot, start, count): the admitted prompts oldest first,
        each from where its prefill stopped, within ``budget`` tokens (None: every prompt whole)."""
        chunks = []
        for b in self._admitted:
            s = self.state[b]
            n = len(s.prompt) - s.prefilled
            if budget is not None:
                n = min(n, budget)
                budget -= n
            if n <= 0:
                break
            chunks.append((b, s.prefilled, n))
        return chunks

    def _prefill_batch(self, chunks: list[tuple[int, int, int]]):
        """The chunks as ragged rows (nothing padded): their flat tokens (N,) and the batch."""
        tok = to_device([t for b, a, n in chunks for t in self.state[b].prompt[a: a + n]], self.device)
        return tok, RaggedBatch([b for b, _, _ in chunks], [a for _, a, _ in chunks], [n for _, _, n in chunks],
                                self.device)

    def _prefill(self, chunks: list[tuple[int, int, int]]):
        """A step of prompt chunks alone (the target's forward, then the drafter's for finished prompts):
        the slots whose prompt finished and what the host reads."""
        tok, batch = self._prefill_batch(chunks)
        return self._prefill_finish(chunks, tok, batch, *self._forward(tok, batch))

    def _forward(self, tokens, batch: RaggedBatch):
        """The target forward: final-normed hidden states (N, d) and, when the generator reads
        ``feature_layers`` (EAGLE-3), the states entering them concatenated (N, k·d); else None."""
        if not self.feature_layers:
            return self.tm(tokens, batch, self.tcache), None
        h, aux = self.tm(tokens, batch, self.tcache, hidden_layers=self.feature_layers)
        return h, torch.cat(aux, -1)

    def _prefill_finish(self, chunks, tok, batch: RaggedBatch, h, f=None) -> tuple[list[int], dict[str, torch.Tensor]]:
        """After the target read the chunks (``h`` (N, d): their hidden states; ``f`` the generator's features
        when not ``h``): bookkeeping, and for the prompts now read to their end the first tokens and the
        drafter's own prefill (it needs the first token, so it cannot ride in the target's forward). Returns
        those slots and the device tensors the host reads: their first tokens and a planned-ahead γ."""
        dev = self.device
        self.seq[batch.slot_of, batch.pos] = tok
        keep_features = self.cand is not None and self.cand.needs_features
        if keep_features:
            self.feat[batch.slot_of, batch.pos] = h if f is None else f
        ends = []  # the rows whose chunk finishes its prompt
        for i, (b, a, n) in enumerate(chunks):
            s = self.state[b]
            s.prefilled = a + n
            s.stats.target_forwards += 1
            if s.prefilled == len(s.prompt):
                ends.append(i)
        if not ends:
            return [], {}
        slots = [chunks[i][0] for i in ends]
        self._admitted = [b for b in self._admitted if b not in slots]
        st = [self.state[b] for b in slots]
        whole = len(ends) == len(chunks) and all(a == 0 for _, a, _ in chunks)  # the batch is the prompts
        last = h[batch.last()] if len(ends) == len(chunks) else h[to_device([batch.ends[i] - 1 for i in ends], dev)]
        seeds = steps = None  # the first token's stream (sampling only: greedy draws nothing)
        if not self.sampling.greedy:
            seeds = to_device([s.seed for s in st], dev)
            steps = torch.zeros(len(slots), dtype=torch.long, device=dev)
        x, _ = self._pick(self.tm.logits(last), seeds, steps, FINAL, False)
        ridx = to_device(slots, dev)
        self.seq[ridx, to_device([len(s.prompt) for s in st], dev)] = x
        self.last_feat[ridx] = last
        if self.cand is not None:
            if whole:
                ptok, pbatch, pf = tok, batch, h if f is None else f
            else:  # the whole prompts: earlier chunks' tokens and features as the engine stored them
                pbatch = RaggedBatch(slots, [0] * len(slots), [len(s.prompt) for s in st], dev)
                ptok = self.seq[pbatch.slot_of, pbatch.pos]
                pf = self.feat[pbatch.slot_of, pbatch.pos] if keep_features else None
            self.cand.prefill(slots, ptok, pbatch, x, pf)
        for s in st:
            s.tlen = len(s.prompt)
        reads = {"first_tokens": x}
        if self.policy.plans_ahead and self.kind is not None:
            ahead = self._plan_ahead(slots, st, x, last)
            if ahead is not None:
                reads["gamma_first"] = ahead
        return slots, reads

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[int]:
        """One step: a speculative step for all running slots, with admitted prompts (or chunks of them)
        prefilled in its target forward; or, when nothing runs yet (or prefill is "separate"), the prefill of
        the admitted prompts alone. Returns the slots whose sequence finished."""
        finished: list[int] = []
        prof = self.prof
        prof.start()
        self._clock.start()
        run = self.running()
        if self._admitted and (self.prefill == "separate" or not run):
            # a step of its own (with its one read): prompts admitted while nothing runs, or separate prefill
            chunks = self._take_chunks(self.max_batched_tokens if self.prefill == "chunked" else None)
            done, reads = self._prefill(chunks)
            if done:
                self._first_tokens(done, HostRead.read(reads), finished)
            prof.mark("prefill")
            prof.flush()
            return finished
        if not run:
            prof.flush()
            return finished
        self._spec_step(run, finished)
        prof.flush()
        self.steps += 1
        return finished

    def _first_tokens(self, slots, host: HostRead, finished):
        now = time.perf_counter()
        for i, (b, t) in enumerate(zip(slots, host["first_tokens"])):
            s = self.state[b]
            self._emit(b, s, [t], now, finished)
            if "gamma_first" in host:
                s.gamma_next = host["gamma_first"][i]

    def _rows(self, run: list[int], st: list[Slot], caps, last_tokens: torch.Tensor, features: torch.Tensor,
              pending: int = 0) -> Rows:
        return Rows(run, caps, [len(s.new) + pending for s in st], last_tokens, features,
                    [s.stats.accept_lengths for s in st], [s.stats.draft_lengths for s in st], self.target.embed,
                    [s.new[-1] for s in st] if caps is not None else None, self.target.lm_head)

    def _plan_ahead(self, run: list[int], st: list[Slot], last_tokens, features, accepted=None,
                    drafted=None, last_logits=None) -> torch.Tensor | None:
        """A ``plans_ahead`` policy's γ for the next step, from the new last tokens and features: a device
        tensor rides in the step's one read; a host list is stored at once (None returned). ``accepted`` and
        ``drafted``: the step just verified, not yet read (None after a prefill, whose first token is pending)."""
        view = self._rows(run, st, None, last_tokens, features, pending=1 if accepted is None else 0)
        view.step_accepted, view.step_drafted, view.last_logits = accepted, drafted, last_logits
        g = self.own.call(self.policy.plan, view)
        if isinstance(g, torch.Tensor):
            return g
        for s, v in zip(st, g):
            s.gamma_next = int(v)
        return None

    # ---- one speculative step, in phases: plan -> draft -> verify -> accept -> commit ----------------
    def _spec_step(self, run: list[int], finished: list[int]):
        prof = self.prof
        plan = self._plan(run)
        prof.mark("policy")
        tree = self.tree is not None and plan.max_gamma and self.policy.tree_now()
        if tree:
            drafts, ver, acc = self._tree_phases(plan)
        else:
            drafts = self._draft(plan) if plan.max_gamma else Drafts.none(plan, self.device)
            prof.mark("draft")
            ver = self._verify(plan, drafts)
            acc = self._accept(plan, drafts, ver)
        self._commit_device(plan, ver, acc)
        reads = self._reads(plan, drafts, acc, None if tree else ver.logits)
        prof.mark("verify")
        chunks, joined = [], []  # the prompt chunks in this forward; the slots whose prompt they finished
        if ver.prefill is not None:
            chunks = ver.prefill[0]
            joined, first = self._prefill_finish(*ver.prefill)
            reads.update(first)
            prof.mark("prefill")
        self._clock.before_read()
        host = HostRead.read(reads)  # the step's one host read
        prof.mark("read")
        shape = self._shape(plan, drafts, host, chunks, bool(tree))
        self._commit_host(plan, drafts, host, finished)
        if joined:
            self._first_tokens(joined, host, finished)
        prof.mark("host")
        self._record(shape, plan.max_gamma)

    def _shape(self, plan: StepPlan, drafts: Drafts, host: HostRead, chunks, tree: bool) -> StepShape:
        """What this step did, from host values (the step's cost-model features): rows, scored tokens and
        attended keys, the drafter's rows by depth and the tokens it caught up on, the prompt tokens joined
        (the drafter's prefill is counted as the chunks' tokens: the whole prompt when it is read whole)."""
        drafted = host.get("drafted", drafts.drafted)
        counts = [d + 1 for d in drafted]
        depth_rows = tuple(drafts.depth_rows)
        fed = sum(self._unfed[b] for b in plan.run) if depth_rows else 0
        starts, prompts = [a for _, a, _ in chunks], [n for _, _, n in chunks]
        return StepShape(len(plan.run), sum(counts), attended_keys(plan.tlens, counts), depth_rows, fed,
                         sum(prompts), attended_keys(starts, prompts), tree, self.cand is not None)

    def _record(self, shape: StepShape, gamma: int) -> None:
        """The step's wall time with its shape: into the cost model (its upkeep counts as the policy's own
        time) and the step log; the drafter's catch-up counts move on."""
        ms, cpu_ms = self._clock.ms()
        model, predicted, predicted_cpu = self.cost_model, None, None
        if model is not None:
            predicted_cpu = model.predict_cpu(shape) if model.version and cpu_ms is not None else None
            predicted = self.own.call(model.observe, shape, ms, cpu_ms)
        if self._timed:
            self.own.call(self.policy.timed, ms, shape)
        if self.record_steps:
            self.step_log.append(StepRecord(shape, ms, predicted, gamma, cpu_ms, predicted_cpu))
    def _plan(self, run: list[int]) -> StepPlan:
        """γ per running slot, as host ints: a plan-ahead policy's from the last read, any other's from its
        ``plan`` (a device tensor returned here costs a read of its own: shipped policies return host lists)."""
        st = [self.state[b] for b in run]
        caps = [max(0, min(s.max_new - len(s.new) - 1, self.limit - 1 - s.tlen, self.max_draft)) for s in st]
        if self.kind is None:
            caps = [0] * len(run)
        seeds = steps = None  # the slots' random streams (sampling only: greedy draws nothing)
        tlens = [s.tlen for s in st]
        host = run + tlens
        if not self.sampling.greedy:
            host += [s.seed for s in st] + [s.step + 1 for s in st]
        up = self._upload(host)
        R = len(run)
        rows, tl = up[:R], up[R: 2 * R]
        if not self.sampling.greedy:
            seeds, steps = up[2 * R: 3 * R], up[3 * R:]
        view = self._rows(run, st, caps, self.seq[rows, tl], self.last_feat[rows])
        if self.policy.plans_ahead:
            planned = [s.gamma_next if s.gamma_next is not None else 0 for s in st]
        else:
            planned = self.own.call(self.policy.plan, view)
            if isinstance(planned, torch.Tensor):
                planned = planned.tolist()
        for b, g in zip(run, planned):
            if not isinstance(g, int) or isinstance(g, bool) or g < 0:
                raise ValueError(f"policy {self.policy.name!r} returned gamma={g!r} for slot {b}; "
                                 "it must be an integer >= 0")
        gammas = [min(g, c) for g, c in zip(planned, caps)]
        return StepPlan(run, st, gammas, view, rows, tlens, tl, seeds, steps)

    def _upload(self, values: list[int]) -> torch.Tensor:
        """The step's host-to-device copy, one transfer (through the pinned buffer on a GPU)."""
        if self._stage is None:
            return to_device(values, self.device)
        staged = self._stage[: len(values)]
        staged.copy_(torch.tensor(values, dtype=torch.long))
        return staged.to(self.device, non_blocking=True)

    def _draft(self, plan: StepPlan) -> Drafts:
        """Draft chains of up to γ per row with the candidate generator, one forward a depth for the rows
        still drafting; a policy that reads drafts gives stop codes after each depth."""
        R, G = len(plan.run), plan.max_gamma
        out = Drafts(torch.zeros(R, G, dtype=torch.long, device=self.device), [0] * R)
        reads = self.policy.reads_drafts
        logp = torch.zeros(R, dtype=torch.float64, device=self.device) if reads else None
        # every running slot reads what the target accepted (also γ=0 slots: the forward runs anyway)
        logits, state = self.cand.start(plan.run, plan.tlens)
        active = [i for i in range(R) if plan.gammas[i] > 0]
        for depth in range(1, G + 1):
            # while every row drafts (always so at batch 1) the rows are a slice, not a gather: fewer kernels
            whole = len(active) == R
            idx = slice(None) if whole else to_device(active, self.device)
            pick = (lambda t: t) if whole else (lambda t: None if t is None else t[idx])
            tok, probs = self._pick(pick(logits), pick(plan.seeds), pick(plan.steps), DRAFT + depth - 1,
                                    reads)
            out.add(depth, idx, active, tok, probs, self.sampling.greedy)
            self.prof.mark("draft")
            nxt = [i for i in active if plan.gammas[i] > depth]
            if reads:
                nxt = self._stop(plan, out, depth, active, idx, tok, probs, pick(state), logp, nxt)
            self.prof.mark("policy")
            if not nxt:
                break
            logits, state = self._extend(plan, depth, active, nxt, tok, logits, state)
            active = nxt
        return out

    def _stop(self, plan: StepPlan, out: Drafts, depth: int, active, idx, tok, probs, state, logp, nxt) -> list[int]:
        """The policy's stop codes for this depth's rows; the rows that draft the next depth."""
        logp[idx] += torch.log(probs.gather(1, tok[:, None])[:, 0].double())
        d = Depth(depth, active, plan.rows[idx], tok, probs, state, logp[idx])
        codes = self.own.call(self.policy.stop, d)
        if isinstance(codes, list):  # codes decided on the host (a policy planning on host floats)
            codes = codes if self.early_exit else to_device(codes, self.device)
        elif codes.dtype == torch.bool:
            codes = go_while(codes)
        if not self.early_exit:  # masks on the device; the rows draft on to their caps
            out.apply_codes(depth, idx, active, codes, on_host=False)
            return nxt
        # where a read is no synchronisation (a CPU): skip the rows that stopped
        host = codes if isinstance(codes, list) else codes.tolist()
        out.apply_codes(depth, idx, active, host, on_host=True)
        go = {i for i, c in zip(active, host) if c == GO}
        return [i for i in nxt if i in go]

    def _extend(self, plan: StepPlan, depth: int, active, nxt, tok, logits, state):
        """One drafter forward for the rows still drafting; the next depth's logits (and states) for all rows."""
        cand, R = self.cand, len(plan.run)
        if len(nxt) == R:  # every row goes on (always so at batch 1): no gather, no scatter
            out_logits, state = cand.extend(plan.run, tok, plan.tlens, depth, state)
            return out_logits.to(logits.dtype), state
        sel = to_device(nxt, self.device)
        src = to_device([active.index(i) for i in nxt], self.device)
        out_logits, out_state = cand.extend([plan.run[i] for i in nxt], tok[src], [plan.tlens[i] for i in nxt], depth,
                                            None if state is None else state[sel])
        logits = logits.clone()
        logits[sel] = out_logits.to(logits.dtype)
        if state is not None:
            state = state.clone()
            state[sel] = out_state
        return logits, state

    # ---- the same phases for draft trees (a policy with a ``tree`` spec) ----------------------------
    def _tree_phases(self, plan: StepPlan):
        """Grow a tree per row, let the policy select what the target scores, verify the selection as tree
        rows of the step's forward and accept the longest path (greedy) or walk it losslessly (sampling).
        Returns the chain phases' outputs, the hidden states reordered along the accepted path so that
        the commit is the chain's."""
        prof = self.prof
        grown = grow_tree(self.cand, plan.run, plan.tlens, plan.gammas, self.tree, self.sampling, plan.seeds,
                          plan.steps)
        prof.mark("draft")
        chosen = self.own.call(self.policy.select, grown, plan.view)
        # a row's scored nodes must fit its context: keep the first ones (a prefix of a topological order of
        # an ancestor-closed set is closed too)
        room = to_device([max(0, self.limit - 1 - t) for t in plan.tlens], self.device)
        chosen = chosen & grown.valid & (chosen.long().cumsum(1) <= room[:, None])
        prof.mark("policy")
        counts = chosen.sum(1)
        if self.early_exit:  # where a read is no synchronisation: score only the selected nodes
            drafted = counts.tolist()
            W = max(drafted)
        else:  # the selection stays a mask: every row scores up to the policy's bound, padding masked
            # (and within every row's context: the padded width is the whole batch's)
            room_all = max(0, self.limit - 1 - max(plan.tlens))
            W = min(grown.tokens.shape[1], self.policy.tree_width(plan.view), room_all)
            drafted = [W] * len(plan.run)
        tree, index = prune(grown.tree, chosen, width=W)
        drafts = Drafts(tree.tokens, drafted, lengths=None if self.early_exit else counts)
        R = len(plan.run)  # the drafter read one token a row at depth 1, then a frontier of ``width`` a row
        drafts.depth_rows = [R] + [R * self.tree.width] * (plan.max_gamma - 1)
        ver = self._verify_tree(plan, tree, drafted)
        q = None  # sampling: the distribution each scored node was drawn from
        if grown.q is not None:
            q = grown.q.gather(1, index.clamp(min=0)[..., None].expand(*index.shape, grown.q.shape[-1]))
        acc, walk = self._accept_tree(plan, tree, ver, q)
        self.own.call(self.policy.verified, TreeOutcome(grown, index, tree, walk.path, acc.accepted, walk.tested))
        # the target's states along the accepted path, root first: what a chain's verification would give
        root = torch.zeros(walk.path.shape[0], 1, dtype=walk.path.dtype, device=self.device)
        path_rows = torch.cat([root, walk.path + 1], 1).clamp(min=0)
        hidden = ver.hidden.gather(1, path_rows[..., None].expand(*path_rows.shape, ver.hidden.shape[-1]))
        feats = None if ver.feats is None else ver.feats.gather(
            1, path_rows[..., None].expand(*path_rows.shape, ver.feats.shape[-1]))
        self._move_path(plan, walk.path, acc.accepted)
        return drafts, Verification(ver.record, ver.logits, hidden, ver.tlens, ver.prefill, feats), acc

    def _verify_tree(self, plan: StepPlan, tree: DraftTree, drafted: list[int]) -> Verification:
        """One target forward: each row scores [last token, its W selected nodes] as span rows (the tree's
        mask, nodes rotated at their depth), prompts admitted this step after them."""
        tl = plan.tl
        tokens = torch.cat([self.seq[plan.rows, tl][:, None], tree.tokens], 1)
        span = Span(plan.tlens, tree.attention_mask(), tree.positions(tl))
        batch = RaggedBatch(plan.run, plan.tlens, [d + 1 for d in drafted], self.device, span=span)
        rec = DraftRecord(tree.tokens, tree.valid.sum(1), tree.parents)
        return self._score(rec, tokens, batch, tl)

    def _accept_tree(self, plan: StepPlan, tree: DraftTree, ver: Verification, q: torch.Tensor | None):
        """The longest greedy path, or the lossless walk over sampled siblings (``q`` (R, W, V): the
        distribution each scored node was drawn from)."""
        samp = self.sampling
        if samp.greedy:
            a, path, x = verify_tree_greedy(tree, ver.logits)
            # the nodes whose parent is the root or on the accepted path: the ones the target judged
            tested = tree.valid & on_path(path).gather(1, tree.parents + 1)
        else:
            u_acc, u_fin = tree_uniforms(plan.seeds, plan.steps, tree.K)
            walk = tree_walk(tree, probs_from_logits(ver.logits, samp), q, None, u_acc)
            a, path, tested = walk.accepted, walk.path, walk.tested
            x = sample_rows(walk.residual, u_fin)
        acc = Acceptance(a, x, emitted_tokens(tree, path, a, x))
        return acc, _Walk(path, tested)

    def _move_path(self, plan: StepPlan, path: torch.Tensor, accepted: torch.Tensor) -> None:
        """The accepted path's keys and values, written at ``tlen + 1 + node``, to ``tlen + 1 + depth - 1``,
        where a chain would have put them; the rest stays past the slot's length, unseen."""
        R, W = path.shape
        j = torch.arange(W, device=self.device)[None]
        on = j < accepted[:, None]
        base = plan.tl[:, None] + 1
        src = torch.where(on, base + path, self.trash)
        dst = torch.where(on, base + j, self.trash)
        self.tcache.move(plan.rows[:, None].expand(R, W).reshape(-1), src.reshape(-1), dst.reshape(-1))

    def _verify(self, plan: StepPlan, drafts: Drafts) -> Verification:
        """One target forward: each slot scores its last token and its drafts (its own count: nothing
        padded); prompts admitted this step ride in the same forward (projections and MLPs over all tokens)."""
        dev, R = self.device, len(plan.run)
        T = max(drafts.drafted) + 1
        K = T - 1
        lengths = drafts.lengths if drafts.lengths is not None else to_device(drafts.drafted, dev)
        rec = DraftRecord(drafts.tokens[:, :K], lengths,
                          torch.arange(-1, K - 1, device=dev).expand(R, K),
                          drafts.probs[:, :K] if drafts.probs is not None and K else None)
        tl = plan.tl
        # a chain: each draft's parent is the one before it, so the verification input is [last, drafts]
        tokens = torch.cat([self.seq[plan.rows, tl][:, None], rec.tokens], 1)
        batch = RaggedBatch(plan.run, plan.tlens, [d + 1 for d in drafts.drafted], dev)
        return self._score(rec, tokens, batch, tl)

    def _score(self, rec: DraftRecord, tokens: torch.Tensor, batch: RaggedBatch, tl) -> Verification:
        """The target forward over ``tokens`` (R, T) laid out by ``batch``, with the admitted prompts after them
        (projections and MLPs over all tokens at once): whole ("joined"), or chunks in the room the running
        rows leave of ``max_batched_tokens`` ("chunked")."""
        T = tokens.shape[1]
        flat, prefill = batch.flat(tokens), None
        chunks = self._take_chunks(self.max_batched_tokens - batch.n if self.prefill == "chunked" else None)
        if chunks:
            ptok, pbatch = self._prefill_batch(chunks)
            h_all, f_all = self._forward(torch.cat([flat, ptok]), batch.join(pbatch))
            h, f = h_all[: batch.n], None if f_all is None else f_all[: batch.n]
            prefill = (chunks, ptok, pbatch, h_all[batch.n:], None if f_all is None else f_all[batch.n:])
        else:
            h, f = self._forward(flat, batch)
        # the LM head scores only the real tokens; acceptance reads them padded (R, T)
        return Verification(rec, batch.padded(self.tm.logits(h), T), batch.padded(h, T), tl, prefill,
                            None if f is None else batch.padded(f, T))

    def _accept(self, plan: StepPlan, drafts: Drafts, ver: Verification) -> Acceptance:
        """Greedy or speculative-sampling acceptance, batched on the device; the emitted tokens per row."""
        rec, samp = ver.record, self.sampling
        if samp.greedy:
            a, x = verify_greedy_batch(rec.tokens, rec.lengths, ver.logits)
        else:
            K = rec.tokens.shape[1]
            draws = torch.cat([ACCEPT + torch.arange(K, device=self.device), to_device([FINAL], self.device)])
            u = uniforms(plan.seeds, plan.steps, draws)
            a, x = verify_sampling_batch(rec.tokens, rec.lengths, rec.probs, probs_from_logits(ver.logits, samp),
                                         u[:, :K], u[:, -1])
        emitted = torch.cat([rec.tokens, torch.zeros_like(x)[:, None]], 1)
        emitted.scatter_(1, a[:, None], x[:, None])
        return Acceptance(a, x, emitted)

    def _commit_device(self, plan: StepPlan, ver: Verification, acc: Acceptance) -> None:
        """Bookkeeping on the device: tokens by position, the target features behind the kept tokens."""
        a, rows, tl, h = acc.accepted, plan.rows, ver.tlens, ver.hidden
        ar = torch.arange(acc.emitted.shape[1], device=self.device)[None]
        kept = ar <= a[:, None]
        self.seq[rows[:, None], torch.where(kept, tl[:, None] + 1 + ar, self.trash)] = acc.emitted
        self.last_feat[rows] = h.gather(1, a[:, None, None].expand(-1, 1, h.shape[-1]))[:, 0]
        if self.cand is not None and self.cand.needs_features:
            f = h if ver.feats is None else ver.feats
            self.feat[rows[:, None], torch.where(kept, tl[:, None] + ar, self.trash)] = f

    def _reads(self, plan: StepPlan, drafts: Drafts, acc: Acceptance, logits=None) -> dict[str, torch.Tensor]:
        """What the host reads after this step: accept counts, emitted tokens, the exact drafted counts when
        they stayed on the device, what the policy's observation needs and a planned-ahead γ (``logits``: the
        verify logits of a chain step, whose row at the accepted position the plan may read)."""
        reads = {"accepted": acc.accepted, "emitted": acc.emitted}
        if drafts.lengths is not None:
            reads["drafted"] = drafts.lengths
        for name, t in self.policy.reads().items():
            reads["policy:" + name] = t
        if self.policy.plans_ahead and self.kind is not None:
            drafted = drafts.lengths if drafts.lengths is not None else to_device(drafts.drafted, self.device)
            last = None if logits is None else logits[torch.arange(len(plan.run), device=self.device), acc.accepted]
            ahead = self._plan_ahead(plan.run, plan.slots, acc.next_token, self.last_feat[plan.rows], acc.accepted,
                                     drafted, last)
            if ahead is not None:
                reads["gamma_next"] = ahead
        return reads

    def _commit_host(self, plan: StepPlan, drafts: Drafts, host: HostRead, finished: list[int]) -> None:
        """Counters, lengths, policy feedback and emitted tokens on the host; generators roll back."""
        now = time.perf_counter()
        acc, em, gnext = host["accepted"], host["emitted"], host.get("gamma_next")
        drafted = host.get("drafted", drafts.drafted)
        caught_up = bool(drafts.depth_rows)  # the drafter read every running row's accepted tokens this step
        for i, (b, s) in enumerate(zip(plan.run, plan.slots)):
            k, d = acc[i], drafted[i]
            self._unfed[b] = (0 if caught_up else self._unfed[b]) + k + 1
            s.stats.record_step(d, k)
            s.step += 1
            s.tlen += k + 1
            if gnext:
                s.gamma_next = gnext[i]
            taken = self._emit(b, s, em[i][: k + 1], now, finished)
            s.stats.uncount_accepted(max(0, k - taken))  # kept drafts past an EOS or the budget: never emitted
        if self.cand is not None:
            self.cand.settle(plan.run, [s.tlen for s in plan.slots])
        extra = {name[7:]: v for name, v in host.items() if name.startswith("policy:")}
        self.own.call(self.policy.observe, plan.view, drafted, acc, extra)

    def _emit(self, b: int, s: Slot, toks: list[int], now: float, finished: list[int]) -> int:
        """Append accepted tokens on the host, cutting at the first EOS and at the budget; returns how many."""
        eos = self.target.eos_token_ids
        n0 = len(s.new)
        for t in toks:
            if len(s.new) >= s.max_new:
                break
            s.new.append(int(t))
            s.token_times.append(now)
            if t in eos:
                break
        stop = len(s.new) >= s.max_new or (s.new and s.new[-1] in eos) or s.tlen >= self.limit
        if stop:
            s.done = True
            s.stats.new_tokens = len(s.new)
            s.stats.wall_s = now - s.t_admit
            finished.append(b)
        return len(s.new) - n0

    # ---- whole batches --------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: int = 128, seeds=None) -> list[GenerationOutput]:
        """Decode ``prompts`` (at most ``slots``) to the end; outputs in prompt order."""
        if len(prompts) == 0:
            raise ValueError("batch size 0: give at least one prompt")
        if len(prompts) > self.slots:
            raise ValueError(f"{len(prompts)} prompts but the engine has {self.slots} slots")
        seeds = list(range(len(prompts))) if seeds is None else list(seeds)
        for b, p in enumerate(prompts):
            self.admit(b, p, max_new_tokens, seeds[b], request=b)
        while self.busy():
            self.step()
        return [GenerationOutput(self.state[b].new, self.state[b].stats) for b in range(len(prompts))]


# ---- one sequence at a time: the same engine with one slot ------------------------------------------------


def _stream_seed(seed, device) -> int:
    """The slot's random-stream seed: an int as it is; a ``torch.Generator`` (one stream over several
    generations: the turns of a conversation) draws it, so every call continues that stream; None draws it
    from torch's global generator."""
    if isinstance(seed, torch.Generator):
        return int(torch.randint(0, 2**62, (), generator=seed, device=seed.device))
    if seed is None:
        return int(torch.randint(0, 2**62, ()))
    return int(seed)


# profiled components -> the per-generation clocks of GenerationStats
_CLOCKS = {"draft": "draft_s", "verify": "target_s", "prefill": "target_s", "read": "target_s",
           "host": "target_s"}


class SpeculativeDecoder:
    """Speculative decoding of one sequence at a time: a one-slot :class:`BatchedSpeculativeEngine`, built once
    per sampling setting and reused (its caches are preallocated).

    ``profile``: run the engine in profiled mode and fill the per-component clocks of the stats (``draft_s``,
    ``target_s``, ``policy_s``; CUDA events on a GPU, one synchronisation a step). Off by default: the timed
    loop marks nothing (on this CPU the marks cost about 1% of a step at γ = 4)."""

    def __init__(self, target: TargetModel, candidates: CandidateGenerator | None, policy: DraftPolicy | None = None,
                 attn: str | None = None, profile: bool = False, capacity: int | None = None):
        self.target, self.candidates = target, candidates
        self.policy = policy if policy is not None else StaticPolicy(4)
        self.attn, self.capacity = attn, capacity
        self.profile = profile
        self._engines: dict[SamplingConfig, BatchedSpeculativeEngine] = {}
        self.engine(SamplingConfig())  # checks the pair and the policy now, not mid-run

    def engine(self, sampling: SamplingConfig) -> BatchedSpeculativeEngine:
        if sampling not in self._engines:
            self._engines[sampling] = BatchedSpeculativeEngine(
                self.target, self.candidates, slots=1, policy=lambda: self.policy, sampling=sampling,
                capacity=self.capacity,
                attn=self.attn, profile=self.profile)
        return self._engines[sampling]

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int = 128, sampling: SamplingConfig = SamplingConfig(),
                 seed: int | torch.Generator | None = None) -> GenerationOutput:
        eng = self.engine(sampling)
        eng.prof.s = {}
        eng.admit(0, prompt_ids, max_new_tokens, _stream_seed(seed, self.target.device))  # checks both
        own = eng.policy_s  # from here: the policy's begin() runs before the clock starts
        while eng.busy():
            eng.step()
        s = eng.state[0]
        for name, secs in eng.prof.s.items():
            attr = _CLOCKS.get(name)
            if attr:
                setattr(s.stats, attr, getattr(s.stats, attr) + secs)
        s.stats.policy_s = eng.policy_s - own  # the policy's own calls, timed in every mode
        return GenerationOutput(s.new, s.stats)


_AR_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> its one-slot AR engines


def autoregressive_generate(target: TargetModel, prompt_ids, max_new_tokens: int = 128,
                            sampling: SamplingConfig = SamplingConfig(), seed: int | torch.Generator | None = None,
                            attn: str | None = None) -> GenerationOutput:
    """Plain decoding of one sequence: the one-slot engine without drafts (kept per target and setting)."""
    engines = _AR_ENGINES.setdefault(target, {})
    if (sampling, attn) not in engines:
        engines[(sampling, attn)] = SpeculativeDecoder(target, None, StaticPolicy(0), attn=attn)
    out = engines[(sampling, attn)].generate(prompt_ids, max_new_tokens, sampling, seed)
    out.stats.target_s = out.stats.wall_s
    return out
