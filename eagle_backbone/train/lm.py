"""Causal-LM pretraining with Lightning: the embedded target and the standalone draft LM.

Conversations are rendered with the tokenizer's chat template, tokenised with ``datasets.map`` and
packed into fixed blocks (the usual ``group_texts`` recipe), then a ``LlamaForCausalLM`` learns them.
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from eagle_backbone.data.conversations import encode_chat, to_messages
from eagle_backbone.io import atomic_path, atomic_write_json, check_checkpoint
from eagle_backbone.runtime import Clock, set_threads


def packed_blocks(tokenizer, conversations: list[dict], block_size: int, num_proc: int | None = None,
                  chat_template: str | None = None) -> Dataset:
    """Render, tokenise and pack conversations into ``block_size`` token blocks (tail dropped)."""
    from eagle_backbone.data.conversations import resolve_chat_template

    template = resolve_chat_template(tokenizer, chat_template)
    # encode_chat: the template's special tokens are special, a literal </s> in a message is text
    ds = Dataset.from_dict({"messages": [to_messages(c["conversations"]) for c in conversations]})
    ds = ds.map(lambda b: {"input_ids": [encode_chat(tokenizer, m, chat_template=template) for m in b["messages"]]},
                batched=True, remove_columns=["messages"], num_proc=num_proc)

    def group(batch):
        ids = [t for seq in batch["input_ids"] for t in seq]
        n = len(ids) // block_size * block_size
        return {"input_ids": [ids[i:i + block_size] for i in range(0, n, block_size)]}

    ds = ds.map(group, batched=True, batch_size=2000, remove_columns=ds.column_names)
    return ds.with_format("torch")


class LMDataModule(L.LightningDataModule):
    """Packed blocks from two conversation files (ShareGPT layout: the embedded corpus or ShareGPT)."""

    def __init__(self, tokenizer, train_path: str, validation_path: str | None, block_size: int, batch_size: int,
                 seed: int = 0, max_conversations: int | None = None, validation_fraction: float = 0.02,
                 chat_template: str | None = None, on_error: str = "raise"):
        super().__init__()
        self.tokenizer, self.paths, self.block_size = tokenizer, (train_path, validation_path), block_size
        self.batch_size, self.seed, self.max_conversations = batch_size, seed, max_conversations
        self.validation_fraction, self.chat_template, self.on_error = validation_fraction, chat_template, on_error

    def setup(self, stage=None):
        if hasattr(self, "train"):
            return
        from eagle_backbone.data.conversations import held_out, load_conversations

        train = load_conversations(self.paths[0], limit=self.max_conversations, on_error=self.on_error)
        if self.paths[1]:
            val = load_conversations(self.paths[1], limit=self.max_conversations, on_error=self.on_error)
        else:  # hold out a stable fraction of conversations (by id hash) from the one file
            pct = self.validation_fraction * 100
            val = [c for c in train if held_out(c["id"], pct, self.seed)]
            train = [c for c in train if not held_out(c["id"], pct, self.seed)]
        self.train = packed_blocks(self.tokenizer, train, self.block_size, chat_template=self.chat_template)
        self.val = packed_blocks(self.tokenizer, val, self.block_size, chat_template=self.chat_template)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, generator=g, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size)


class CausalLMModule(L.LightningModule):
    """Wraps a ``LlamaForCausalLM``; logs loss and perplexity; cosine schedule with warmup."""

    def __init__(self, model_config: dict, lr: float = 1e-3, weight_decay: float = 0.1,
                 warmup_steps: int = 100, max_steps: int = 1000):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.save_hyperparameters()
        self.model = LlamaForCausalLM(LlamaConfig(**model_config))

    def training_step(self, batch, _):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, _):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", torch.exp(loss), sync_dist=True)

    def configure_optimizers(self):
        from transformers import get_cosine_schedule_with_warmup

        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.hparams.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=self.hparams.lr, betas=(0.9, 0.95))
        sched = get_cosine_schedule_with_warmup(opt, self.hparams.warmup_steps, self.hparams.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def export_hf(model, tokenizer, out_dir: str | Path, dtype: str = "bfloat16") -> None:
    """Save a Hugging Face folder (safetensors) that ``AutoModelForCausalLM.from_pretrained`` loads."""
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    with atomic_path(out_dir) as tmp:  # the whole folder, so a killed export leaves the old one
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    model.to(torch.float32)


def run_lm_training(cfg) -> dict:
    """Train ``cfg.lm`` on the corpus, resuming from ``cfg.ckpt_dir/last.ckpt``; export a HF folder."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    L.seed_everything(cfg.seed, workers=True)
    set_threads(cfg.get("threads"))
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    if len(tokenizer) != cfg.lm.config.vocab_size:
        raise ValueError(f"tokenizer at {cfg.tokenizer} has {len(tokenizer)} tokens but lm.config.vocab_size "
                         f"is {cfg.lm.config.vocab_size}; set vocab_size={len(tokenizer)}")
    dm = LMDataModule(tokenizer, cfg.train_path, cfg.validation_path, cfg.block_size, cfg.batch_size, cfg.seed,
                      cfg.max_conversations)
    module = CausalLMModule(OmegaConf.to_container(cfg.lm.config, resolve=True), lr=cfg.lr,
                            weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
                            max_steps=cfg.trainer.max_steps)
    settings = run_settings({"seed": cfg.seed, "lm": cfg.lm,
                             **{k: cfg[k] for k in ("train_path", "block_size", "batch_size", "lr", "weight_decay",
                                                    "warmup_steps", "max_conversations")}})
    trainer, val, seconds = fit_resumable(module, dm, cfg.trainer, cfg.logger, cfg.ckpt_dir, cfg.resume,
                                          settings=settings)
    summary = {"name": cfg.lm.name, "params": sum(p.numel() for p in module.model.parameters()),
               "steps": trainer.global_step, "tokens_seen": trainer.global_step * cfg.batch_size * cfg.block_size,
               "val_loss": val["val/loss"], "val_ppl": math.exp(val["val/loss"]),
               "train_seconds_this_run": seconds, "seed": cfg.seed,
               "config": OmegaConf.to_container(cfg.lm.config, resolve=True)}
    if trainer.is_global_zero:
        export_hf(module.model, tokenizer, cfg.lm.out_dir, cfg.export_dtype)
        atomic_write_json(Path(cfg.lm.out_dir) / "training_summary.json", summary, newline=False)
    return summary


RUN_SETTINGS = "run_settings.json"  # beside last.ckpt: the settings of the run that made it


def run_settings(node, drop=()) -> dict:
    """The settings that decide a run's weights: config ``node`` resolved, without the keys in ``drop`` (dotted:
    where results go, how often to checkpoint or measure). The step count is not one of them: a rerun with more
    ``trainer.max_steps`` extends the run."""
    from omegaconf import OmegaConf

    flat = {}

    def walk(prefix, value):
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        elif prefix[:-1] not in drop and not any(prefix.startswith(d + ".") for d in drop):
            flat[prefix[:-1]] = value

    walk("", node)
    return flat


def check_run_settings(ckpt_dir: Path, settings: dict, resuming: bool) -> None:
    """Refuse to resume a ``last.ckpt`` made with other settings (another recipe left in the same ``ckpt_dir``
    would otherwise go on with its own optimiser, schedule and step), in one line naming what differs; record
    this run's settings when it starts afresh."""
    path = ckpt_dir / RUN_SETTINGS
    if resuming and path.exists():
        import json

        kept = json.loads(path.read_text())
        diff = [f"{k}: {kept.get(k, '(unset)')!r} -> {settings.get(k, '(unset)')!r}"
                for k in sorted(set(kept) | set(settings)) if kept.get(k) != settings.get(k)]
        if diff:
            raise ValueError(f"{ckpt_dir / 'last.ckpt'}: made with other settings ({'; '.join(diff[:4])}"
                             f"{f'; {len(diff) - 4} more' if len(diff) > 4 else ''}); pass resume=false to train from "
                             "the start, or give this run its own ckpt_dir")
    elif not resuming:
        atomic_write_json(path, settings, newline=False)


def fit_resumable(module, datamodule, trainer_cfg, logger_cfg, ckpt_dir, resume: bool, every_n_steps: int = 50,
                  callbacks=(), settings: dict | None = None):
    """Fit with a ``last.ckpt`` every ``every_n_steps`` steps in ``ckpt_dir``, resuming from it when asked; then
    validate. ``callbacks``: more Lightning callbacks. ``settings`` (:func:`run_settings`): what decides the
    weights, kept beside the checkpoint; a resume with other settings is refused (:func:`check_run_settings`).
    Returns (trainer, validation metrics, seconds this run)."""
    import hydra
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    ckpt_dir = Path(ckpt_dir)
    last = ckpt_dir / "last.ckpt"
    resuming = bool(resume and last.exists())
    if resuming:
        check_checkpoint(last)  # a torn one: one line, not PytorchStreamReader's traceback
    if settings is not None:  # before the trainer exists: nothing written or started for a refused run
        check_run_settings(ckpt_dir, settings, resuming)
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=every_n_steps, save_top_k=0)
    trainer = hydra.utils.instantiate(trainer_cfg, logger=hydra.utils.instantiate(logger_cfg),
                                      callbacks=[ckpt, LearningRateMonitor("step"), *callbacks])
    clock = Clock()
    start = clock()
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(last) if resuming else None)
    val = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    return trainer, val, clock() - start
