"""Training an EAGLE-3 head with Lightning: self-distillation data and the training-time test (TTT).

**Data.** The target answers the corpus' first user turns itself (batched decoding, greedy and sampled with
one seed per prompt: :func:`distill`), so the drafter learns what the target says, not what a corpus says, on
the contexts both decoding modes produce.
Each record is a prompt and the target's response; a block is their tokens (cut to ``block_size``), its loss
mask the response's tokens.

**Loss (TTT, unroll K = 7).** With a = the target's states entering its three layers and p_i the target's
next-token distribution at i, step 0 reads the true pairs (t_{j+1}, fc(a_j)) causally; step k ≥ 1 reads
(t_{j+1+k}, s^{k-1}_j), the drafter's own state of the step before, at position j + k, attending to the true
pairs 0..j and to its own pairs of steps 1..k at j: exactly what drafting sees at depth k + 1 when the drafts
so far were the target's tokens (self-distilled data makes them so). Step k's loss is the cross-entropy of the
draft distribution at j against p_{j+1+k} (the target's distribution of t_{j+2+k}), on the draft vocabulary,
where t_{j+2+k} is a response token, weighted ``decay**k``. Tokens only: no feature regression.

**Resume, bit for bit.** Batch i is a function of (seed, i) alone (:class:`StepBatches`), and the loader starts
at the restored global step, so k steps, a restart from ``last.ckpt`` and N − k more give the weights of N
steps in one run (tests/test_eagle3_train.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

from eagle_backbone.eagle3 import Eagle3Drafter
from eagle_backbone.llama import rotate
from eagle_backbone.io import atomic_path, atomic_write_json
from eagle_backbone.runtime import set_threads
from eagle_backbone.target import TargetModel
from eagle_backbone.train.eagle3_curve import learning_curve


def distill(target: TargetModel, prompts: list[tuple[str, list[int]]], max_new_tokens: int, temperature: float,
            seed: int, slots: int = 16, start: int = 0) -> list[dict]:
    """The target's own responses to ``prompts`` ([(id, ids)]): greedy (temperature 0) or sampled with seed
    ``seed * 1_000_003 + start + i`` for prompt i, in batches of ``slots`` (the batched engine, no drafter).
    ``start`` is the first prompt's index in a longer list: distilling a list's tail with ``start`` = the head's
    length gives what distilling the whole list gives (the engine is batch-invariant, seeds are per prompt)."""
    from eagle_backbone.batched_engine import BatchedSpeculativeEngine
    from eagle_backbone.sampling import SamplingConfig

    sampling = SamplingConfig(temperature=temperature)
    out = []
    for a in range(0, len(prompts), slots):
        chunk = prompts[a: a + slots]
        engine = BatchedSpeculativeEngine(target, slots=len(chunk), sampling=sampling)
        gens = engine.generate([p for _, p in chunk], max_new_tokens,
                               seeds=[seed * 1_000_003 + start + a + i for i in range(len(chunk))])
        out += [{"id": cid, "prompt_ids": p, "response_ids": g.tokens} for (cid, p), g in zip(chunk, gens)]
    return out


def blocks_of(records: list[dict], block_size: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, block_size) token ids (right-padded with ``pad_id``) and loss masks (1 on response tokens)."""
    ids = torch.full((len(records), block_size), pad_id, dtype=torch.long)
    mask = torch.zeros(len(records), block_size, dtype=torch.bool)
    for i, r in enumerate(records):
        seq = (r["prompt_ids"] + r["response_ids"])[:block_size]
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, len(r["prompt_ids"]): len(seq)] = True
    return ids, mask


class StepBatches(torch.utils.data.Dataset):
    """Batch i (i = ``start`` .. ``steps`` - 1) of a run: epoch e = i // per_epoch draws its permutation from
    ``(seed, e)``; item i - start is batch i. A function of (seed, i) only, so a resumed run sees the batches
    the uninterrupted one would."""

    def __init__(self, ids, mask, batch_size: int, seed: int, steps: int, start: int = 0):
        if len(ids) < batch_size:
            raise ValueError(f"{len(ids)} distilled blocks for a batch of {batch_size}: distil more prompts")
        self.ids, self.mask, self.bs, self.seed, self.steps, self.start = ids, mask, batch_size, seed, steps, start
        self.per_epoch = len(ids) // batch_size

    def __len__(self) -> int:
        return max(0, self.steps - self.start)

    def __getitem__(self, item: int) -> dict:
        i = self.start + item
        e, b = divmod(i, self.per_epoch)
        perm = torch.randperm(len(self.ids), generator=torch.Generator().manual_seed(self.seed * 100_003 + e))
        rows = perm[b * self.bs: (b + 1) * self.bs]
        return {"input_ids": self.ids[rows], "loss_mask": self.mask[rows], "step": torch.tensor(i)}


def ttt_loss(drafter: Eagle3Drafter, aux: torch.Tensor, input_ids: torch.Tensor, target_logits: torch.Tensor,
             mask: torch.Tensor, steps: int = 7, decay: float = 0.8, return_states: bool = False):
    """The training-time test (module docstring): aux (B, T, k·d), input_ids (B, T), target_logits (B, T, V),
    mask (B, T) response tokens. Returns (loss, per-step losses, per-step top-1 agreement) or, with
    ``return_states``, the states of every step (steps, B, T, d)."""
    B, T = input_ids.shape
    attn = drafter.midlayer.self_attn
    hd, H = attn.head_dim, attn.config.num_attention_heads
    Hkv = attn.k_proj.out_features // hd
    emb = drafter.embed_tokens(input_ids).to(aux.dtype)
    g = drafter.fc(aux)
    draft_ids = drafter.draft_to_target()
    ks, vs, states, losses, top1 = [], [], [], [], []
    total = aux.new_zeros(())
    for k in range(steps):
        n = T - 1 - k  # positions j whose token t_{j+1+k} exists
        if n <= 0:
            break
        x, res = drafter.mix(emb[:, 1 + k:], g[:, :n])
        pos = torch.arange(k, k + n, device=aux.device)[None]
        cos, sin = drafter.rotary_emb(x, pos)
        q, kk, v = (p(x).view(B, n, -1, hd).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, kk = rotate(q, cos[:, None], sin[:, None]), rotate(kk, cos[:, None], sin[:, None])
        ks.append(kk)
        vs.append(v)
        # keys: step 0's pairs 0..j (causal), then each later step's pair at j (the diagonal)
        K = torch.cat([t[:, :, :n] for t in ks], 2).repeat_interleave(H // Hkv, 1)
        V = torch.cat([t[:, :, :n] for t in vs], 2).repeat_interleave(H // Hkv, 1)
        eye = torch.eye(n, dtype=torch.bool, device=aux.device)
        visible = torch.cat([torch.ones(n, n, dtype=torch.bool, device=aux.device).tril()] + [eye] * k, 1)
        out = F.scaled_dot_product_attention(q, K, V, attn_mask=visible, scale=attn.scaling)
        s = drafter.finish(res, out.transpose(1, 2).reshape(B, n, -1))
        states.append(s)
        if not return_states:
            logits = drafter.draft_logits(s).float()
            p = torch.softmax(target_logits[:, 1 + k: 1 + k + n].float()[..., draft_ids], -1)
            m = F.pad(mask[:, 2 + k:], (0, 1)).float()  # the last j predicts past the block: no loss
            ce = -(p * torch.log_softmax(logits, -1)).sum(-1)
            lk = (ce * m).sum() / m.sum().clamp_min(1)
            total = total + decay ** k * lk
            losses.append(lk.detach())
            hit = (logits.argmax(-1) == target_logits[:, 1 + k: 1 + k + n][..., draft_ids].argmax(-1)).float()
            top1.append(((hit * m).sum() / m.sum().clamp_min(1)).detach())
        g = torch.cat([s, s.new_zeros(B, T - n, s.shape[-1])], 1)  # the next step's feature at j: this state
    if return_states:
        return states
    return total, losses, top1


class Eagle3Module(L.LightningModule):
    """The frozen target (features and distributions on the fly) and the EAGLE-3 head it trains. The head's
    embedding and LM head start as the target's (restricted to the draft vocabulary); the embedding stays
    frozen, the LM head trains when ``train_lm_head``. ``init_from``: a head folder whose weights it starts
    from instead (more training for a trained head)."""

    def __init__(self, target_path: str, ttt_steps: int = 7, decay: float = 0.8, lr: float = 1e-3,
                 weight_decay: float = 0.0, warmup_steps: int = 50, schedule_steps: int = 1000,
                 draft_vocab_size: int | None = None, layer_ids=None, train_lm_head: bool = False,
                 target_dtype: str = "float32", draft_ids: list[int] | None = None, init_from: str | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.target = TargetModel.from_pretrained(target_path, dtype=target_dtype)
        self.target.requires_grad_(False)
        cfg = self.target.model.config
        self.drafter = Eagle3Drafter.from_target_config(cfg, draft_vocab_size, layer_ids)
        with torch.no_grad():
            if draft_ids is not None:
                self.drafter.set_vocab(torch.tensor(draft_ids))
            self.drafter.embed_tokens.weight.copy_(self.target.embed_tokens.weight.float())
            self.drafter.lm_head.weight.copy_(self.target.lm_head.weight.float()[self.drafter.draft_to_target()])
            self.drafter.norm.weight.copy_(self.target.model.model.norm.weight.float())
            if init_from:  # continue a trained head (its draft vocabulary and layers must be these)
                self.drafter.load_state_dict(Eagle3Drafter.from_pretrained(init_from, "float32").state_dict())
        self.drafter.lm_head.weight.requires_grad_(train_lm_head)
        self.layers = self.drafter.aux_layers(cfg.num_hidden_layers)

    def restrict_vocab(self, draft_ids) -> None:
        """Restrict the head's draft vocabulary to the target ids ``draft_ids`` and its LM head to the target's rows
        of them (a fresh head whose kept tokens are known only once its data is: :func:`frequent_tokens`)."""
        with torch.no_grad():
            self.drafter.set_vocab(torch.as_tensor(draft_ids))
            self.drafter.lm_head.weight.copy_(self.target.lm_head.weight.float()[self.drafter.draft_to_target()])
        self.hparams["draft_ids"] = [int(i) for i in self.drafter.draft_to_target()]

    def train(self, mode: bool = True):
        super().train(mode)
        self.target.eval()
        return self

    def _losses(self, batch) -> dict[str, torch.Tensor]:
        ids = batch["input_ids"]
        with torch.no_grad():
            out = self.target.model(ids, output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i] for i in self.layers], -1).float()
        loss, per_step, top1 = ttt_loss(self.drafter, aux, ids, out.logits, batch["loss_mask"],
                                        self.hparams.ttt_steps, self.hparams.decay)
        logs = {"loss": loss}
        for k, (lk, ak) in enumerate(zip(per_step, top1)):
            logs[f"ce{k}"], logs[f"top1_{k}"] = lk, ak
        return logs

    def training_step(self, batch, _):
        if int(batch["step"]) != self.global_step:  # the resumable order's invariant (StepBatches)
            raise RuntimeError(f"batch {int(batch['step'])} arrived at step {self.global_step}")
        out = self._losses(batch)
        self.log_dict({f"train/{k}": v for k, v in out.items() if k in ("loss", "top1_0", "top1_6")}, prog_bar=True)
        return out["loss"]

    def validation_step(self, batch, _):
        out = self._losses(batch)
        self.log_dict({f"val/{k}": v for k, v in out.items()}, sync_dist=True)

    def configure_optimizers(self):
        from transformers import get_cosine_schedule_with_warmup

        params = [p for p in self.drafter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, betas=(0.9, 0.95))
        sched = get_cosine_schedule_with_warmup(opt, self.hparams.warmup_steps, self.hparams.schedule_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class DistilledData(L.LightningDataModule):
    """Distilled blocks: training batches by step (:class:`StepBatches`, from the restored global step) and a
    fixed validation set."""

    def __init__(self, train: list[dict], val: list[dict], block_size: int, batch_size: int, seed: int, steps: int,
                 pad_id: int):
        super().__init__()
        self.train_ids, self.train_mask = blocks_of(train, block_size, pad_id)
        self.val_ids, self.val_mask = blocks_of(val, block_size, pad_id)
        self.batch_size, self.seed, self.steps = batch_size, seed, steps

    def train_dataloader(self):
        start = self.trainer.global_step if self.trainer is not None else 0  # restored before the loaders are made
        ds = StepBatches(self.train_ids, self.train_mask, self.batch_size, self.seed, self.steps, start)
        return torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False)

    def val_dataloader(self):
        n = len(self.val_ids) // self.batch_size * self.batch_size
        ds = [{"input_ids": self.val_ids[i: i + self.batch_size], "loss_mask": self.val_mask[i: i + self.batch_size]}
              for i in range(0, n, self.batch_size)]
        return torch.utils.data.DataLoader(ds, batch_size=None)


def frequent_tokens(ids: torch.Tensor, mask: torch.Tensor, n: int, vocab_size: int) -> tuple[list[int], float]:
    """EAGLE-3's reduced draft vocabulary: the ``n`` target tokens most frequent among the training blocks' loss
    tokens (``ids[mask]``, the response tokens a block keeps; ties to the lower id), sorted, and the share of
    those tokens they cover."""
    counts = torch.bincount(ids[mask].flatten(), minlength=vocab_size)
    kept = torch.argsort(-counts, stable=True)[:n].sort().values
    return kept.tolist(), float(counts[kept].sum() / counts.sum().clamp_min(1))


def count_of(value, key: str) -> int | None:
    """A record count from the config: an integer >= 0, or ``all`` (None: every one the split has)."""
    if value == "all":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"drafter_training.{key}: {value!r}: give a count >= 0 or 'all'")
    return value


def distilled_records(cfg, target: TargetModel, tokenizer, split: str) -> list[dict]:
    """The distilled records of ``split`` (train | validation): the target's response to every prompt at each
    of ``cfg.distill.temperatures`` (EAGLE-3's self-distillation: greedy and sampled answers), concatenated in
    that order. Each temperature's records are kept in ``cfg.distill.dir`` as ``<split>-T<temperature>.jsonl``
    beside their settings: the answers to the first n prompts, made in that order. A file made with the same
    other settings serves any count up to n, and a larger count extends it (the answers to prompts n.. are what
    one run over all of them gives, :func:`distill`'s ``start``), saved every ``distill.save_every`` prompts so
    an interrupted run resumes there; other settings make them again. ``distill.prompts: all``: every prompt."""
    from eagle_backbone.data.conversations import build_prompts, load_conversations

    d = cfg.distill
    temperatures = [float(t) for t in d.temperatures]
    if not temperatures or any(t < 0 for t in temperatures) or len(set(temperatures)) != len(temperatures):
        raise ValueError(f"drafter_training.distill.temperatures: {temperatures}: give distinct temperatures >= 0")
    prompts = None
    records = []
    for temperature in temperatures:
        settings = {"split": split, "path": str(cfg.train_path if split == "train" else cfg.validation_path),
                    "prompts": count_of(d.prompts, "distill.prompts") if split == "train"
                    else count_of(d.validation_prompts, "distill.validation_prompts"),
                    "max_prompt_tokens": int(d.max_prompt_tokens), "max_new_tokens": int(d.max_new_tokens),
                    "temperature": temperature, "seed": int(d.seed)}
        want = settings["prompts"]
        out = Path(d.dir) / f"{split}-T{temperature:g}.jsonl"
        have = _kept_records(out, settings)
        if want is None or len(have) < want:
            if prompts is None:
                convs = load_conversations(settings["path"], limit=None)
                prompts = build_prompts(tokenizer, convs, settings["max_prompt_tokens"])
            want = len(prompts) if want is None else min(want, len(prompts))  # no more than the split has
            every = max(1, int(d.get("save_every") or want))
            while len(have) < want:
                n = len(have)
                have += distill(target, list(prompts[n: min(want, n + every)]), settings["max_new_tokens"], temperature,
                                settings["seed"] + (0 if split == "train" else 1), int(d.slots), start=n)
                with atomic_path(out) as tmp:
                    Path(tmp).write_text("".join(json.dumps(r) + "\n" for r in have))
                atomic_write_json(out.with_suffix(".settings.json"), {**settings, "prompts": len(have)}, newline=False)
        records += have[:want]
    return records


def corpus_records(path, tokenizer, limit: int | None, max_prompt_tokens: int) -> list[dict]:
    """Off-policy records: the first ``limit`` (None: every) conversations' first user turn (its chat prompt) and the answer
    the data gives it (``source: corpus``), in the distilled records' form. Conversations without an answer
    after their first user turn, or with a longer prompt, are left out."""
    from eagle_backbone.data.conversations import encode_chat, load_conversations, to_messages

    out = []
    for conv in load_conversations(str(path), limit=None) if limit != 0 else []:
        msgs = to_messages(conv["conversations"])
        i = next((k for k, m in enumerate(msgs) if m["role"] == "user"), None)
        if i is None or i + 1 >= len(msgs) or msgs[i + 1]["role"] != "assistant":
            continue
        prompt, full = encode_chat(tokenizer, msgs[: i + 1], add_generation_prompt=True), encode_chat(tokenizer, msgs[: i + 2])
        if len(prompt) > max_prompt_tokens or full[: len(prompt)] != prompt:
            continue
        out.append({"id": str(conv.get("id")), "prompt_ids": prompt, "response_ids": full[len(prompt):], "source": "corpus"})
        if limit is not None and len(out) >= limit:
            break
    return out


def _kept_records(out: Path, settings: dict) -> list[dict]:
    """The records kept in ``out`` when its settings equal ``settings`` but for the count (a prefix of one
    order), else none."""
    meta = out.with_suffix(".settings.json")
    if not (out.exists() and meta.exists()):
        return []
    kept = json.loads(meta.read_text())
    if {k: v for k, v in kept.items() if k != "prompts"} != {k: v for k, v in settings.items() if k != "prompts"}:
        return []
    lines = out.read_text().splitlines()
    return [json.loads(line) for line in lines[: int(kept.get("prompts", len(lines)))]]


def run_eagle3_training(root_cfg) -> dict:
    """Distil (once), train with the TTT loss (resuming from ``ckpt_dir/last.ckpt``), export the head in
    speculators' layout to ``out_dir`` and, when ``eagle_out_dir`` is set, in EAGLE's there too."""
    from eagle_backbone.loading import load_tokenizer
    from eagle_backbone.train.lm import fit_resumable, run_settings

    cfg = root_cfg.drafter_training
    L.seed_everything(root_cfg.seed, workers=True)
    set_threads(root_cfg.get("threads"))
    tokenizer = load_tokenizer(cfg.tokenizer)
    steps = int(root_cfg.trainer.max_steps)
    module = Eagle3Module(cfg.target, cfg.ttt_steps, cfg.decay, cfg.lr, cfg.weight_decay, cfg.warmup_steps,
                          int(cfg.get("schedule_steps") or steps), cfg.get("draft_vocab_size"),
                          None if cfg.get("layer_ids") is None else [int(i) for i in cfg.layer_ids],  # plain: last.ckpt's hparams load weights-only
                          bool(cfg.train_lm_head), cfg.target_dtype, init_from=cfg.get("init_from"))
    target = module.target
    train, val = distilled_records(cfg, target, tokenizer, "train"), distilled_records(cfg, target, tokenizer, "validation")
    if cfg.get("distill_only"):  # the data alone (a long job of its own; training reuses it)
        return {"kind": "eagle3", "distilled_train_records": len(train), "distilled_val_records": len(val),
                "distill_dir": str(cfg.distill.dir)}
    distilled = len(train)
    corpus = count_of(cfg.get("corpus_text") or 0, "corpus_text")
    train = train + corpus_records(cfg.train_path, tokenizer, corpus, int(cfg.distill.max_prompt_tokens))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    dm = DistilledData(train, val, cfg.block_size, cfg.batch_size, root_cfg.seed, steps, pad)
    coverage = None
    if module.drafter.draft_vocab_size < module.drafter.vocab_size and not cfg.get("init_from"):
        # a fresh head's reduced vocabulary: the training data's most frequent tokens (a continued head keeps its own)
        kept, coverage = frequent_tokens(dm.train_ids, dm.train_mask, module.drafter.draft_vocab_size,
                                         module.drafter.vocab_size)
        module.restrict_vocab(kept)
    curve = learning_curve(cfg, tokenizer, int(cfg.batch_size) * int(cfg.block_size), int(root_cfg.seed))
    settings = run_settings({"seed": root_cfg.seed, **cfg},  # what decides the weights (more steps: a longer run)
                            drop=("out_dir", "eagle_out_dir", "ckpt_dir", "checkpoint_every", "curve", "distill_only",
                                  "export_dtype", "distill.dir", "distill.slots", "distill.save_every"))
    trainer, val_metrics, seconds = fit_resumable(module, dm, root_cfg.trainer, root_cfg.logger, cfg.ckpt_dir,
                                                  root_cfg.resume, every_n_steps=int(cfg.get("checkpoint_every", 50)),
                                                  callbacks=[curve] if curve else [], settings=settings)
    summary = {"kind": "eagle3", "steps": trainer.global_step, "ttt_steps": cfg.ttt_steps, "layers": list(module.layers),
               "train_records": len(train), "distilled_records": distilled, "corpus_records": len(train) - distilled,
               "init_from": cfg.get("init_from"), "val_records": len(val),
               "draft_vocab_size": module.drafter.draft_vocab_size, "draft_vocab_coverage": coverage,
               "distill_temperatures": [float(t) for t in cfg.distill.temperatures], "train_seconds_this_run": seconds,
               "seed": root_cfg.seed, "params": sum(p.numel() for n, p in module.drafter.named_parameters()
                                                    if not n.startswith("embed"))}
    summary.update({k.replace("val/", "val_"): float(v) for k, v in val_metrics.items() if not math.isnan(float(v))})
    if trainer.is_global_zero:
        dtype = getattr(torch, cfg.export_dtype)
        module.drafter.save_pretrained(cfg.out_dir, layout="speculators", dtype=dtype, verifier=str(cfg.target),
                                       speculative_tokens=int(cfg.ttt_steps))
        atomic_write_json(Path(cfg.out_dir) / "training_summary.json", summary, newline=False)
        if cfg.get("eagle_out_dir"):
            module.drafter.save_pretrained(cfg.eagle_out_dir, layout="eagle", dtype=dtype)
    return summary
