"""The LDLP on every feature: AdaEAGLE's network (:class:`~ldlp.models.predictor.LDLP`, distribution head) trained
with Lightning on :func:`~ldlp.models.features.step_features` vectors recorded by replay (the predictor study,
``ldlp/bench/predictors.py``, and the shipped predictor, ``scripts/train_step_ldlp.py``).

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
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    L.seed_everything(seed, workers=True, verbose=False)
    seqs = np.unique(seq)
    held = np.random.default_rng(seed).permutation(seqs)[: max(1, int(round(val_fraction * len(seqs))))]
    is_val = np.isin(seq, held)
    if is_val.all() or not is_val.any():
        is_val = np.arange(len(seq)) % 10 == 0  # too few sequences to hold whole ones out
    y = torch.as_tensor(np.minimum(label, k_max), dtype=torch.long)
    xt = torch.as_tensor(np.asarray(x, dtype=np.float32))
    tr, va = ~torch.as_tensor(is_val), torch.as_tensor(is_val)
    config = {"input_dim": int(xt.shape[1]), "hidden_dim": hidden_dim, "k_max": k_max, "head": "distribution",
              "num_layers": num_layers, "inputs": list(inputs), "meta": dict(meta or {})}
    module = StepLDLPModule(config, lr=lr)
    module.init_from_data(xt[tr], y[tr])
    g = torch.Generator().manual_seed(seed)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xt[tr], y[tr]), batch_size=batch_size,
                                        shuffle=True, generator=g)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xt[va], y[va]), batch_size=4096)
    best = ModelCheckpoint(monitor="val/loss", mode="min", save_top_k=1, enable_version_counter=False)
    trainer = L.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True, default_root_dir=_scratch(),
                        callbacks=[EarlyStopping("val/loss", patience=patience), best])
    trainer.fit(module, train, val)
    state = torch.load(best.best_model_path, map_location="cpu", weights_only=True)["state_dict"]
    module.load_state_dict(state)
    return module.ldlp.eval()


def _scratch() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="step_ldlp_")


def build_step_ldlp(cfg, pair=None, command: str | None = None) -> dict:
    """``scripts/train_step_ldlp.py``: record feature vectors by replay over the collection's train split,
    train the LDLP on every feature, find the seconds a token is worth (its ratio to a plain step, the policy's
    starting point), score it on the validation split, and save the folder ``policy=learned`` loads."""
    from pathlib import Path

    from eagle_backbone.loading import load_pair
    from ldlp.bench.loaders import replay_costs
    from ldlp.bench.predictors import load_split, record_examples, scores, token_seconds
    from ldlp.bench.replay import costs_record
    from ldlp.labels.store import read_manifest
    from ldlp.policies.learned import step_seconds_table

    manifest = read_manifest(cfg.oracle_dir)
    pair = pair or load_pair(cfg.model)
    costs = replay_costs(cfg.costs, cfg.model.name, pair, "train_step_ldlp")
    groups = list(cfg.groups)
    train = load_split(cfg.oracle_dir, "train", cfg.get("max_train_sequences"))
    val = load_split(cfg.oracle_dir, "validation", cfg.get("max_val_sequences"))
    tr = record_examples(train, cfg.behaviours, groups, costs, pair.target.embed, pair.target.vocab_size)
    va = record_examples(val, cfg.behaviours, groups, costs, pair.target.embed, pair.target.vocab_size)
    ldlp = fit_step_ldlp(tr.x, tr.label, tr.seq, groups, int(cfg.K), int(cfg.seed), hidden_dim=int(cfg.hidden_dim),
                         num_layers=int(cfg.num_layers), max_epochs=int(cfg.max_epochs), batch_size=int(cfg.batch_size),
                         lr=float(cfg.lr))
    seconds = step_seconds_table(costs, train.k_max)
    calib = train if cfg.get("calibration_sequences") is None else _first_sequences(train, int(cfg.calibration_sequences))
    from ldlp.bench.predictors import static_and_oracle

    best_static = max(v for k, v in static_and_oracle(calib, costs, range(1, int(cfg.K) + 1), int(cfg.K)).items()
                      if k.startswith("static"))
    token_s = token_seconds(calib, _Survival(ldlp), groups, costs, pair.target.embed, pair.target.vocab_size,
                            1.0 / best_static, max_gamma=int(cfg.K))
    sc = scores(ldlp.survival_of(va.x), va.label)
    meta = {"token_ratio": token_s / float(seconds[0, 0]), "groups": groups, "behaviours": list(cfg.behaviours),
            "oracle_dir": str(cfg.oracle_dir), "oracle_counts": manifest.get("counts"),
            "oracle_identity": manifest.get("identity"), "costs": costs_record(costs),
            "train_examples": len(tr), "validation_examples": len(va), "seed": int(cfg.seed),
            "validation": sc, "command": command}
    ldlp.config.meta = meta
    out = Path(cfg.out_dir)
    ldlp.save_pretrained(out)
    return {"out_dir": str(out), **meta}


class _Survival:
    def __init__(self, ldlp):
        self.survival = ldlp.survival_of


def _first_sequences(rows, n: int):
    from ldlp.bench.predictors import _rows_subset

    return _rows_subset(rows, np.unique(rows.cols["seq_id"])[:n], rows.max_new_tokens)
