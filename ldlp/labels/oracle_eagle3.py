"""Oracle-optimal draft lengths for an EAGLE-3 drafter (:mod:`eagle_backbone.eagle3`), greedy decoding.

The same rows as :func:`ldlp.labels.oracle.oracle_labels` (see its module docstring), computed with the
engine's own EAGLE-3 code (:class:`~eagle_backbone.eagle3.BatchedEagle3Drafter` on a
:class:`~eagle_backbone.llama.SlotCache`), so a label is what
:class:`~eagle_backbone.candidates.Eagle3CandidateGenerator` drafts at that position:

* the drafter reads the true pairs ``(s[j+1], fc(a_j))``, ``a_j`` the target's states entering its layers
  (width k·d), and drafts from its own pre-norm states; its distribution is
  :meth:`~eagle_backbone.eagle3.Eagle3Drafter.full_logits` (the draft vocabulary mapped to the target's);
* ``feature`` is still ``f_{i-1}``, the target's final-normed last hidden state (width d): what the engine's
  ``DraftContext.feature`` / ``Rows.features`` (``engine.last_feat``) hold, and what the LDLP reads,
  whichever the drafter;
* ``draft_state`` is the drafter's pre-norm state at each step (width d): what the generator hands the
  acceptance head.

One target pass over ``s`` (logits, last hidden states, layer states), one causal drafter pass over the true
pairs in one cache slot (draft step 1 for every row), then rows in chunks, one cache slot each holding a copy
of the true prefix: step ``m`` writes its pair at position ``i + m - 2`` and attends over ``0 .. i + m - 2``
(the prefix ``< i`` and its own earlier steps), exactly as the engine writes drafts past the true pairs.
"""

from __future__ import annotations

import torch

from eagle_backbone.candidates import check_eagle_pair
from eagle_backbone.llama import RaggedBatch, SlotCache
from ldlp.labels.oracle import _check, _draft_stats, _empty, _wrong_prefix_target_probs, lcp_labels

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
    label = lcp_labels(draft, seq, index)

    steps = torch.arange(1, k_max + 1)[None]
    pos = index[:, None] + steps - 1
    on_true = steps <= (label[:, None] + 1)
    pos_c = pos.clamp(max=L - 1).to(logits.device)
    tp = torch.exp(logits[pos_c, draft.to(logits.device)].float() - log_norm[pos_c]).cpu()
    target_prob = torch.where(on_true, tp, torch.full_like(tp, float("nan")))
    if full_target_prob:
        _wrong_prefix_target_probs(target, tcache, L, draft, label, index, target_prob,
                                   max_tokens=(max_rows_per_pass or R) * (k_max - 1))

    return {
        "index": index,
        "last_token": seq[n: L - 1].clone(),
        "label": label,
        "remaining": (L - 1) - index,
        "draft_top1_prob": top1,
        "draft_entropy": entropy,
        "target_prob": target_prob,
        "feature": feats[n - 1: L - 2].cpu(),
        "draft_tokens": draft,
        "draft_state": states,
    }


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
        toks, tops, ents, sts = [], [], [], []
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
