"""Training the EAGLE-1 drafter with Lightning, on target features computed on the fly.

For a block of tokens s_0..s_{T-1} the frozen target gives features f_0..f_{T-1} and logits. The
drafter reads pairs (s_{j+1}, f_j + noise) and predicts f̂_{j+1}; the loss is EAGLE's

    SmoothL1(f̂_{j+1}, f_{j+1}) * w_reg  +  CE(softmax(target logits_{j+1}), lm_head(f̂_{j+1})) * w_cls

with w_reg = 1.0 and w_cls = 0.1. Uniform noise on the input features makes the drafter robust to
its own errors when it later feeds back predicted features. Computing features on the fly costs one
no-grad target forward per batch and no disk; that is the right trade for the embedded pair and for
a 7B target on a GPU alike.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

from eagle_backbone.drafter import EagleDrafter
from eagle_backbone.io import atomic_write_json
from eagle_backbone.runtime import set_threads
from eagle_backbone.target import TargetModel


class DrafterModule(L.LightningModule):
    def __init__(self, target_path: str, bias: bool = True, lr: float = 1e-3, weight_decay: float = 0.0,
                 warmup_steps: int = 100, max_steps: int = 1000, reg_weight: float = 1.0, cls_weight: float = 0.1,
                 noise: float = 0.1, target_dtype: str = "float32"):
        super().__init__()
        self.save_hyperparameters()
        self.target = TargetModel.from_pretrained(target_path, dtype=target_dtype)
        self.target.requires_grad_(False)
        self.drafter = EagleDrafter.from_target_config(self.target.model.config, bias=bias)
        self.drafter.embed_tokens.weight.data.copy_(self.target.embed_tokens.weight.data.float())

    def train(self, mode: bool = True):
        super().train(mode)
        self.target.eval()  # frozen: no dropout, whatever Lightning does to the module tree
        return self

    def _losses(self, input_ids: torch.Tensor, noise: float) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            logits, feats = self.target(input_ids)
            feats, target_probs = feats.float(), torch.softmax(logits[:, 1:].float(), dim=-1)
        inp = feats[:, :-1]
        if noise > 0:
            inp = inp + (torch.rand_like(inp) * 2 - 1) * noise
        pred = self.drafter(input_ids[:, 1:], inp)  # f̂_1..f̂_{T-1}
        reg = F.smooth_l1_loss(pred, feats[:, 1:])
        draft_logits = self.target.lm_head(pred.to(self.target.dtype)).float()
        cls = -(target_probs * torch.log_softmax(draft_logits, dim=-1)).sum(-1).mean()
        # top-1 agreement of the *next token* (the position after f̂), EAGLE's accuracy metric
        top1 = (draft_logits.argmax(-1) == logits[:, 1:].argmax(-1)).float().mean()
        loss = self.hparams.reg_weight * reg + self.hparams.cls_weight * cls
        return {"loss": loss, "reg": reg, "cls": cls, "top1": top1}

    def training_step(self, batch, _):
        out = self._losses(batch["input_ids"], self.hparams.noise)
        self.log_dict({f"train/{k}": v for k, v in out.items()}, prog_bar=True)
        return out["loss"]

    def validation_step(self, batch, _):
        out = self._losses(batch["input_ids"], 0.0)
        self.log_dict({f"val/{k}": v for k, v in out.items()}, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        from transformers import get_cosine_schedule_with_warmup

        params = [p for p in self.drafter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, betas=(0.9, 0.95))
        sched = get_cosine_schedule_with_warmup(opt, self.hparams.warmup_steps, self.hparams.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def run_drafter_training(root_cfg) -> dict:
    """Train a drafter for ``drafter_training.target`` and export it in EAGLE's checkpoint format."""
    from eagle_backbone.loading import load_tokenizer
    from eagle_backbone.train.lm import LMDataModule, fit_resumable, run_settings

    cfg = root_cfg.drafter_training
    L.seed_everything(root_cfg.seed, workers=True)
    set_threads(root_cfg.get("threads"))

    tokenizer = load_tokenizer(cfg.tokenizer)
    dm = LMDataModule(tokenizer, cfg.train_path, cfg.validation_path, cfg.block_size, cfg.batch_size,
                      root_cfg.seed, cfg.max_conversations, cfg.validation_fraction,
                      chat_template=root_cfg.data.get("chat_template"), on_error=root_cfg.data.get("on_error", "raise"))
    module = DrafterModule(cfg.target, bias=cfg.bias, lr=cfg.lr, weight_decay=cfg.weight_decay,
                           warmup_steps=cfg.warmup_steps, max_steps=root_cfg.trainer.max_steps,
                           reg_weight=cfg.reg_weight, cls_weight=cfg.cls_weight, noise=cfg.noise,
                           target_dtype=cfg.target_dtype)
    settings = run_settings({"seed": root_cfg.seed, **cfg},
                            drop=("out_dir", "ckpt_dir", "export_dtype"))
    trainer, val, seconds = fit_resumable(module, dm, root_cfg.trainer, root_cfg.logger, cfg.ckpt_dir,
                                          root_cfg.resume, settings=settings)
    summary = {"steps": trainer.global_step, "tokens_seen": trainer.global_step * cfg.batch_size * cfg.block_size,
               "val_top1": val["val/top1"], "val_reg": val["val/reg"], "val_cls": val["val/cls"],
               "params": sum(p.numel() for n, p in module.drafter.named_parameters() if not n.startswith("embed")),
               "train_seconds_this_run": seconds, "seed": root_cfg.seed}
    if trainer.is_global_zero:
        out = Path(cfg.out_dir)
        module.drafter.save_pretrained(out, safe_serialization=True, dtype=getattr(torch, cfg.export_dtype))
        atomic_write_json(out / "training_summary.json", summary, newline=False)
    return summary

