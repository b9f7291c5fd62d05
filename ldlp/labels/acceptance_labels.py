"""Per-position acceptance labels, greedy or sampled (``python scripts/collect_acceptance.py``).

What :class:`ldlp.models.acceptance.DraftAcceptanceHead` learns: for a drafted token at depth ``i``, the
probability that the target keeps it given that drafts ``1..i-1`` were kept.

A sequence is a prompt followed by the target's response at temperature ``T`` (greedy at ``T = 0``, a
seeded sample otherwise). At every index ``i`` of the response (``n <= i < len(s) - 1``, the oracle's
rows) the drafter, given the true pairs ``(s[j+1], f_j)`` for ``j < i``, draws a chain ``x_1..x_K`` with
``x_m ~ q_m`` (the argmax at ``T = 0``), feeding back its own states as
:class:`~eagle_backbone.kinds.eagle.EagleCandidateGenerator` does; one target pass over the chain gives
``p_1..p_K`` (``p_m``: the target's distribution after ``s[:i+1] + x_1..x_{m-1}``). ``p`` and ``q``
are temperature-adjusted exactly as decoding uses them (:func:`eagle_backbone.sampling.probs_from_logits`).
Per depth ``m`` the row records

* ``beta[m]``: at ``T > 0`` the acceptance probability of a draft from ``q_m``, ``sum_x min(p_m(x), q_m(x))``
  (a soft label); at ``T = 0`` the hard label ``argmax q_m == argmax p_m``;
* ``kept[m]``: whether speculative sampling keeps ``x_m`` (a seeded ``u_m < min(1, p_m(x_m) / q_m(x_m))``;
  greedy: ``x_m == argmax p_m``), and ``valid[m]``: whether every earlier draft was kept, i.e. whether depth
  ``m`` is reached at all, which conditions the example exactly as a draft-length policy needs;
* the drafter's state, :func:`ldlp.models.acceptance.prob_features` of ``q_m``, ``q_m(x_m)`` and ``p_m(x_m)``.

One target forward per response token (which generates it), one of ``K - 1`` tokens over the chain and
``K`` drafter steps per row, all on KV caches rolled back after each chain. Seeded per sequence: two runs
give identical labels. The collector is a :class:`ldlp.labels.collect.Collector`, the driver the oracle
collector runs too (planning, manifest guard, part files: :mod:`ldlp.labels.store`), with its own hooks:
resumable, atomic, shardable.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from eagle_backbone.sampling import SamplingConfig, probs_from_logits
from eagle_backbone.target import TargetModel, rollback
from ldlp.models.acceptance import prob_features
from ldlp.labels.collect import Collector, part_columns
from ldlp.labels.work import Part
from ldlp.labels.store import (
    acceptance_rows_features,
    committed_parts,
    write_json,
)

PER_DEPTH = ("draft_tokens", "draft_prob", "target_prob", "draft_log_top1", "draft_entropy", "draft_sum_sq",
             "beta", "kept", "valid")
# settings that change what the files contain; a rerun must agree on them to continue a collection
IDENTITY_KEYS = ("seed", "k_max", "max_new_tokens", "temperature", "top_k", "top_p", "store_draft_states",
                 "state_dtype", "shard_size", "num_shards")


def sequence_seed(seed: int, seq_id: int, stream: int) -> int:
    """The seed of one random stream (0: the response, 1: the chains) of sequence ``seq_id``."""
    return int(np.random.SeedSequence([int(seed), int(seq_id), int(stream)]).generate_state(1)[0])


def _draw(probs: torch.Tensor, sampling: SamplingConfig, gen: torch.Generator) -> int:
    if sampling.greedy:
        return int(probs.argmax())
    return int(torch.multinomial(probs.detach().float().cpu(), 1, generator=gen))


@torch.inference_mode()
def acceptance_labels(target: TargetModel, drafter, prompt_ids, max_new_tokens: int, k_max: int,
                      sampling: SamplingConfig, seed: int, seq_id: int = 0) -> tuple[list[int], dict]:
    """The response (target at ``sampling``) and its label rows (CPU tensors, one row per index ``i``):

    ``index``, ``last_token`` (R,); ``draft_tokens``, ``draft_prob`` (q_m(x_m)), ``target_prob``
    (p_m(x_m)), ``draft_log_top1``, ``draft_entropy``, ``draft_sum_sq``, ``beta``, ``kept``, ``valid``
    (R, k_max; column ``m-1`` is depth ``m``) and ``draft_state`` (R, k_max, d) in the LM head's dtype.
    """
    ids = [int(t) for t in (prompt_ids.flatten().tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
    if not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max must be an integer >= 1, got {k_max!r}")
    if not ids:
        raise ValueError("acceptance_labels: empty prompt")
    from eagle_backbone.candidates import check_eagle_pair

    check_eagle_pair(drafter, target)
    lm_head, ddtype, device = target.lm_head, next(drafter.fc.parameters()).dtype, target.device
    resp_gen = torch.Generator().manual_seed(sequence_seed(seed, seq_id, 0))
    chain_gen = torch.Generator().manual_seed(sequence_seed(seed, seq_id, 1))
    eos = target.eos_token_ids
    n = len(ids)
    tcache, dcache = target.new_cache(), drafter.new_cache()
    logits, feats = target(torch.tensor([ids], device=device), tcache)
    if n > 1:  # the true pairs (s[j+1], f_j), j = 0 .. n-2
        drafter(torch.tensor([ids[1:]], device=device), feats[:, : n - 1].to(ddtype), dcache)
    prev_feat = feats[0, -1]  # f_{i-1} for the next row
    x = _draw(probs_from_logits(logits[0, -1], sampling), sampling, resp_gen)
    seq, response = list(ids), [x]
    rows: dict[str, list] = {k: [] for k in ("index", "last_token", *PER_DEPTH, "draft_state")}
    while len(response) < max_new_tokens and x not in eos and len(seq) + k_max <= target.max_length:
        i = len(seq)  # index of x = s[i], the last accepted token
        seq.append(x)
        logits, feats = target(torch.tensor([[x]], device=device), tcache)  # cache: s[:i+1]
        h = drafter(torch.tensor([[x]], device=device), prev_feat[None, None].to(ddtype), dcache)  # pair (s[i], f_{i-1})
        prev_feat = feats[0, -1]
        chain, qs, states = [], [], []
        for m in range(1, k_max + 1):
            state = h[0, -1].to(lm_head.weight.dtype)
            q = probs_from_logits(lm_head(state), sampling)
            tok = _draw(q, sampling, chain_gen)
            chain.append(tok)
            qs.append(q)
            states.append(state)
            if m < k_max:
                h = drafter(torch.tensor([[tok]], device=device), h, dcache)
        rollback(dcache, i)  # the true pairs up to (s[i], f_{i-1}) stay
        target_logits = logits[0, -1:]
        if k_max > 1:
            chain_logits, _ = target(torch.tensor([chain[:-1]], device=device), tcache)
            rollback(tcache, i + 1)
            target_logits = torch.cat([target_logits, chain_logits[0]])
        P, Q = probs_from_logits(target_logits, sampling), torch.stack(qs)  # (K, V) each
        tok_t = torch.tensor(chain, device=P.device)
        ar = torch.arange(k_max, device=P.device)
        p_x, q_x = P[ar, tok_t], Q[ar, tok_t]
        u = torch.rand(k_max, generator=chain_gen)
        if sampling.greedy:
            kept = (P.argmax(-1) == tok_t).cpu()
            beta = kept.float()
        else:
            beta = torch.minimum(P, Q).sum(-1).cpu()
            kept = u < torch.clamp(p_x.cpu() / q_x.cpu().clamp_min(1e-30), max=1.0)
        valid = torch.cat([torch.ones(1, dtype=torch.bool), kept[:-1].long().cumprod(0).bool()])
        pf = prob_features(Q).cpu()
        rows["index"].append(i)
        rows["last_token"].append(x)
        rows["draft_tokens"].append(tok_t.cpu())
        rows["draft_prob"].append(q_x.float().cpu())
        rows["target_prob"].append(p_x.float().cpu())
        rows["draft_log_top1"].append(pf[:, 0])
        rows["draft_entropy"].append(pf[:, 1])
        rows["draft_sum_sq"].append(pf[:, 2])
        rows["beta"].append(beta.float())
        rows["kept"].append(kept)
        rows["valid"].append(valid)
        rows["draft_state"].append(torch.stack(states).cpu())
        x = _draw(P[0], sampling, resp_gen)  # the response's next token s[i+1] ~ p_1
        response.append(x)
    d = target.hidden_size
    out = {"index": torch.tensor(rows["index"], dtype=torch.long),
           "last_token": torch.tensor(rows["last_token"], dtype=torch.long)}
    for k in PER_DEPTH:
        dtype = torch.long if k == "draft_tokens" else torch.bool if k in ("kept", "valid") else torch.float32
        out[k] = torch.stack(rows[k]).to(dtype) if rows[k] else torch.zeros(0, k_max, dtype=dtype)
    out["draft_state"] = (torch.stack(rows["draft_state"]) if rows["draft_state"]
                          else torch.zeros(0, k_max, d, dtype=lm_head.weight.dtype))
    return response, out


# ---- the collector ---------------------------------------------------------------------------------


def sampling_of(cfg) -> SamplingConfig:
    return SamplingConfig(temperature=float(cfg.temperature), top_k=int(cfg.top_k), top_p=float(cfg.top_p))


def _part_columns(results, k_max: int, d: int, eos: set[int], store_states: bool) -> tuple[dict, dict]:
    rows, seqs = part_columns(results, eos)
    rows.update({k: [] for k in ("index", "last_token", *PER_DEPTH, "draft_state")})
    for _, _, lab in results:
        for k in ("index", "last_token", *PER_DEPTH):
            rows[k].append(lab[k].numpy())
        if store_states:
            rows["draft_state"].append(lab["draft_state"].float().numpy().reshape(len(lab["index"]), k_max * d))
    for k in ("index", "last_token"):
        rows[k] = np.concatenate(rows[k]) if rows[k] else np.zeros(0, np.int64)
    for k in PER_DEPTH:
        rows[k] = np.concatenate(rows[k]) if rows[k] else np.zeros((0, k_max), np.float32)
        if k in ("kept", "valid"):
            rows[k] = rows[k].astype(np.int8)
    rows["draft_state"] = np.concatenate(rows["draft_state"]) if rows["draft_state"] else np.zeros((0, k_max * d))
    return rows, seqs


class AcceptanceCollector(Collector):
    """The acceptance labels' hooks: :func:`acceptance_labels` per sequence at the configured sampling,
    valid / beta / kept sums by depth per part."""

    identity_keys = IDENTITY_KEYS
    collection = "acceptance"
    drafter_use = "acceptance labels need an EAGLE drafter (its state is the head's input)"
    k_max_limit = 64
    dtype_keys = ("state_dtype",)

    def check_config(self) -> None:
        super().check_config()
        # temperature >= 0, top_k >= 0, top_p in (0, 1]: SamplingConfig says which is wrong
        self.sampling = sampling_of(self.cfg)

    def prompt_margin(self) -> int:
        return self.cfg.k_max

    def manifest_fields(self, target) -> dict:
        return {"kind": "draft_acceptance_labels", "k_max": self.cfg.k_max, "temperature": self.sampling.temperature,
                "store_draft_states": self.cfg.store_draft_states}

    def rows_features(self, target):
        d = target.hidden_size
        return acceptance_rows_features(self.cfg.k_max, d if self.cfg.store_draft_states else None,
                                        state_dtype=self.cfg.state_dtype)

    def progress(self, todo: list[Part], worker: str) -> dict:
        return dict(total=sum(len(p.items) for p in todo), unit="seq",
                    desc=f"acceptance t={self.sampling.temperature} {worker}")

    def label_part(self, part: Part, target, drafter, bar, clock) -> tuple[dict, dict]:
        cfg = self.cfg
        results = []
        for it in part.items:
            response, lab = acceptance_labels(target, drafter, it.prompt_ids, cfg.max_new_tokens, cfg.k_max,
                                              self.sampling, cfg.seed, it.seq_id)
            results.append((it, response, lab))
            bar.update(1)
        return _part_columns(results, cfg.k_max, target.hidden_size, target.eos_token_ids, cfg.store_draft_states)

    def part_stats(self, rows: dict, seqs: dict) -> dict:
        valid = rows["valid"].astype(bool)
        return {"valid_by_depth": valid.sum(0).tolist(),
                "beta_sum_by_depth": np.where(valid, rows["beta"], 0).sum(0).tolist(),
                "kept_by_depth": (valid & rows["kept"].astype(bool)).sum(0).tolist()}

    def write_report(self, out: Path, run: dict) -> dict:
        return write_report(out, self.cfg.k_max, self.sampling.temperature, run)


def collect_acceptance(cfg) -> dict:
    """Run (or continue) one collector into ``cfg.out_dir``; returns the report over its complete parts."""
    return AcceptanceCollector(cfg).run()


def write_report(out: Path, k_max: int, temperature: float, run: dict | None = None) -> dict:
    """Sum the complete parts' meta files into ``report.json`` (examples, mean beta and kept rate by depth; whether
    the collection is complete); returns it (``ldlp.report.labels`` renders its page)."""
    metas = [json.loads(p.read_text()) for p in committed_parts(out)]
    valid = np.sum([m["valid_by_depth"] for m in metas], axis=0) if metas else np.zeros(k_max)
    beta = np.sum([m["beta_sum_by_depth"] for m in metas], axis=0) if metas else np.zeros(k_max)
    kept = np.sum([m["kept_by_depth"] for m in metas], axis=0) if metas else np.zeros(k_max)
    seconds = sum(m["seconds"] for m in metas)
    positions = sum(m["positions"] for m in metas)
    report = {"k_max": k_max, "temperature": temperature, "parts": len(metas),
              "sequences": sum(m["sequences"] for m in metas), "positions": positions,
              "splits": {s: sum(m["positions"] for m in metas if m["split"] == s) for s in sorted({m["split"] for m in metas})},
              "valid_by_depth": valid.astype(int).tolist(),
              "mean_beta_by_depth": [float(b / v) if v else None for b, v in zip(beta, valid)],
              "kept_rate_by_depth": [float(k / v) if v else None for k, v in zip(kept, valid)],
              "seconds": seconds, "positions_per_s": positions / seconds if seconds else None,
              "this_run": run or {}}
    from ldlp.labels.store import collection_status

    status = collection_status(out)  # the parts on disk against the prompts the manifest plans (every collector's)
    missing = status["missing_sequences"]
    report.update(sequences_planned=status["sequences_planned"], missing_sequences=missing,
                  complete=None if missing is None else missing == 0)
    write_json(out / "report.json", report)
    return report
