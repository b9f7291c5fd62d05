"""The LDLP on every feature: AdaEAGLE's network (:class:`~ldlp.models.predictor.LDLP`, distribution head) trained
with Lightning on :func:`~ldlp.models.features.step_features` vectors recorded by replay
(:func:`ldlp.bench.comparisons.predictors.record_examples`): the predictor study's ``ldlp`` model and the shipped
predictor (``scripts/train_step_ldlp.py``, which records, fits here and calibrates).

The data are whole arrays in memory (a few hundred thousand steps of a few hundred values); the validation rows
are whole sequences held out of the training ones, for early stopping on the held-out likelihood.
"""

from __future__ import annotations

import numpy as np
import torch

from ldlp.models.predictor import LDLP, LDLPConfig
from ldlp.training.predictor import LDLPModule


class StepLDLPModule(LDLPModule):
    """:class:`LDLPModule` whose batches are (feature vectors, labels)."""

    def __init__(self, config: dict, lr: float = 1e-3, weight_decay: float = 0.01, warmup_ratio: float = 0.05,
                 min_lr_ratio: float = 0.0):
        super().__init__(config, None, 0.0, lr, weight_decay, warmup_ratio, min_lr_ratio)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()

    def setup(self, stage=None):  # fit_step_ldlp standardises from its training rows before fitting
        pass


def fit_step_ldlp(x: np.ndarray, label: np.ndarray, seq: np.ndarray, inputs, k_max: int, seed: int = 0,
                  hidden_dim: int = 256, num_layers: int = 3, max_epochs: int = 30, batch_size: int = 512,
                  lr: float = 1e-3, val_fraction: float = 0.1, patience: int = 3, meta: dict | None = None) -> LDLP:
    """Train an LDLP (distribution head over lengths 0..k_max) on ``x`` (n, F) feature vectors (:func:`~ldlp.models.features.step_features`) of the groups
    ``inputs``; ``seq`` the sequence of each row (a seeded ``val_fraction`` of sequences validates). Returns the
    model of the best validation loss, in eval mode."""
    import lightning as L

    L.seed_everything(seed, workers=True, verbose=False)
    tr, va = _held_out(seq, seed, val_fraction)
    y = torch.as_tensor(np.minimum(label, k_max), dtype=torch.long)
    xt = torch.as_tensor(np.asarray(x, dtype=np.float32))
    config = {"input_dim": int(xt.shape[1]), "hidden_dim": hidden_dim, "k_max": k_max, "head": "distribution",
              "num_layers": num_layers, "inputs": list(inputs), "meta": dict(meta or {})}
    module = StepLDLPModule(config, lr=lr)
    module.init_from_data(xt[tr], y[tr])
    _fit_best(module, (xt[tr], y[tr]), (xt[va], y[va]), seed, batch_size, max_epochs, patience)
    return module.ldlp.eval()


def _held_out(seq: np.ndarray, seed: int, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) row masks: a seeded ``val_fraction`` of whole sequences validates (every tenth row when
    there are too few sequences to hold whole ones out)."""
    seqs = np.unique(seq)
    held = np.random.default_rng(seed).permutation(seqs)[: max(1, int(round(val_fraction * len(seqs))))]
    is_val = np.isin(seq, held)
    if is_val.all() or not is_val.any():
        is_val = np.arange(len(seq)) % 10 == 0
    return ~torch.as_tensor(is_val), torch.as_tensor(is_val)


def _fit_best(module, train: tuple, val: tuple, seed: int, batch_size: int, max_epochs: int, patience: int) -> None:
    """Fit ``module`` with Lightning on the (inputs, labels) tensors, early stopping on the validation loss, and
    load the weights of its best validation loss."""
    import lightning as L
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    g = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*train), batch_size=batch_size, shuffle=True,
                                         generator=g)
    held = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*val), batch_size=4096)
    best = ModelCheckpoint(monitor="val/loss", mode="min", save_top_k=1, enable_version_counter=False)
    trainer = L.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True, default_root_dir=_scratch(),
                        callbacks=[EarlyStopping("val/loss", patience=patience), best])
    trainer.fit(module, loader, held)
    state = torch.load(best.best_model_path, map_location="cpu", weights_only=True)["state_dict"]
    module.load_state_dict(state)


def _scratch() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="step_ldlp_")


def _history_module(model, x: torch.Tensor, lr: float, weight_decay: float = 0.01):
    """A LightningModule training ``model`` (:class:`~ldlp.models.step_history.StepHistoryGRU`) on batches of
    window indices into ``x``, every row's vector held once in memory."""
    import lightning as L

    from ldlp.models.predictor import survival_nll
    from ldlp.models.step_history import gather

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.x = model, x  # x: every row's vector; batches are window indices into it

        def _loss(self, batch):
            idx, y = batch
            xw, present = gather(self.x, idx)
            return survival_nll(self.model(xw, present), y), len(y)

        def training_step(self, batch, _):
            loss, n = self._loss(batch)
            self.log("train/loss", loss, batch_size=n)
            return loss

        def validation_step(self, batch, _):
            loss, n = self._loss(batch)
            self.log("val/loss", loss, batch_size=n)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
            total = max(1, int(self.trainer.estimated_stepping_batches))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, total),
                                                       "interval": "step"}}

    return Module()


def fit_step_history(x: np.ndarray, label: np.ndarray, seq: np.ndarray, stream: np.ndarray, k_max: int, seed: int = 0,
                     window: int = 8, hidden: int = 64, max_epochs: int = 20, batch_size: int = 512, lr: float = 2e-3,
                     val_fraction: float = 0.1, patience: int = 3):
    """Train a :class:`~ldlp.models.step_history.StepHistoryGRU` on ``x`` (n, F) step vectors whose ``stream``
    (a behaviour's walk of one sequence; contiguous, in step order) gives each row's history; a seeded
    ``val_fraction`` of sequences validates (early stopping on the held-out likelihood). Returns the model of the
    best validation loss, in eval mode."""
    import lightning as L

    from ldlp.models.step_history import StepHistoryConfig, StepHistoryGRU, windows

    L.seed_everything(seed, workers=True, verbose=False)
    tr, va = _held_out(seq, seed, val_fraction)
    xt = torch.as_tensor(np.asarray(x, dtype=np.float32))
    idx = torch.as_tensor(windows(stream, window))
    y = torch.as_tensor(np.minimum(label, k_max), dtype=torch.long)
    model = StepHistoryGRU(StepHistoryConfig(int(xt.shape[1]), k_max, window, hidden))
    sample = xt[tr][torch.randperm(int(tr.sum()), generator=torch.Generator().manual_seed(0))[:200_000]]
    model.set_normalization(sample.mean(0), sample.std(0))
    with torch.no_grad():  # start at the empirical continuation probabilities (as the LDLP's distribution head)
        k = torch.arange(1, k_max + 1)
        reached, at_risk = (y[tr, None] >= k).sum(0).float(), (y[tr, None] >= k - 1).sum(0).float()
        model.output.bias.copy_(torch.logit((reached + 0.5) / (at_risk + 1.0)))
    module = _history_module(model, xt, lr)
    _fit_best(module, (idx[tr], y[tr]), (idx[va], y[va]), seed, batch_size, max_epochs, patience)
    return model.eval()
