"""The speculative engine: S slots decode at once, each with its own prompt, position, γ and budget.
Batch 1 is the same engine with one slot (:mod:`eagle_backbone.decoder`: :class:`SpeculativeDecoder`,
:func:`autoregressive_generate`).

A step runs in named phases over the running slots (:meth:`BatchedSpeculativeEngine._spec_step`), each a
method with typed inputs and outputs (:mod:`eagle_backbone.step_records`):

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
   (:class:`~eagle_backbone.ragged.RaggedBatch`): slot b brings its last token and its drafts, nothing
   padded; γ_b = 0 is a plain decoding step. Each slot attends over its own cache in place.
4. **accept** (:class:`Acceptance`): greedy or speculative-sampling acceptance, batched on the device,
   bounded by each row's drafted count.
5. **commit**: bookkeeping on the device, then the step's one host read (:class:`HostRead`: accept counts,
   emitted tokens, drafted counts kept on the device, a planned-ahead γ, what the policy's observation
   needs, the first tokens of prompts admitted this step), then budgets, EOS, counters and the policy's
   ``observe`` on the host. Rollback is setting lengths: the target keeps the accepted prefix, the
   generator what it needs. Finished slots are free for the next prompt.

**Prefill scheduling** (``prefill``: "chunked", the default, "joined" or "separate"): when and beside what
the admitted prompts are read, in :mod:`eagle_backbone.prefill`. **Draft trees** (a policy with a ``tree``
spec): the draft, verify and accept phases for trees, in :mod:`eagle_backbone.tree_step`.

Bookkeeping writes past a slot's length go to a trash position (the last of the buffers) that no real
query can see. Greedy output equals each sequence's own greedy decoding by the target
(:meth:`~eagle_backbone.target.TargetModel.reference_greedy`; float32 bit for bit, and bfloat16 with
eager attention on the embedded pair); sampled output has the target's distribution, with a random stream
per sequence.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from eagle_backbone.candidates import CandidateGenerator
from eagle_backbone.drafter_kinds import make_candidates
from eagle_backbone.llama import BatchedLlama
from eagle_backbone.policy import (GO, Depth, DraftPolicy, EngineView, OwnTime, Rows, StaticPolicy, TreePolicy, as_draft_policy,
                                   go_while)
from eagle_backbone.prefill import MAX_BATCHED_TOKENS, MAX_DRAFT, PREFILL_DEFAULT, PrefillScheduling, check_prefill
from eagle_backbone.ragged import RaggedBatch
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
from eagle_backbone.step_records import (
    Acceptance,
    DraftRecord,
    Drafts,
    GenerationOutput,
    HostRead,
    Slot,
    StepPlan,
    Verification,
    check_prompt,
)
from eagle_backbone.target import TargetModel
from eagle_backbone.timing import ComponentProfile, StepClock
from eagle_backbone.tree_draft import TreeSpec
from eagle_backbone.tree_step import TreePhases


STEP_LOG = 100_000  # the most step records an engine keeps (the newest): a long-lived engine's log stays bounded


def default_attn(target: TargetModel) -> str:
    """The attention math the target was loaded with (eager or sdpa; any other kernel runs as sdpa)."""
    impl = getattr(target.model.config, "_attn_implementation", None)
    return impl if impl in ("eager", "sdpa") else "sdpa"


class BatchedSpeculativeEngine(PrefillScheduling, TreePhases):
    """``slots`` sequences at once over ``target`` and an optional candidate generator.

    ``candidates``: a :class:`~eagle_backbone.candidates.CandidateGenerator` (the engine binds its own copy),
    or a drafter model with its ``kind`` (a registered drafter kind, :mod:`eagle_backbone.drafter_kinds`); None
    decodes without drafts.

    ``policy``: a :class:`~eagle_backbone.policy.DraftPolicy` (one instance for every slot) or a zero-argument
    factory of one; None means γ = 0 (batched autoregressive decoding). ``capacity``: positions per slot
    (default: the target's context). ``prefill``: "chunked" (default: a step's forward scores at most
    ``max_batched_tokens`` tokens, default :data:`MAX_BATCHED_TOKENS`: the running rows' first, then chunks of
    the prompts being read in the room left), "joined" (new prompts ride whole in the step's target forward as
    more rows of its ragged batch) or "separate" (their own target forward before the step);
    :mod:`eagle_backbone.prefill` has the schedule, docs/batched.md#chunked-prefill the measurement that chose it.
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
                 attn: str | None = None, prefill: str = PREFILL_DEFAULT, profile: bool = False,
                 max_draft: int = MAX_DRAFT, early_exit: bool | None = None, cost_model=None, record_steps: bool = True,
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
        self._clock = StepClock(self.device)
        # when the last decode step's clock stopped (None after a prefill-only or idle step): a goodput-measuring
        # policy is charged the engine's work between two decode steps too (_record)
        self._gap_from: float | None = None
        self._unfed = [0] * slots  # tokens accepted per slot since the drafter's last catch-up forward
        self.tm = BatchedLlama(target.model, buf, attn)
        self.tcache = self.tm.new_cache(slots)
        self.eos = to_device(sorted(target.eos_token_ids) or [-1], self.device)
        self.seq = torch.zeros(slots, buf, dtype=torch.long, device=self.device)  # tokens by position
        self.last_feat = torch.zeros(slots, target.hidden_size, dtype=target.dtype, device=self.device)
        # the target layers whose states the generator reads (EAGLE-3); () : the last hidden state (EAGLE-1)
        self.feature_layers = tuple(candidates.feature_layers) if candidates is not None else ()
        if candidates is not None and candidates.needs_features:
            self.feat = torch.zeros(slots, buf, candidates.feature_width(target.hidden_size), dtype=target.dtype, device=self.device)
        self.policy: DraftPolicy = StaticPolicy(0) if policy is None else as_draft_policy(policy)
        # a tree policy makes every step grow and verify draft trees (eagle_backbone/tree_draft.py)
        self.tree: TreeSpec | None = (self.policy.tree if isinstance(self.policy, TreePolicy) and candidates is not None
                                      else None)
        self.tree_room = self.tree.fed if self.tree is not None else 0  # generator positions a tree feeds
        self.cand = candidates.bound(self) if candidates is not None else None
        self.early_exit = self.device.type != "cuda" if early_exit is None else bool(early_exit)
        # its costs, its models' sizes against the pair: now, not mid-run
        self.policy.bind(EngineView(target, candidates, self.sampling, self.device, attn, self.early_exit,
                                    self.attach_costs, self._record_costs))
        self.own = OwnTime()  # the policy's own seconds (plan, stop, observe)
        self._timed = type(self.policy).timed is not DraftPolicy.timed  # it measures its steps (goodput feedback)
        # the plan's host-to-device copy goes through one pinned staging buffer on a GPU: reusing it each step
        # is safe because the previous step's copy finished before that step's host read returned
        self._stage = (torch.empty(4 * slots, dtype=torch.long, pin_memory=True) if self.device.type == "cuda"
                       else None)
        self.state: list[Slot | None] = [None] * slots
        self._admitted: list[int] = []  # slots whose prompt the target has not read to its end, oldest first
        self.prof = ComponentProfile(self.device, profile)
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

    def _record_costs(self, model) -> None:
        """A frozen step-cost model a policy plans with: the one whose predictions the step log records, when the
        engine was given none."""
        if self.cost_model is None:
            self.cost_model = model

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

    def _forward(self, tokens, batch: RaggedBatch):
        """The target forward: final-normed hidden states (N, d) and, when the generator reads
        ``feature_layers`` (EAGLE-3), the states entering them concatenated (N, k·d); else None."""
        if not self.feature_layers:
            return self.tm(tokens, batch, self.tcache), None
        h, aux = self.tm(tokens, batch, self.tcache, hidden_layers=self.feature_layers)
        return h, torch.cat(aux, -1)

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
            self._gap_from = None  # a prompt's own step (or an idle wait before it) is no decode step's cost
            return finished
        if not run:
            prof.flush()
            self._gap_from = None
            return finished
        self._spec_step(run, finished)
        prof.flush()
        self.steps += 1
        return finished

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
        gap_from, self._gap_from = self._gap_from, self._clock.stopped
        model, predicted, predicted_cpu = self.cost_model, None, None
        if model is not None:
            predicted_cpu = model.predict_cpu(shape) if model.version and cpu_ms is not None else None
            predicted = self.own.call(model.observe, shape, ms, cpu_ms)
        if self._timed:  # what the step took from throughput: its clock, and the engine's work since the last one
            gap = 1e3 * max(0.0, self._clock.started - gap_from) if gap_from is not None else 0.0
            self.own.call(self.policy.timed, ms + gap, shape)
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
