"""Oracle-optimal draft lengths (AdaEAGLE's labels, greedy decoding).

A sequence ``s`` is a prompt (``n`` tokens) followed by the target's greedy response. At every
index ``i`` with ``n <= i < len(s) - 1`` the last accepted token is ``s[i]``; the drafter, given the
true pairs ``(s[j+1], f_j)`` for ``j < i`` (``f_j``: the target's feature at position ``j``), drafts
``k_max`` tokens greedily, feeding back its own predicted features exactly as
:class:`~eagle_backbone.kinds.eagle.EagleCandidateGenerator` does. The label is the length of the
longest common prefix of that draft and ``s[i+1 : i+1+k_max]``: under greedy decoding, drafting
exactly that many tokens keeps the output, spends the fewest target passes and wastes no draft.

Each row also records what a draft-length predictor sees before drafting at ``i`` (``last_token =
s[i]`` and ``feature = f_{i-1}``, the feature whose logits produced ``s[i]``: ``Rows.features``
in the engine) and, for every drafted step ``m = 1..k_max``, the drafter's top-1 probability and
entropy (softmax at temperature 1), its state (the hidden state its LM head read, which
:class:`ldlp.models.acceptance.AcceptanceHead` reads) and the target's probability of the drafted token
``d_m`` given ``s[:i+1] + d_1..d_{m-1}``. For ``m <= label + 1`` that prefix is the true sequence, so the value comes
from the one teacher-forced target pass; for ``m > label + 1`` the prefix contains a wrong draft and
the value needs an extra target pass over the wrong continuations (``full_target_prob``; NaN without).

:func:`oracle_labels` computes all rows of a sequence at once: one target pass over ``s``, one causal
drafter pass over the true pairs (draft step 1 for every ``i``), then ``k_max - 1`` drafter passes in
which the rows' draft chains sit side by side in one sequence dimension, each attending to the true
prefix (positions ``< i``, from the KV cache) and to its own earlier draft positions only (a block
mask). :func:`oracle_labels_sequential` is the naive reference used by the tests. An EAGLE-3 drafter is
labelled by :func:`oracle_labels_eagle3` (the same rows, on the engine's EAGLE-3 code; see its section below).
"""

from __future__ import annotations

import torch

from eagle_backbone.candidates import check_eagle_pair
from eagle_backbone.ragged import RaggedBatch, SlotCache
from eagle_backbone.eagle3 import Eagle3Drafter
from eagle_backbone.sampling import SamplingConfig, probs_from_logits
from eagle_backbone.target import TargetModel, rollback
from ldlp.models.features import confidence

GREEDY = SamplingConfig()
ROW_FIELDS = ("index", "last_token", "label", "remaining", "draft_top1_prob", "draft_entropy", "target_prob",
              "target_stats", "feature", "draft_tokens", "draft_state")


def _check(input_ids, prompt_len: int, k_max: int) -> list[int]:
    ids = input_ids.flatten().tolist() if isinstance(input_ids, torch.Tensor) else [int(t) for t in input_ids]
    if not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max must be an integer >= 1, got {k_max!r}")
    if not 1 <= prompt_len <= len(ids):
        raise ValueError(f"prompt_len={prompt_len} must be in [1, len(input_ids)={len(ids)}]")
    return ids


def _empty(k_max: int, d: int, dtype: torch.dtype, state_dtype: torch.dtype) -> dict:
    z = torch.zeros(0, dtype=torch.long)
    nan = torch.zeros(0, k_max)
    return {"index": z, "last_token": z, "label": z, "remaining": z, "draft_top1_prob": nan,
            "draft_entropy": nan.clone(), "target_prob": nan.clone(), "target_stats": torch.zeros(0, 3), "feature": torch.zeros(0, d, dtype=dtype),
            "draft_tokens": torch.zeros(0, k_max, dtype=torch.long),
            "draft_state": torch.zeros(0, k_max, d, dtype=state_dtype)}


def _draft_stats(drafter_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy token, top-1 probability and entropy per row, from the same softmax the engine uses."""
    probs = probs_from_logits(drafter_logits, GREEDY)  # float32 softmax at temperature 1
    top1, token = probs.max(dim=-1)
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    return token, top1, entropy


def lcp_labels(draft: torch.Tensor, seq: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Longest common prefix of each row's draft (R, k) with ``seq[index+1 : index+1+k]``."""
    k = draft.shape[1]
    pos = index[:, None] + 1 + torch.arange(k)[None]
    truth = torch.where(pos < len(seq), seq[pos.clamp(max=len(seq) - 1)], torch.full_like(pos, -1))
    return (draft == truth).long().cumprod(dim=1).sum(dim=1)


def _drafter_chains(drafter, lm_head, cache, first_h, first_tok, index, prefix_len: int, k_max: int):
    """Draft steps 2..k_max for rows whose step-1 outputs are ``first_h`` (C, d): per step the tokens,
    top-1 probabilities, entropies and states (the drafter outputs in the LM head's dtype).

    Row ``r`` (last accepted index ``i = index[r]``) feeds ``(d_{m-1}, f̂_{m-1})`` at position
    ``i + m - 2``; it sees the true prefix keys ``< i`` and its own chain keys, nothing else. (Masked
    keys get weight exactly 0, so rows cannot influence each other, unless a row's values overflow to
    inf/NaN: 0 * NaN is NaN. The sequential reference would confine such a row; finite models never
    produce one.)
    """
    C, device = first_h.shape[0], first_h.device
    dtype = first_h.dtype
    neg = torch.finfo(dtype).min
    prefix_allowed = torch.arange(prefix_len, device=device)[None, :] < index.to(device)[:, None]  # (C, P)
    own = torch.eye(C, dtype=torch.bool, device=device)
    h, tok = first_h, first_tok
    tokens, top1s, entropies, states = [], [], [], []
    for m in range(2, k_max + 1):
        allowed = torch.cat([prefix_allowed] + [own] * (m - 1), dim=1)  # earlier chain steps + this one
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, neg)[None, None]
        pos = (index.to(device) + m - 2)[None]
        h = drafter(tok.to(device)[None], h[None], cache, position_ids=pos, attention_mask=mask)[0]
        state = h.to(lm_head.weight.dtype)
        tok, top1, ent = _draft_stats(lm_head(state))
        tokens.append(tok)
        top1s.append(top1)
        entropies.append(ent)
        states.append(state)
    rollback(cache, prefix_len)  # drop the chains: the cache holds the true prefix again
    return tokens, top1s, entropies, states


def _wrong_prefix_target_probs(target: TargetModel, cache, seq_len: int, draft: torch.Tensor,
                               label: torch.Tensor, index: torch.Tensor, out: torch.Tensor,
                               max_tokens: int) -> None:
    """Fill ``out[r, m-1]`` for ``m > label+1``: the target's probability of ``d_m`` after the wrong prefix.

    Row ``r`` with label ``a`` feeds ``d_{a+1} .. d_{k-1}`` at positions ``i+a+1 ..``; the true tokens
    ``s[:i+a+1]`` (equal to the draft up to ``d_a``) come from the target's cache. Rows are packed into
    passes of at most ``max_tokens`` query tokens with a block mask, like the drafter chains.
    """
    k = draft.shape[1]
    rows = [r for r in range(draft.shape[0]) if int(label[r]) < k - 1]
    device, dtype = target.device, target.dtype
    neg = torch.finfo(dtype).min
    start = 0
    while start < len(rows):
        batch, n_tok = [], 0
        while start < len(rows) and (not batch or n_tok + k - 1 - int(label[rows[start]]) <= max_tokens):
            r = rows[start]
            batch.append(r)
            n_tok += k - 1 - int(label[r])
            start += 1
        toks, pos, row_of, step_of, visible = [], [], [], [], []
        for b, r in enumerate(batch):
            a, i = int(label[r]), int(index[r])
            for t in range(k - 1 - a):
                toks.append(int(draft[r, a + t]))
                pos.append(i + a + 1 + t)
                row_of.append(b)
                step_of.append(t)
                visible.append(i + a + 1)  # true keys 0 .. i+a
        row_of_t, step_of_t = torch.tensor(row_of), torch.tensor(step_of)
        prefix_allowed = torch.arange(seq_len)[None, :] < torch.tensor(visible)[:, None]
        own = (row_of_t[:, None] == row_of_t[None, :]) & (step_of_t[None, :] <= step_of_t[:, None])
        allowed = torch.cat([prefix_allowed, own], dim=1).to(device)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, neg)[None, None]
        hidden = target.decoder(input_ids=torch.tensor([toks], device=device), cache=cache, use_cache=True,
                                attention_mask=mask, position_ids=torch.tensor([pos], device=device)).last_hidden_state
        probs = probs_from_logits(target.lm_head(hidden[0]), GREEDY)
        rollback(cache, seq_len)
        row = torch.tensor(batch)[row_of_t]
        col = label[row] + 1 + step_of_t  # 0-based column of d_m, m = a + 2 + t
        picked = probs[torch.arange(len(toks), device=device), draft[row, col].to(device)]
        out[row, col] = picked.cpu().to(out.dtype)


@torch.inference_mode()
def oracle_labels(target: TargetModel, drafter, input_ids, prompt_len: int, k_max: int,
                  full_target_prob: bool = True, max_rows_per_pass: int | None = 512, rows=None) -> dict:
    """All label rows of one sequence, vectorised. Returns CPU tensors, one row per index ``i``:

    ``index`` (R,), ``last_token`` (R,), ``label`` (R,), ``remaining`` (R,) = ``len(s) - 1 - i`` (the
    label is censored when it is below ``k_max``), ``draft_top1_prob``, ``draft_entropy``,
    ``target_prob`` (R, k_max; column ``m-1`` is drafted step ``m``), ``feature`` (R, d) = ``f_{i-1}``
    in the target's dtype, ``draft_tokens`` (R, k_max) and ``draft_state`` (R, k_max, d), the drafter
    output each step's LM head read (in the LM head's dtype). How the rows are drafted is the drafter kind's
    (``oracle_rows`` of :mod:`eagle_backbone.drafter_kinds`; the collector passes it as ``rows``): a recipe of
    :data:`ORACLE_RECIPES` by name (``eagle``: :func:`oracle_labels_eagle`; ``eagle3``: :func:`oracle_labels_eagle3`,
    the same rows, its states pre-norm) or a callable with this function's arguments. Without ``rows``, the drafter's
    class says which (an EAGLE-3 drafter: ``eagle3``).
    """
    recipe = rows if rows is not None else ("eagle3" if isinstance(drafter, Eagle3Drafter) else "eagle")
    fn = recipe if callable(recipe) else ORACLE_RECIPES.get(recipe)
    if fn is None:
        raise ValueError(f"oracle labels: no rows recipe {recipe!r} (recipes: {', '.join(sorted(ORACLE_RECIPES))})")
    return fn(target, drafter, input_ids, prompt_len, k_max, full_target_prob, max_rows_per_pass)


@torch.inference_mode()
def oracle_labels_eagle(target: TargetModel, drafter, input_ids, prompt_len: int, k_max: int,
                        full_target_prob: bool = True, max_rows_per_pass: int | None = 512) -> dict:
    """The rows of :func:`oracle_labels` for an EAGLE-1 drafter (recipe ``eagle``)."""
    s = _check(input_ids, prompt_len, k_max)
    n, L = prompt_len, len(s)
    R = L - 1 - n
    if R <= 0:
        return _empty(k_max, target.hidden_size, target.dtype, target.lm_head.weight.dtype)
    check_eagle_pair(drafter, target)
    lm_head, ddtype = target.lm_head, next(drafter.fc.parameters()).dtype
    seq = torch.tensor(s)
    index = torch.arange(n, L - 1)

    # one teacher-forced target pass: features f_0..f_{L-1} and the target's own next-token logits
    tcache = target.new_cache() if full_target_prob else None
    logits, feats = target(seq[None].to(target.device), tcache)
    logits, feats = logits[0], feats[0]
    log_norm = torch.logsumexp(logits.float(), dim=-1)  # per position, for p(token) = exp(logit - lse)

    # draft step 1 for every row at once: the causal pass over the true pairs (s[j+1], f_j), j < L-1
    dcache = drafter.new_cache()
    P = L - 1
    h_all = drafter(seq[None, 1:].to(target.device), feats[None, :P].to(ddtype), dcache)[0]
    h1 = h_all[n - 1: L - 2]  # row i reads the output at position i-1
    state1 = h1.to(lm_head.weight.dtype)
    tok1, top1_1, ent1 = _draft_stats(lm_head(state1))

    # draft steps 2..k_max: the rows' chains side by side, max_rows_per_pass rows per batched pass
    chunk = max_rows_per_pass or R
    chains = [_drafter_chains(drafter, lm_head, dcache, h1[r0:r0 + chunk], tok1[r0:r0 + chunk],
                              index[r0:r0 + chunk], P, k_max) for r0 in range(0, R, chunk)]

    def by_step(first: torch.Tensor, which: int) -> torch.Tensor:  # (R, k_max, ...): column m-1 is step m
        later = [torch.cat([c[which][m] for c in chains]) for m in range(k_max - 1)]
        return torch.stack([first] + later, dim=1).cpu()

    draft, top1, entropy = by_step(tok1, 0), by_step(top1_1, 1), by_step(ent1, 2)
    states = by_step(state1, 3)

    return _label_rows(target, tcache, seq, index, n, L, logits, log_norm, feats, k_max,
                       (draft, top1, entropy, states), full_target_prob, max_rows_per_pass or R)


@torch.inference_mode()
def oracle_labels_sequential(target: TargetModel, drafter, input_ids, prompt_len: int, k_max: int,
                             full_target_prob: bool = True) -> dict:
    """The naive reference: at every index, a fresh target prefill and EAGLE's own drafting loop."""
    s = _check(input_ids, prompt_len, k_max)
    n, L = prompt_len, len(s)
    if L - 1 - n <= 0:
        return _empty(k_max, target.hidden_size, target.dtype, target.lm_head.weight.dtype)
    check_eagle_pair(drafter, target)
    lm_head, ddtype = target.lm_head, next(drafter.fc.parameters()).dtype
    rows = {f: [] for f in ROW_FIELDS}
    for i in range(n, L - 1):
        prefix = s[: i + 1]
        _, feats = target(torch.tensor([prefix], device=target.device), target.new_cache())
        # EAGLE's chain: the true pairs (s[j+1], f_j), j < i, then one drafter step per drafted token
        dcache = drafter.new_cache()
        h = drafter(torch.tensor([prefix[1:]], device=target.device), feats[:, :i].to(ddtype), dcache)[:, -1:]
        draft, dists, states = [], [], []
        for m in range(k_max):
            state = h[0, -1].to(lm_head.weight.dtype)
            probs = probs_from_logits(lm_head(state), GREEDY)
            draft.append(int(probs.argmax()))
            dists.append(probs)
            states.append(state)
            if m < k_max - 1:
                h = drafter(torch.tensor([[draft[-1]]], device=target.device), h, dcache)
        states = torch.stack(states).cpu()
        logits, _ = target(torch.tensor([prefix + draft[:-1]], device=target.device), target.new_cache())
        tprobs = probs_from_logits(logits[0, i:], GREEDY)
        label = 0
        while label < k_max and i + 1 + label < L and draft[label] == s[i + 1 + label]:
            label += 1
        dist = torch.stack(dists).cpu()
        tp = torch.tensor([float(tprobs[m, draft[m]]) for m in range(k_max)])
        if not full_target_prob:
            tp[label + 1:] = float("nan")
        rows["index"].append(i)
        rows["last_token"].append(s[i])
        rows["label"].append(label)
        rows["remaining"].append(L - 1 - i)
        rows["draft_top1_prob"].append(dist.max(-1).values)
        rows["draft_entropy"].append(-(dist * torch.log(dist.clamp_min(1e-30))).sum(-1))
        rows["target_prob"].append(tp)
        rows["target_stats"].append(confidence(lm_head(feats[0, i - 1])).cpu())
        rows["feature"].append(feats[0, i - 1].cpu())
        rows["draft_tokens"].append(torch.tensor(draft))
        rows["draft_state"].append(states)
    out = {}
    for f, v in rows.items():
        out[f] = torch.stack(v) if isinstance(v[0], torch.Tensor) else torch.tensor(v)
    return out


@torch.inference_mode()
def recompute_features(target: TargetModel, input_ids, prompt_len: int) -> torch.Tensor:
    """Row features ``f_{i-1}`` for ``i = prompt_len .. len-2`` from one teacher-forced pass
    (for oracle sets collected with ``store_features=false``)."""
    s = _check(input_ids, prompt_len, 1)
    _, feats = target(torch.tensor([s], device=target.device))
    return feats[0, prompt_len - 1: len(s) - 2]


# ---- EAGLE-3 drafters ----------------------------------------------------------------------------------
# Oracle-optimal draft lengths for an EAGLE-3 drafter (:mod:`eagle_backbone.eagle3`), greedy decoding.
#
# The same rows as :func:`oracle_labels` (see the module docstring), computed with the
# engine's own EAGLE-3 code (:class:`~eagle_backbone.eagle3.BatchedEagle3Drafter` on a
# :class:`~eagle_backbone.ragged.SlotCache`), so a label is what
# :class:`~eagle_backbone.kinds.eagle3.Eagle3CandidateGenerator` drafts at that position:
#
# * the drafter reads the true pairs ``(s[j+1], fc(a_j))``, ``a_j`` the target's states entering its layers
#   (width k·d), and drafts from its own pre-norm states; its distribution is
#   :meth:`~eagle_backbone.eagle3.Eagle3Drafter.full_logits` (the draft vocabulary mapped to the target's);
# * ``feature`` is still ``f_{i-1}``, the target's final-normed last hidden state (width d): what the engine's
#   ``Rows.features`` (``engine.last_feat``) hold, and what the LDLP reads,
#   whichever the drafter;
# * ``draft_state`` is the drafter's pre-norm state at each step (width d): what the generator hands the
#   acceptance head.
#
# One target pass over ``s`` (logits, last hidden states, layer states), one causal drafter pass over the true
# pairs in one cache slot (draft step 1 for every row), then rows in chunks, one cache slot each holding a copy
# of the true prefix: step ``m`` writes its pair at position ``i + m - 2`` and attends over ``0 .. i + m - 2``
# (the prefix ``< i`` and its own earlier steps), exactly as the engine writes drafts past the true pairs.

CHUNK_ROWS = 64  # rows drafted side by side at most: each holds a copy of the prefix's keys and values


def target_pass(target, seq: torch.Tensor, layers, cache=None):
    """Logits (T, V), final-normed hidden states (T, d) and the states entering ``layers`` side by side
    (T, k·d) of one teacher-forced pass over ``seq`` (T,), continuing ``cache`` when given."""
    out = target.decoder(input_ids=seq[None].to(target.device), cache=cache, use_cache=cache is not None,
                         output_hidden_states=True)
    feats = out.last_hidden_state[0]
    aux = torch.cat([out.hidden_states[i][0] for i in layers], -1)
    return target.lm_head(feats), feats, aux


@torch.inference_mode()
def oracle_labels_eagle3(target, drafter, input_ids, prompt_len: int, k_max: int, full_target_prob: bool = True,
                         max_rows_per_pass: int | None = 512) -> dict:
    """All label rows of one sequence for an :class:`~eagle_backbone.eagle3.Eagle3Drafter`: the fields and
    shapes of :func:`ldlp.labels.oracle.oracle_labels`."""
    from eagle_backbone.eagle3 import BatchedEagle3Drafter

    s = _check(input_ids, prompt_len, k_max)
    n, L = prompt_len, len(s)
    R = L - 1 - n
    ddtype = next(drafter.fc.parameters()).dtype
    if R <= 0:
        return _empty(k_max, target.hidden_size, target.dtype, ddtype)
    check_eagle_pair(drafter, target)
    layers = drafter.aux_layers(target.model.config.num_hidden_layers)
    device = target.device
    seq = torch.tensor(s)
    index = torch.arange(n, L - 1)

    tcache = target.new_cache() if full_target_prob else None
    logits, feats, aux = target_pass(target, seq, layers, tcache)
    log_norm = torch.logsumexp(logits.float(), dim=-1)

    # draft step 1 for every row: the causal pass over the true pairs (s[j+1], fc(a_j)), j < L-1, in one slot
    P = L - 1
    dm = BatchedEagle3Drafter(drafter, P + k_max)
    prefix = dm.new_cache(1)
    h_all = dm(seq[1:].to(device), aux[:P], RaggedBatch([0], [0], [P], device), prefix)
    h1 = h_all[n - 1: L - 2]  # row i reads the output at position i - 1
    tok1, top1_1, ent1 = _draft_stats(dm.logits(h1))

    # draft steps 2..k_max: chunks of rows, one slot each, every slot starting as a copy of the prefix
    chunk = max(1, min(max_rows_per_pass or R, CHUNK_ROWS))
    per_step = [[] for _ in range(4)]  # tokens, top-1, entropy, states: lists (over chunks) of (C, k_max - 1, ...)
    for r0 in range(0, R, chunk):
        idx = index[r0: r0 + chunk].tolist()
        C = len(idx)
        cache = SlotCache(1, C, P + k_max, dm.kv_heads, dm.head_dim, dm.dtype, dm.device)
        cache.k[:, :, :, :P] = prefix.k[:, :1, :, :P]
        cache.v[:, :, :, :P] = prefix.v[:, :1, :, :P]
        h, tok = h1[r0: r0 + chunk], tok1[r0: r0 + chunk]
        got = [[] for _ in range(4)]
        for m in range(2, k_max + 1):
            h = dm.draft(tok, h, RaggedBatch(list(range(C)), [i + m - 2 for i in idx], [1] * C, device), cache)
            tok, top1, ent = _draft_stats(dm.logits(h))
            for lst, v in zip(got, (tok, top1, ent, h)):
                lst.append(v)
        for acc, lst in zip(per_step, got):
            acc.append(torch.stack(lst, 1) if lst else None)

    def by_step(first: torch.Tensor, which: int) -> torch.Tensor:  # (R, k_max, ...): column m-1 is step m
        if k_max == 1:
            return first[:, None].cpu()
        return torch.cat([first[:, None], torch.cat(per_step[which])], 1).cpu()

    draft, top1, entropy, states = by_step(tok1, 0), by_step(top1_1, 1), by_step(ent1, 2), by_step(h1, 3)
    return _label_rows(target, tcache, seq, index, n, L, logits, log_norm, feats, k_max,
                       (draft, top1, entropy, states), full_target_prob, max_rows_per_pass or R)


@torch.inference_mode()
def oracle_labels_eagle3_sequential(target, drafter, input_ids, prompt_len: int, k_max: int) -> dict:
    """The naive reference (tests): at every index a fresh target pass over the prefix and the engine's drafting
    loop in a fresh one-slot cache. Labels, draft tokens, statistics, features and states."""
    from eagle_backbone.eagle3 import BatchedEagle3Drafter

    s = _check(input_ids, prompt_len, k_max)
    n, L = prompt_len, len(s)
    layers = drafter.aux_layers(target.model.config.num_hidden_layers)
    device = target.device
    rows = {k: [] for k in ("index", "label", "draft_tokens", "draft_top1_prob", "draft_entropy", "feature",
                            "draft_state")}
    for i in range(n, L - 1):
        _, feats, aux = target_pass(target, torch.tensor(s[: i + 1]), layers)
        dm = BatchedEagle3Drafter(drafter, i + k_max)
        cache = dm.new_cache(1)
        h = dm(torch.tensor(s[1: i + 1], device=device), aux[:i], RaggedBatch([0], [0], [i], device), cache)[-1:]
        toks, tops, ents, sts, tok = [], [], [], [], None
        for m in range(1, k_max + 1):
            if m > 1:
                h = dm.draft(tok, h, RaggedBatch([0], [i + m - 2], [1], device), cache)
            tok, top1, ent = _draft_stats(dm.logits(h))
            toks.append(int(tok))
            tops.append(float(top1))
            ents.append(float(ent))
            sts.append(h[0])
        label = 0
        while label < k_max and i + 1 + label < L and toks[label] == s[i + 1 + label]:
            label += 1
        for k, v in (("index", i), ("label", label), ("draft_tokens", torch.tensor(toks)),
                     ("draft_top1_prob", torch.tensor(tops)), ("draft_entropy", torch.tensor(ents)),
                     ("feature", feats[i - 1].cpu()), ("draft_state", torch.stack(sts).cpu())):
            rows[k].append(v)
    return {k: (torch.stack(v) if v and isinstance(v[0], torch.Tensor) else torch.tensor(v)) for k, v in rows.items()}


# the oracle's ways of drafting a sequence's rows, by the name a drafter kind gives as its ``oracle_rows``
ORACLE_RECIPES = {"eagle": oracle_labels_eagle, "eagle3": oracle_labels_eagle3}


def _label_rows(target, tcache, seq, index, n: int, L: int, logits, log_norm, feats, k_max: int, drafted,
                full_target_prob: bool, rows_per_pass: int) -> dict:
    """The label columns from a chain drafted at every index (``drafted``: tokens, top-1 probabilities,
    entropies, drafter states, each (R, k_max, ...)): the label (the longest agreeing prefix), the target's
    probabilities of the drafts along the true prefix (steps m <= label + 1 read position i + m - 1) and, with
    ``full_target_prob``, past it."""
    draft, top1, entropy, states = drafted
    label = lcp_labels(draft, seq, index)
    steps = torch.arange(1, k_max + 1)[None]
    pos = index[:, None] + steps - 1
    on_true = steps <= (label[:, None] + 1)
    pos_c = pos.clamp(max=L - 1).to(logits.device)
    tp = torch.exp(logits[pos_c, draft.to(logits.device)].float() - log_norm[pos_c]).cpu()
    target_prob = torch.where(on_true, tp, torch.full_like(tp, float("nan")))
    if full_target_prob:
        _wrong_prefix_target_probs(target, tcache, L, draft, label, index, target_prob,
                                   max_tokens=rows_per_pass * (k_max - 1))
    return {"index": index, "last_token": seq[n: L - 1].clone(), "label": label, "remaining": (L - 1) - index,
            "draft_top1_prob": top1, "draft_entropy": entropy, "target_prob": target_prob,
            "target_stats": confidence(logits[n - 1: L - 2]).cpu(),  # the distribution that produced last_token
            "feature": feats[n - 1: L - 2].cpu(), "draft_tokens": draft, "draft_state": states}
