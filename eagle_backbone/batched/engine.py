"""The batched speculative engine: S slots decode at once, each with its own prompt, position, γ and budget.

One step, for the running slots:

1. γ per slot: a vectorised policy (static, LDLP) gives all at once (the LDLP's γ for the next step is
   computed right after verification and read with the accept counts); any other policy is asked per
   slot with its own :class:`~eagle_backbone.policy.DraftContext`.
2. Drafting: one drafter forward feeds each slot's pending true pairs (EAGLE: the accepted tokens with
   the target's features; draft LM: the accepted tokens), then one forward per depth for the slots still
   drafting. A slot stops at its γ or when its policy's ``keep_drafting`` says so.
3. One target forward verifies every slot: slot b contributes its last token and its γ_b drafts, padded
   to the step's longest; γ_b = 0 is a plain decoding step. Greedy or speculative-sampling verification
   runs batched on the device.
4. Rollback is setting lengths: the target keeps the accepted prefix, EAGLE's drafter keeps only pairs
   built from true features (the ones just fed), the draft LM keeps the tokens that were accepted.
5. One host read per step: accept counts, emitted tokens (and the LDLP's next γ, and the first tokens of
   prompts admitted this step) in one packed tensor. Budgets and EOS are then checked on the host;
   finished slots are free for the next prompt.

A prompt admitted while other slots run is prefilled inside the step's target forward (projections and
MLPs packed over both groups' tokens, attention per group): measured cheaper than its own forward
(``prefill_join_cost`` in bench.py). The drafter's prefill needs the first token, so it is a forward of
its own right after. Policies that read drafts (``keep_drafting``) decide on the host, one read per
draft depth: that cost is theirs, and vectorised policies do not pay it.

Positions past a slot's length are scratch: padded queries write to a trash position (the last of the
buffers) that no real query can see. Greedy output equals each sequence's own autoregressive output
(float32 bit for bit); sampled output has the target's distribution, with a random stream per sequence.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from eagle_backbone.batched.model import (
    BatchedEagleDrafter,
    BatchedLlama,
    forward_groups,
    unpack,
)
from eagle_backbone.batched.sampling import (
    ACCEPT,
    DRAFT,
    FINAL,
    sample_rows,
    uniforms,
    verify_greedy_batch,
    verify_sampling_batch,
)
from eagle_backbone.engine import GenerationOutput, check_prompt
from eagle_backbone.metrics import GenerationStats
from eagle_backbone.policy import BatchDraftPolicy, DraftContext, DraftLengthPolicy, StaticPolicy
from eagle_backbone.sampling import SamplingConfig, probs_from_logits
from eagle_backbone.target import TargetModel


@dataclass
class DraftRecord:
    """One step's drafts for R rows. ``parents[r, i]`` is the index of draft i's parent in this record,
    -1 for the slot's last accepted token: a chain is i-1; a tree later sets other parents (and a tree
    mask) without changing the record's shape."""

    tokens: torch.Tensor  # (R, K) drafted tokens (0 past a row's length)
    lengths: torch.Tensor  # (R,) drafts per row (device)
    parents: torch.Tensor  # (R, K)
    probs: torch.Tensor | None = None  # (R, K, V) drafter distributions (sampling only)


def _overrides(policy, name: str) -> bool:
    return getattr(type(policy), name) is not getattr(DraftLengthPolicy, name)


class VectorisedGamma:
    """γ for many slots in one call, where a policy allows it: static γ (a constant) and the LDLP (one
    predictor forward for all slots). A policy may also offer ``gamma_batch(embeddings, features)``."""

    def __init__(self, fn: Callable | None, constant: int | None = None):
        self.fn, self.constant = fn, constant

    @staticmethod
    def of(policy: DraftLengthPolicy) -> VectorisedGamma | None:
        if isinstance(policy, BatchDraftPolicy):
            return None
        if any(_overrides(policy, h) for h in ("keep_drafting", "observe")):
            return None
        if hasattr(policy, "gamma_batch"):
            return VectorisedGamma(policy.gamma_batch)
        if isinstance(policy, StaticPolicy) and type(policy).gamma is StaticPolicy.gamma:
            return VectorisedGamma(None, policy.fixed_gamma)
        if getattr(policy, "name", None) == "ldlp" and hasattr(policy, "model") and hasattr(policy, "offset"):
            model, offset, cap = policy.model, int(policy.offset), policy.max_gamma

            def ldlp(embeddings, features):
                n = model.predict_length(embeddings.float(), features.float()).to(torch.long) + offset
                n = n.clamp_min(0)
                return n if cap is None else n.clamp_max(cap)

            return VectorisedGamma(ldlp)
        return None


@dataclass
class Slot:
    """Host-side state of one sequence in a slot."""

    prompt: list[int]
    max_new: int
    seed: int
    policy: DraftLengthPolicy
    request: object = None  # the caller's handle (e.g. a prompt index)
    new: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    step: int = 0  # decoding steps done (prefill = step 0)
    tlen: int = 0  # target positions cached; the last token sits at position tlen
    dlen: int = 0  # drafter positions cached
    gamma_next: int | None = None  # from the vectorised policy, read with the accept counts
    done: bool = False
    t_admit: float = 0.0
    token_times: list[float] = field(default_factory=list)


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


class BatchedSpeculativeEngine:
    """``slots`` sequences at once over ``target`` and an optional drafter (``kind`` eagle | draft_lm).

    ``policy``: a :class:`DraftLengthPolicy` copied per slot (``copy.deepcopy``) or a zero-argument factory;
    None means γ = 0 (batched autoregressive decoding). ``capacity``: positions per slot (default: the
    target's context). ``prefill``: "joined" (default: new prompts ride in the step's target forward, the
    projections and MLPs packed over all tokens, attention per group; 8-30% cheaper than a forward of
    their own on the embedded target, see ``prefill_join_cost`` in eagle_backbone/batched/bench.py) or
    "separate" (their own target forward before the step).
    """

    def __init__(self, target: TargetModel, drafter=None, kind: str | None = None, slots: int = 8,
                 policy=None, sampling: SamplingConfig | None = None, capacity: int | None = None,
                 attn: str = "eager", prefill: str = "joined", profile: bool = False, max_draft: int = 32):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"batch size (slots) must be an integer >= 1, got {slots!r}")
        if drafter is not None and kind not in ("eagle", "draft_lm"):
            raise ValueError(f"kind must be 'eagle' or 'draft_lm' with a drafter, got {kind!r}")
        if prefill not in ("separate", "joined"):
            raise ValueError(f"prefill must be 'separate' or 'joined', got {prefill!r}")
        self.target, self.kind, self.slots = target, kind if drafter is not None else None, slots
        self.drafter, self.attn = drafter, attn  # as given (a batch policy builds engines like this one to profile)
        self.sampling = sampling or SamplingConfig()  # greedy by default
        self.limit = min(target.max_length, capacity or target.max_length)  # positions a sequence may use
        self.trash = self.limit  # padded positions write here; no real query (position < limit) sees it
        buf = self.limit + 1
        self.device, self.prefill, self.max_draft = target.device, prefill, max_draft
        self.tm = BatchedLlama(target.model, buf, attn)
        self.tcache = self.tm.new_cache(slots)
        self.eos = torch.tensor(sorted(target.eos_token_ids) or [-1], device=self.device)
        self.seq = torch.zeros(slots, buf, dtype=torch.long, device=self.device)  # tokens by position
        self.last_feat = torch.zeros(slots, target.hidden_size, dtype=target.dtype, device=self.device)
        if self.kind == "eagle":
            from eagle_backbone.candidates import EagleCandidateGenerator

            EagleCandidateGenerator(drafter, target)  # the same compatibility checks (and embedding tie)
            self.dm = BatchedEagleDrafter(drafter, target.lm_head, buf, attn)
            self.feat = torch.zeros(slots, buf, target.hidden_size, dtype=target.dtype, device=self.device)
            self.h_last = torch.zeros(slots, target.hidden_size, dtype=self.dm.dtype, device=self.device)
        elif self.kind == "draft_lm":
            vocab = drafter.get_output_embeddings().weight.shape[0]
            if vocab != target.vocab_size:
                raise ValueError(f"draft model vocabulary {vocab} != target vocabulary {target.vocab_size}")
            self.dm = BatchedLlama(drafter.eval(), buf, attn)
            self.logits_last = torch.zeros(slots, vocab, dtype=self.dm.dtype, device=self.device)
        if self.kind is not None:
            self.dcache = self.dm.new_cache(slots)
        self.batch_policy: BatchDraftPolicy | None = None
        if policy is None:
            self._make_policy = lambda: StaticPolicy(0)
        elif callable(policy) and not isinstance(policy, DraftLengthPolicy):
            first = policy()
            if isinstance(first, BatchDraftPolicy):
                self.batch_policy = first  # one instance decides for the whole batch
            self._make_policy = policy
        elif isinstance(policy, BatchDraftPolicy):
            self.batch_policy = policy
        else:
            self._make_policy = lambda: copy.deepcopy(policy)
        if self.batch_policy is not None:
            shared = self.batch_policy
            self._make_policy = lambda: shared
            shared.bind_engine(self)
        self.state: list[Slot | None] = [None] * slots
        self._admitted: list[int] = []
        self.prof = _Profile(self.device, profile)
        self.steps = 0

    # ---- admission ------------------------------------------------------------------------------
    def free_slots(self) -> list[int]:
        return [b for b, s in enumerate(self.state) if s is None or s.done]

    def admit(self, slot: int, prompt_ids, max_new_tokens: int, seed: int = 0, request=None) -> None:
        """Put a new sequence into a free ``slot``; it is prefilled at the next :meth:`step`."""
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
        policy = self._make_policy()
        policy.begin(ids)
        s = Slot(ids, max_new_tokens, int(seed), policy, request, t_admit=time.perf_counter())
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
    def _rows(self, slots: list[int]):
        """An index tensor for a row subset, or None when the rows are all slots in order (views, no gather)."""
        if slots == list(range(self.slots)):
            return None
        return torch.tensor(slots, device=self.device)

    def _vectorised(self, s: Slot):
        if not hasattr(s, "_vec"):
            s._vec = VectorisedGamma.of(s.policy)
        return s._vec

    def _pick(self, logits, seeds, steps, draw: int, need_probs: bool):
        """Token per row from (R, V) logits: argmax (greedy; softmax only if asked) or a draw of its stream."""
        if self.sampling.greedy:
            tok = logits.argmax(-1)
            return tok, (probs_from_logits(logits, self.sampling) if need_probs else None)
        probs = probs_from_logits(logits, self.sampling)
        u = uniforms(seeds, steps, torch.tensor([draw], device=self.device))[:, 0]
        return sample_rows(probs, u), probs

    # ---- prefill --------------------------------------------------------------------------------
    def _prefill_inputs(self, slots: list[int]):
        """The new prompts as a padded group: (tokens, positions, rows, kv_len) and their lengths."""
        n = [len(self.state[b].prompt) for b in slots]
        T = max(n)
        tok = torch.zeros(len(slots), T, dtype=torch.long)
        for i, b in enumerate(slots):
            tok[i, : n[i]] = torch.tensor(self.state[b].prompt)
        tok = tok.to(self.device)
        nt = torch.tensor(n, device=self.device)
        ar = torch.arange(T, device=self.device)[None]
        pos = torch.where(ar < nt[:, None], ar, self.trash)
        return (tok, pos, self._rows(slots), T), nt

    def _prefill(self, slots: list[int]) -> torch.Tensor:
        """Target and drafter prefill of new prompts in their own forwards; returns their first tokens."""
        group, nt = self._prefill_inputs(slots)
        return self._prefill_finish(slots, group, nt, self.tm(*group[:2], self.tcache, group[3], group[2]))

    def _prefill_finish(self, slots: list[int], group, nt, h) -> torch.Tensor:
        """After the target read the prompts (``h``: their hidden states): first tokens, bookkeeping, and
        the drafter's own prefill (it needs the first token, so it cannot ride in the target's forward)."""
        st = [self.state[b] for b in slots]
        n = [len(s.prompt) for s in st]
        tok, pos, rows, T = group
        dev = self.device
        last = h.gather(1, (nt - 1)[:, None, None].expand(-1, 1, h.shape[-1]))[:, 0]
        seeds = torch.tensor([s.seed for s in st], device=dev)
        steps = torch.zeros(len(slots), dtype=torch.long, device=dev)
        x, _ = self._pick(self.tm.logits(last), seeds, steps, FINAL, False)
        ridx = torch.tensor(slots, device=dev)
        self.seq[ridx[:, None], pos] = tok
        self.seq[ridx, nt] = x
        self.last_feat[ridx] = last
        if self.kind == "eagle":
            self.feat[ridx[:, None], pos] = h
            # pairs (t_{j+1}, f_j), j < n: the tokens shifted by one, the first token closing the prompt
            nxt = torch.cat([tok[:, 1:], torch.zeros_like(tok[:, :1])], 1)
            nxt[torch.arange(len(slots), device=dev), nt - 1] = x
            out = self.dm(nxt, h, pos, self.dcache, T, rows)
            self.h_last[ridx] = out.gather(1, (nt - 1)[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]
        elif self.kind == "draft_lm":
            # the draft LM reads the prompt and the first token: its logits there predict draft 1
            ids = torch.cat([tok, torch.zeros_like(tok[:, :1])], 1)
            ids[torch.arange(len(slots), device=dev), nt] = x
            ar1 = torch.arange(T + 1, device=dev)[None]
            hd = self.dm(ids, torch.where(ar1 <= nt[:, None], ar1, self.trash), self.dcache, T + 1, rows)
            self.logits_last[ridx] = self.dm.logits(hd.gather(1, nt[:, None, None].expand(-1, 1, hd.shape[-1]))[:, 0])
        for s, k in zip(st, n):
            s.tlen = k
            s.dlen = k if self.kind == "eagle" else (k + 1 if self.kind == "draft_lm" else 0)
            s.stats.target_forwards += 1
        return x

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[int]:
        """Prefill newly admitted slots, then one speculative step for all running slots. Returns the
        slots whose sequence finished."""
        finished: list[int] = []
        prof = self.prof
        prof.start()
        new = self._admitted
        self._admitted = []
        run = [b for b in self.running() if b not in new]
        if new and (self.prefill == "separate" or not run):
            self._first_tokens(new, self._prefill(new), finished)
            prof.mark("prefill")
            new, run = [], self.running()
        if not run:
            prof.flush()
            return finished
        self._spec_step(run, new, finished)
        prof.flush()
        self.steps += 1
        return finished

    def _first_tokens(self, slots, x, finished):
        firsts = x.tolist() if isinstance(x, torch.Tensor) else x  # a separate prefill's own host read
        now = time.perf_counter()
        for b, t in zip(slots, firsts):
            s = self.state[b]
            self._emit(b, s, [t], now, finished)
            if not s.done:
                self._gamma_after_prefill(b)

    def _gamma_after_prefill(self, b: int):
        s = self.state[b]
        vec = self._vectorised(s)
        if vec is not None and vec.fn is not None:
            emb = self.target.embed(self.seq[b, s.tlen][None])
            s.gamma_next = int(vec.fn(emb, self.last_feat[b][None])[0])

    def _context(self, b: int, s: Slot, max_gamma: int) -> DraftContext:
        return DraftContext(step=s.step, last_token=int(s.new[-1]), feature=self.last_feat[b],
                            accepted_history=s.stats.accept_lengths, drafted_history=s.stats.draft_lengths,
                            position=len(s.new), max_gamma=max_gamma, _embed=self.target.embed)

    def _spec_step(self, run: list[int], joined: list[int], finished: list[int]):
        prof, dev, samp = self.prof, self.device, self.sampling
        st = [self.state[b] for b in run]
        R = len(run)
        # 1. γ per slot (host ints; no device read for static or vectorised policies)
        gammas, ctxs = [], []
        bp = self.batch_policy
        caps = [max(0, min(s.max_new - len(s.new) - 1, self.limit - 1 - s.tlen, self.max_draft)) for s in st]
        planned = bp.plan(caps if self.kind is not None else [0] * R) if bp is not None else None
        for i, (b, s) in enumerate(zip(run, st)):
            max_gamma = caps[i]
            vec = self._vectorised(s)
            ctx = None
            if planned is not None:
                g = planned[i]
            elif vec is not None and vec.constant is not None:
                g = vec.constant
            elif vec is not None and s.gamma_next is not None:
                g = s.gamma_next
            else:
                ctx = self._context(b, s, max_gamma)
                g = s.policy.gamma(ctx)
            if not isinstance(g, int) or isinstance(g, bool) or g < 0:
                raise ValueError(f"policy {getattr(s.policy, 'name', s.policy)!r} returned gamma={g!r} for slot {b}; "
                                 "it must be an integer >= 0")
            gammas.append(min(g, max_gamma) if self.kind is not None else 0)
            ctxs.append(ctx)
        prof.mark("policy")

        # 2. drafting
        G = max(gammas) if gammas else 0
        draft = torch.zeros(R, G, dtype=torch.long, device=dev)
        qprobs = torch.zeros(R, G, self.target.vocab_size, device=dev) if G and not samp.greedy else None
        drafted = [0] * R
        rows_t = torch.tensor(run, device=dev)
        if G:
            drafted = self._draft(run, st, gammas, ctxs, draft, qprobs)
        prof.mark("draft")

        # 3. verification: slot b scores its last token and its drafts, padded to the longest
        T = max(drafted) + 1
        ar = torch.arange(T, device=dev)[None]
        tl = torch.tensor([s.tlen for s in st], device=dev)
        nd = torch.tensor(drafted, device=dev)
        K = T - 1
        rec = DraftRecord(draft[:, :K], nd, torch.arange(-1, K - 1, device=dev).expand(R, K),
                          qprobs[:, :K] if qprobs is not None and K else None)
        # a chain: each draft's parent is the one before it, so the verification input is [last, drafts]
        tokens = torch.cat([self.seq[rows_t, tl][:, None], rec.tokens], 1)
        pos = torch.where(ar <= nd[:, None], tl[:, None] + ar, self.trash)
        kv_len = max(s.tlen + d + 1 for s, d in zip(st, drafted))
        if joined:
            # the new prompts ride in this forward: projections and MLPs over all tokens at once
            group, nt = self._prefill_inputs(joined)
            h, hp = forward_groups(self.tm, [(tokens, pos, self._rows(run), kv_len), group], self.tcache)
            logits = self.tm.logits(h)
        elif sum(drafted) + R < R * T:
            # ragged: the projections, MLPs and LM head score only the real tokens (a slot's γ costs the
            # batch its own tokens, not the longest row's)
            packed = torch.tensor([i * T + j for i, d in enumerate(drafted) for j in range(d + 1)], device=dev)
            h = self.tm(tokens, pos, self.tcache, kv_len, self._rows(run), packed=packed)
            logits = unpack(self.tm.logits(h.reshape(R * T, -1).index_select(0, packed)), packed, R, T)
        else:
            h = self.tm(tokens, pos, self.tcache, kv_len, self._rows(run))
            logits = self.tm.logits(h)
        seeds = torch.tensor([s.seed for s in st], device=dev)
        steps = torch.tensor([s.step + 1 for s in st], device=dev)
        if samp.greedy:
            a, x = verify_greedy_batch(rec.tokens, rec.lengths, logits)
        else:
            p = probs_from_logits(logits, samp)
            u = uniforms(seeds, steps, torch.cat([ACCEPT + torch.arange(T - 1, device=dev),
                                                  torch.tensor([FINAL], device=dev)]))
            a, x = verify_sampling_batch(rec.tokens, rec.lengths, rec.probs, p,
                                         u[:, : T - 1], u[:, -1])
        emitted = torch.cat([rec.tokens, torch.zeros_like(x)[:, None]], 1)
        emitted.scatter_(1, a[:, None], x[:, None])
        # bookkeeping on the device: tokens by position, the target feature behind the new last token
        wpos = torch.where(ar <= a[:, None], tl[:, None] + 1 + ar, self.trash)
        self.seq[rows_t[:, None], wpos] = emitted
        self.last_feat[rows_t] = h.gather(1, a[:, None, None].expand(-1, 1, h.shape[-1]))[:, 0]
        if self.kind == "eagle":
            self.feat[rows_t[:, None], torch.where(ar <= a[:, None], tl[:, None] + ar, self.trash)] = h
        packed = [a, emitted.flatten()]
        vec_rows = [i for i, s in enumerate(st) if (v := self._vectorised(s)) is not None and v.fn is not None]
        if vec_rows:
            # the LDLP's γ for the next step, from the new last token and its feature: read with the counts
            fn = self._vectorised(st[vec_rows[0]]).fn
            emb = self.target.embed(x)
            packed.append(fn(emb, self.last_feat[rows_t]).to(torch.long))
        prof.mark("verify")
        if joined:
            packed.append(self._prefill_finish(joined, group, nt, hp))  # the new prompts' first tokens
            prof.mark("prefill")
        host = torch.cat(packed).tolist()  # the step's one host read
        now = time.perf_counter()
        prof.mark("read")
        acc, em = host[:R], host[R: R + R * T]
        gnext = host[R + R * T: R + R * T + (R if vec_rows else 0)]
        firsts = host[len(host) - len(joined):] if joined else []
        for i, (b, s) in enumerate(zip(run, st)):
            k = acc[i]
            s.stats.target_forwards += 1
            s.stats.drafted_tokens += drafted[i]
            s.stats.accepted_tokens += k
            s.stats.draft_lengths.append(drafted[i])
            s.stats.accept_lengths.append(k)
            s.step += 1
            s.tlen += k + 1
            if self.kind == "draft_lm":
                s.dlen = min(s.dlen, s.tlen)
            if gnext:
                s.gamma_next = gnext[i]
            if bp is None and _overrides(s.policy, "observe"):
                ctx = ctxs[i] or self._context(b, s, 0)
                s.policy.observe(ctx, drafted[i], k)
            taken = self._emit(b, s, em[i * T: i * T + k + 1], now, finished)
            cut = max(0, k - taken)  # kept drafts past an EOS or the budget are never emitted: waste
            if cut:
                s.stats.accepted_tokens -= cut
                s.stats.accept_lengths[-1] -= cut
        if bp is not None:
            bp.observe_rows(drafted, acc)
        if joined:
            self._first_tokens(joined, firsts, finished)
        prof.mark("host")

    def _draft(self, run, st, gammas, ctxs, draft, qprobs) -> list[int]:
        """Fill ``draft`` (R, G); returns the drafted count per row."""
        dev = self.device
        R, G = draft.shape
        rows_t = torch.tensor(run, device=dev)
        # feed every running slot's pending true pairs/tokens (also γ=0 slots: the forward runs anyway)
        pend = [(i, b, s) for i, (b, s) in enumerate(zip(run, st)) if s.dlen < s.tlen + (self.kind == "draft_lm")]
        if pend:
            self._feed([b for _, b, _ in pend], [s for _, _, s in pend])
        seeds = torch.tensor([s.seed for s in st], device=dev)
        steps = torch.tensor([s.step + 1 for s in st], device=dev)
        tl = torch.tensor([s.tlen for s in st], device=dev)
        bp = self.batch_policy
        keepers = [bp is None and _overrides(s.policy, "keep_drafting") for s in st]
        reads = bp is not None and bp.reads_drafts
        need_probs = any(keepers) or reads
        drafted = [0] * R
        active = [i for i in range(R) if gammas[i] > 0]
        eagle = self.kind == "eagle"
        state = self.h_last[rows_t] if eagle else None
        logits = self.dm.logits(state) if eagle else self.logits_last[rows_t]
        for depth in range(1, G + 1):
            idx = torch.tensor(active, device=dev)
            tok, probs = self._pick(logits if len(active) == R else logits[idx], seeds[idx], steps[idx],
                                    DRAFT + depth - 1, need_probs)
            draft[idx, depth - 1] = tok
            if qprobs is not None:
                qprobs[idx, depth - 1] = probs
            for i in active:
                drafted[i] = depth
            nxt = [i for i in active if gammas[i] > depth]
            if reads:
                # the batch policy keeps or drops this depth's drafts and picks the rows that go on
                codes = bp.keep_rows(depth, active, state[idx] if eagle else None, probs)
                for i, c in zip(active, codes):
                    if c == 0:
                        drafted[i] = depth - 1
                nxt = [i for i, c in zip(active, codes) if c == 2 and gammas[i] > depth]
            elif need_probs and bp is None:
                toks = tok.tolist()  # policies that read drafts decide on the host (their own cost)
                cont = set(nxt)
                for j, i in enumerate(active):
                    if keepers[i] and i in cont:
                        ctx = ctxs[i] or self._context(run[i], st[i], gammas[i])
                        ctxs[i] = ctx
                        ctx.draft_state = state[i] if eagle else None
                        if not st[i].policy.keep_drafting(ctx, depth, toks[j], probs[j]):
                            cont.discard(i)
                nxt = [i for i in nxt if i in cont]
            if not nxt:
                break
            # one drafter forward for the rows still drafting, at each row's next position
            sel = torch.tensor(nxt, device=dev)
            src = torch.tensor([active.index(i) for i in nxt], device=dev)
            t_in = tok[src][:, None]
            p_in = (tl[sel] + depth - (1 if eagle else 0))[:, None]
            kv_len = max(st[i].tlen + depth + (0 if eagle else 1) for i in nxt)
            r = self._rows([run[i] for i in nxt])
            if eagle:
                state_in = state[sel][:, None]
                out = self.dm(t_in, state_in, p_in, self.dcache, kv_len, r)[:, 0]
                state = state.clone()
                state[sel] = out
                logits = self.dm.logits(state)
            else:
                out = self.dm(t_in, p_in, self.dcache, kv_len, r)[:, 0]
                logits = logits.clone()
                logits[sel] = self.dm.logits(out)
                for i in nxt:
                    st[i].dlen = st[i].tlen + depth + 1
            active = nxt
        return drafted

    def _feed(self, slots: list[int], st: list[Slot]):
        """Drafter forward over each slot's pending positions dlen .. (EAGLE: tlen-1 pairs; draft LM: tlen)."""
        dev = self.device
        eagle = self.kind == "eagle"
        n = [(s.tlen if eagle else s.tlen + 1) - s.dlen for s in st]
        T = max(n)
        ar = torch.arange(T, device=dev)[None]
        dl = torch.tensor([s.dlen for s in st], device=dev)
        nt = torch.tensor(n, device=dev)
        valid = ar < nt[:, None]
        pos = torch.where(valid, dl[:, None] + ar, self.trash)
        ridx = torch.tensor(slots, device=dev)
        rows = self._rows(slots)
        kv_len = max(s.dlen + k for s, k in zip(st, n))
        lastsel = (nt - 1)[:, None, None]
        if eagle:
            tok = self.seq[ridx[:, None], torch.where(valid, pos + 1, self.trash)]
            feats = self.feat[ridx[:, None], pos]
            out = self.dm(tok, feats, pos, self.dcache, kv_len, rows)
            self.h_last[ridx] = out.gather(1, lastsel.expand(-1, 1, out.shape[-1]))[:, 0]
        else:
            tok = self.seq[ridx[:, None], pos]
            out = self.dm(tok, pos, self.dcache, kv_len, rows)
            self.logits_last[ridx] = self.dm.logits(out.gather(1, lastsel.expand(-1, 1, out.shape[-1]))[:, 0])
        for s, k in zip(st, n):
            s.dlen += k

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
