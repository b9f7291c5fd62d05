"""Training the LDLP on oracle labels with Lightning.

Data: the oracle collector writes one row per decoding position (last accepted token, label = how many
of k_max greedy drafts the target accepts there, and optionally the target feature f). This module
turns those rows into (last_token, feature, label) examples:

* features stored in the rows are used as they are;
* otherwise one teacher-forced target pass per sequence recomputes them (``feats[0, index - 1]``), and
  the result is cached as a ``datasets`` folder (``feature_cache``) keyed by a fingerprint of the oracle
  manifest, the target and the dtype, so reruns and the DDP worker processes read it back.

The embedding half of the input, the target's input embedding of ``last_token``, is looked up inside
the LightningModule from a frozen copy of the target's embedding table (not saved with the LDLP).

Train/validation are split by conversation: the oracle's own ``split`` column when it has both splits,
else a seeded split of the conversation ids. Then: ``LDLPModule`` (loss per head, cosine schedule with
warm-up), ``ModelCheckpoint`` on the validation loss, early stopping, export of the best weights as a
standalone LDLP folder, and the metrics table (the LDLP next to scikit-learn baselines).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from eagle_backbone.io import atomic_path, atomic_write_json, check_checkpoint
from eagle_backbone.made_for import manifest_made_for
from eagle_backbone.runtime import Clock, set_threads
from ldlp.labels.store import (load_oracle_rows, load_oracle_sequences, read_manifest, require_columns,
                               split_by_conversation)
from ldlp.models.predictor import LDLP, LDLPConfig, ldlp_loss

log = logging.getLogger(__name__)

ROW_COLUMNS = ("last_token", "label", "remaining", "conversation_id", "split")
CACHE_VERSION = 2


# -- oracle data -------------------------------------------------------------------------------------------


def _fingerprint(oracle_dir: Path, target_path: str, feature_dtype: str, num_rows: int) -> str:
    """Changes with the collection, the target (path and its weight files' sizes and times) and the dtype."""
    h = hashlib.sha256()
    h.update((oracle_dir / "manifest.json").read_bytes())
    target = Path(target_path).resolve()
    weights = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in target.glob("*")
                     if p.suffix in (".safetensors", ".bin")) if target.is_dir() else []
    h.update(json.dumps([str(target), weights, feature_dtype, num_rows, CACHE_VERSION]).encode())
    return h.hexdigest()[:16]


def feature_rows(rows, sequences, target, feature_dtype: str = "float32", where: str = "oracle"):
    """Yield rows (``ROW_COLUMNS`` + ``feature``) with features from one target pass per sequence.

    Row semantics: ``feature`` is the target feature at ``index - 1`` of the sequence's ``input_ids``,
    the position whose logits produced ``last_token = input_ids[index]``.
    """
    from tqdm.auto import tqdm

    seq_of_row = rows.select_columns(["seq_id"]).with_format("numpy")[:]["seq_id"]
    order = np.argsort(seq_of_row, kind="stable")
    starts = np.searchsorted(seq_of_row[order], np.unique(seq_of_row), side="left")
    bounds = dict(zip(np.unique(seq_of_row).tolist(), zip(starts, np.append(starts[1:], len(order)))))
    cols = rows.select_columns(["index", *ROW_COLUMNS]).with_format("numpy")[:]
    np_dtype = np.dtype(feature_dtype)
    for seq in tqdm(sequences, desc="target features", leave=False):
        if seq["seq_id"] not in bounds:
            continue
        lo, hi = bounds[seq["seq_id"]]
        row_ids = order[lo:hi]
        ids = torch.tensor(seq["input_ids"], dtype=torch.long)
        index = cols["index"][row_ids].astype(np.int64)
        if index.min() < 1 or index.max() >= len(ids):
            raise ValueError(f"{where}: sequence {seq['seq_id']} has rows with index outside 1..{len(ids) - 1}")
        tokens = ids[torch.from_numpy(index)]
        stored = torch.from_numpy(cols["last_token"][row_ids].astype(np.int64))
        if not torch.equal(tokens, stored):
            raise ValueError(f"{where}: sequence {seq['seq_id']}: last_token does not match input_ids[index] "
                             f"(rows and sequences come from different collections?)")
        _, feats = target(ids[None].to(target.device))
        feats = feats[0, torch.from_numpy(index - 1).to(feats.device)].float().cpu().numpy().astype(np_dtype)
        for j, r in enumerate(row_ids):
            yield {**{c: cols[c][r].item() for c in ROW_COLUMNS}, "feature": feats[j]}


def build_examples(oracle_dir: str | Path, target, cache_dir: str | Path | None, feature_dtype: str = "float32",
                   target_path: str = ""):
    """A ``datasets.Dataset`` with ``ROW_COLUMNS`` + ``feature`` for every oracle row.

    Stored features are used directly; otherwise they are recomputed with ``target`` and cached under
    ``cache_dir`` (rebuilt when the oracle manifest, the target path or the dtype change).
    """
    import datasets

    oracle_dir = Path(oracle_dir)
    read_manifest(oracle_dir)
    rows = load_oracle_rows(oracle_dir)
    require_columns(rows, ("seq_id", "index") + ROW_COLUMNS, oracle_dir)
    if "feature" in rows.column_names:
        return rows.select_columns(list(ROW_COLUMNS) + ["feature"])
    if target is None:
        raise ValueError(f"{oracle_dir}: the rows store no features, so a target model is needed to recompute them")
    fp = _fingerprint(oracle_dir, target_path, feature_dtype, len(rows))
    if cache_dir is not None:
        cache_dir = Path(cache_dir)
        stamp = cache_dir / "fingerprint.json"
        if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == fp:
            return datasets.load_from_disk(str(cache_dir / "examples"))
    features = datasets.Features({
        "last_token": datasets.Value("int64"), "label": datasets.Value("int64"), "remaining": datasets.Value("int64"),
        "conversation_id": datasets.Value("string"), "split": datasets.Value("string"),
        "feature": datasets.List(datasets.Value(feature_dtype))})
    seqs = load_oracle_sequences(oracle_dir)

    def gen():
        yield from feature_rows(rows, seqs, target, feature_dtype, where=str(oracle_dir))

    if cache_dir is None:
        return datasets.Dataset.from_generator(gen, features=features, keep_in_memory=True, fingerprint=fp)
    with atomic_path(cache_dir) as tmp:  # the whole folder: a killed build leaves no half cache
        ds = datasets.Dataset.from_generator(gen, features=features, cache_dir=str(tmp / "build"), fingerprint=fp)
        ds.save_to_disk(str(tmp / "examples"))
        del ds
        shutil.rmtree(tmp / "build", ignore_errors=True)
        atomic_write_json(tmp / "fingerprint.json", {"fingerprint": fp, "oracle_dir": str(oracle_dir),
                                                     "target": target_path}, indent=None)
    return datasets.load_from_disk(str(cache_dir / "examples"))


class OracleDataModule(L.LightningDataModule):
    """Oracle rows as (last_token, feature, label) batches, split by conversation.

    ``prepare_data`` (one process per machine) recomputes and caches features when the rows store none;
    ``setup`` (every process) loads them and checks their size against the model's.
    """

    def __init__(self, oracle_dir: str, feature_dim: int, k_max: int, batch_size: int = 256,
                 val_fraction: float = 0.1, seed: int = 0, num_workers: int = 0, feature_dtype: str = "float32",
                 feature_cache: str | None = None, max_rows: int | None = None, target=None,
                 target_path: str = "", drop_censored: bool = True):
        super().__init__()
        self.drop_censored = drop_censored
        self.oracle_dir, self.feature_dim, self.k_max = Path(oracle_dir), feature_dim, k_max
        self.batch_size, self.val_fraction, self.seed = batch_size, val_fraction, seed
        self.num_workers, self.feature_dtype, self.max_rows = num_workers, feature_dtype, max_rows
        self.feature_cache, self.target, self.target_path = feature_cache, target, target_path
        self.train = self.val = None

    def _examples(self):
        return build_examples(self.oracle_dir, self.target, self.feature_cache, self.feature_dtype,
                              self.target_path)

    def prepare_data(self):
        self._examples()

    def setup(self, stage=None):
        if self.train is not None:
            return
        ds = self._examples()
        if self.max_rows is not None and len(ds) > self.max_rows:
            ds = ds.shuffle(seed=self.seed).select(range(self.max_rows))
        if self.drop_censored:
            # the response ended before the drafts did: label = remaining < k_max only says "at least"
            table = ds.select_columns(["label", "remaining"]).with_format("numpy")[:]
            censored = (table["label"] == table["remaining"]) & (table["remaining"] < self.k_max)
            if censored.any():
                ds = ds.select(np.flatnonzero(~censored))
                log.info("LDLP data: dropped %d censored rows (sequence end within k_max)", censored.sum())
        if len(ds) == 0:
            raise ValueError(f"{self.oracle_dir}: the oracle has no rows")
        d = len(ds[0]["feature"])
        if d != self.feature_dim:
            raise ValueError(f"{self.oracle_dir}: oracle features have size {d} but the LDLP expects "
                             f"{self.feature_dim} (ldlp.input_dim = 2 * {self.feature_dim}); the labels were "
                             f"collected with another target model than model.target, or input_dim is wrong")
        table = ds.with_format("numpy", columns=["last_token", "label", "feature"])[:]
        labels = table["label"].astype(np.int64)
        if labels.min() < 0 or labels.max() > self.k_max:
            raise ValueError(f"{self.oracle_dir}: labels span {labels.min()}..{labels.max()}, outside "
                             f"0..k_max={self.k_max} (ldlp.k_max must be at least the oracle's k_max)")
        meta = ds.select_columns(["conversation_id", "split"]).with_format("numpy")[:]
        is_val = split_by_conversation(meta["conversation_id"], meta["split"], self.val_fraction, self.seed)
        tokens = torch.from_numpy(table["last_token"].astype(np.int64))
        feats = np.stack(table["feature"]) if table["feature"].dtype == object else table["feature"]
        # kept in the stored dtype (float16 halves memory at scale); batches are cast in LDLPModule.inputs
        feats = torch.from_numpy(np.ascontiguousarray(feats))
        labels = torch.from_numpy(labels)
        tr, va = torch.from_numpy(~is_val), torch.from_numpy(is_val)
        self.train = TensorDataset(tokens[tr], feats[tr], labels[tr])
        self.val = TensorDataset(tokens[va], feats[va], labels[va])
        log.info("LDLP data: %d train rows, %d validation rows (by conversation), d=%d", tr.sum(), va.sum(), d)

    def train_dataloader(self):
        # the order of an epoch depends on (seed, epoch) only, so a run resumed from last.ckpt sees the batches an
        # uninterrupted one does (a DataLoader's own generator would restart at epoch 0's order)
        return DataLoader(self.train, batch_size=self.batch_size, sampler=EpochShuffle(len(self.train), self.seed),
                          num_workers=self.num_workers, drop_last=len(self.train) > self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=max(self.batch_size, 1024), num_workers=self.num_workers)


class EpochShuffle(torch.utils.data.Sampler):
    """A shuffle that is a function of (seed, epoch): Lightning calls ``set_epoch`` at the start of every
    epoch, a resumed run's too, so resuming replays the order an uninterrupted run has."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**63)
        return iter(torch.randperm(self.n, generator=g).tolist())


class EpochSeed(L.Callback):
    """Seeds torch's global generator (dropout, anything random in a step) at every epoch's start from (seed,
    epoch): together with :class:`EpochShuffle` and the optimizer, scheduler and callback states Lightning
    keeps in last.ckpt, a run resumed at an epoch boundary (where last.ckpt is written) is bit for bit the
    uninterrupted run. A checkpoint written mid-epoch (``val_check_interval`` < 1 epoch) is not covered."""

    def __init__(self, seed: int):
        self.seed = int(seed)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        # at the epoch's first batch, not at its start: creating the DataLoader's iterator draws from the
        # global generator, and a resumed run creates it at another moment than an uninterrupted one
        if batch_idx == 0:
            torch.manual_seed((self.seed * 1_000_003 + trainer.current_epoch + 7_777_777) % 2**63)


# -- the LightningModule -----------------------------------------------------------------------------------


class LDLPModule(L.LightningModule):
    """Trains an :class:`LDLP`; inputs are [target embedding of last_token; feature]."""

    def __init__(self, config: dict, embedding: torch.Tensor, under_weight: float = 3.0, lr: float = 1e-3,
                 weight_decay: float = 0.01, warmup_ratio: float = 0.05, min_lr_ratio: float = 0.0):
        super().__init__()
        self.save_hyperparameters(ignore=["embedding"])
        self.ldlp = LDLP(LDLPConfig.from_dict(config))
        if embedding is None:  # a subclass whose inputs are whole vectors (StepLDLPModule)
            return
        if embedding.shape[1] != self.ldlp.config.feature_dim:
            raise ValueError(f"the target's embeddings have size {embedding.shape[1]} but the LDLP expects "
                             f"{self.ldlp.config.feature_dim} (ldlp.input_dim = {self.ldlp.config.input_dim})")
        # frozen, not part of the LDLP checkpoint: at decoding time the engine hands over the embedding
        self.register_buffer("embedding", embedding.detach().float().clone(), persistent=False)

    def inputs(self, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.embedding[tokens], feats.float()], dim=-1)

    def setup(self, stage=None):
        # statistics of the training rows (a checkpoint being resumed overwrites what this sets)
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if stage == "fit" and dm is not None and dm.train is not None:
            self.init_from_data(*dm.train.tensors)

    @torch.no_grad()
    def init_from_data(self, *tensors: torch.Tensor, max_rows: int = 200_000) -> None:
        """Standardise inputs with the training rows' mean and std, and start the output layer at the best
        constant predictor (the λ/(1+λ) quantile, the label frequencies, or the empirical continuation
        probabilities), so that short runs on few rows do not spend their steps finding the label scale."""
        *xs, labels = tensors  # the batch layout: the inputs of self.inputs, then the labels
        idx = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))[:max_rows]
        device = self.ldlp.input.weight.device
        x = self.inputs(*(t[idx].to(device) for t in xs))
        self.ldlp.set_normalization(x.mean(0), x.std(0) if len(idx) > 1 else torch.ones_like(x[0]))
        c, y = self.ldlp.config, labels.float()
        bias = self.ldlp.output.bias
        if c.head == "regression":
            q = self.hparams.under_weight / (1 + self.hparams.under_weight)
            bias.fill_(float(torch.quantile(y, q)))
        elif c.head == "classification":
            freq = torch.bincount(labels, minlength=c.k_max + 1)[: c.k_max + 1].float() + 1.0
            bias.copy_((freq / freq.sum()).log())
        else:
            k = torch.arange(1, c.k_max + 1)
            reached = (labels[:, None] >= k).sum(0).float()  # rows with L >= k
            at_risk = (labels[:, None] >= k - 1).sum(0).float()  # rows with L >= k - 1
            bias.copy_(torch.logit((reached + 0.5) / (at_risk + 1.0)))

    def _step(self, batch):
        *xs, labels = batch
        out = self.ldlp(self.inputs(*xs))
        return out, labels, ldlp_loss(self.ldlp, out, labels, self.hparams.under_weight)

    def training_step(self, batch, _):
        _, labels, loss = self._step(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(labels))
        return loss

    def validation_step(self, batch, _):
        out, labels, loss = self._step(batch)
        pred = self.ldlp.length_from_output(out)
        err = pred - labels
        n = len(labels)
        self.log("val/loss", loss, prog_bar=True, batch_size=n, sync_dist=True)
        self.log("val/mae", err.abs().float().mean(), prog_bar=True, batch_size=n, sync_dist=True)
        self.log("val/acc", (err == 0).float().mean(), batch_size=n, sync_dist=True)
        self.log("val/within1", (err.abs() <= 1).float().mean(), batch_size=n, sync_dist=True)
        self.log("val/under", (err < 0).float().mean(), batch_size=n, sync_dist=True)

    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for p in self.ldlp.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.ldlp.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=hp.lr)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = int(hp.warmup_ratio * total)

        def schedule(step: int) -> float:  # linear warm-up, then cosine down to min_lr_ratio
            if step < warmup:
                return (step + 1) / warmup
            t = min(1.0, (step - warmup) / max(1, total - warmup))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# -- the whole run -----------------------------------------------------------------------------------------


def _embedding_table(target) -> torch.Tensor:
    return target.embed_tokens.weight.detach().float().cpu()


@torch.no_grad()
def predict_lengths(ldlp: LDLP, x: torch.Tensor, batch_size: int = 8192) -> np.ndarray:
    ldlp.eval()
    out = [ldlp.length_from_output(ldlp(x[i:i + batch_size])) for i in range(0, len(x), batch_size)]
    return torch.cat(out).cpu().numpy()


def load_best(module: LDLPModule, checkpoint: str, meta: dict) -> LDLP:
    """The LDLP with the weights of the best Lightning checkpoint, on the CPU, in eval mode."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    module.load_state_dict(state, strict=False)  # the embedding table is not in the checkpoint
    ldlp = module.ldlp.cpu().float().eval()
    ldlp.config.meta = {**meta, "best_checkpoint": Path(checkpoint).name}
    return ldlp


def evaluate_against_baselines(ldlp: LDLP, dm: OracleDataModule, embedding: torch.Tensor, under_weight: float,
                               baselines: list[str], max_fit_rows: int | None, seed: int) -> tuple[dict, dict]:
    """Validation metrics of the LDLP and of each baseline, fitted on (a seeded subsample of) the training
    rows with the same [e; f] inputs. Returns (results, {"fit_rows", "seconds"})."""
    from ldlp.training.baselines import evaluate_all

    tokens, feats, y_train = dm.train.tensors
    fit_rows = torch.arange(len(y_train))
    if max_fit_rows is not None and len(fit_rows) > max_fit_rows:
        fit_rows = torch.randperm(len(fit_rows), generator=torch.Generator().manual_seed(seed))[:max_fit_rows]
    x_fit = torch.cat([embedding[tokens[fit_rows]], feats[fit_rows].float()], -1)
    tokens, feats, y_val = dm.val.tensors
    x_val = torch.cat([embedding[tokens], feats.float()], -1)
    seconds = {}
    results = evaluate_all(ldlp_pred=predict_lengths(ldlp, x_val), ldlp_name=f"LDLP ({ldlp.config.head})",
                           x_train=x_fit.numpy(), y_train=y_train[fit_rows].numpy(), x_val=x_val.numpy(),
                           y_val=y_val.numpy(), k_max=ldlp.config.k_max, under_weight=under_weight,
                           baselines=baselines, max_fit_rows=None, seed=seed, seconds=seconds)
    return results, {"fit_rows": len(fit_rows), "seconds": seconds}


def log_results(logger, results: dict, timing: dict | None, step: int) -> None:
    flat = {f"final/{name}/{k}": v for name, m in results.items() for k, v in m.items()}
    if timing:
        flat.update({f"timing/{k}": v for k, v in timing.items() if isinstance(v, (int, float))})
    logger.log_metrics(flat, step=step)
    if hasattr(logger, "log_table"):  # W&B: the table itself, not only the flattened numbers
        cols = ["predictor"] + list(next(iter(results.values())).keys())
        logger.log_table("ldlp_metrics", columns=cols, data=[[n] + list(m.values()) for n, m in results.items()])
    logger.save()


def run_ldlp_training(cfg) -> dict | None:
    """Train, export and evaluate an LDLP as ``cfg`` says (see conf/train_ldlp.yaml): the predictor and
    ``metrics.json`` in ``ldlp_training.out_dir``; returns the summary on the global-zero process (None on the
    other DDP processes), from which scripts/train_ldlp.py renders ``metrics.md`` (ldlp.report.training)."""
    import hydra
    from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
    from omegaconf import OmegaConf

    from eagle_backbone.loading import load_target

    tc, mc = cfg.ldlp_training, cfg.ldlp
    L.seed_everything(cfg.seed, workers=True)
    set_threads(cfg.get("threads"))  # torch and the BLAS pools (scikit-learn's baselines), for the whole run

    # the model's sizes come from the oracle (k_max) and the target (d); explicit values are checked
    manifest = read_manifest(tc.oracle_dir)
    from ldlp.labels.store import require_complete

    collection = require_complete(tc.oracle_dir, bool(cfg.get("allow_partial", False)))  # before any weights load
    if cfg.get("resume") and (Path(tc.ckpt_dir) / "last.ckpt").exists():
        check_checkpoint(Path(tc.ckpt_dir) / "last.ckpt")
    k_max = int(mc.k_max if mc.get("k_max") is not None else manifest["k_max"])
    if k_max < int(manifest["k_max"]):
        raise ValueError(f"ldlp.k_max={k_max} is below the oracle's k_max={manifest['k_max']} "
                         f"({tc.oracle_dir}/manifest.json); leave it null to take the oracle's")
    target = load_target(cfg.model)
    d = target.hidden_size
    input_dim = int(mc.input_dim) if mc.get("input_dim") is not None else 2 * d
    if input_dim != 2 * d:
        raise ValueError(f"ldlp.input_dim={input_dim} does not fit the target {cfg.model.target}: its embeddings "
                         f"and features have size {d}, so input_dim must be {2 * d} (or null)")
    ldlp_config = dict(input_dim=input_dim, hidden_dim=int(mc.hidden_dim), k_max=k_max, head=str(mc.head),
                       num_layers=int(mc.num_layers), dropout=float(mc.dropout), threshold=float(mc.threshold))

    dm = OracleDataModule(tc.oracle_dir, feature_dim=d, k_max=k_max, batch_size=tc.batch_size,
                          val_fraction=tc.val_fraction, seed=cfg.seed, num_workers=tc.num_workers,
                          feature_dtype=tc.feature_dtype, feature_cache=tc.feature_cache, max_rows=tc.max_rows,
                          target=target, target_path=str(cfg.model.target),
                          drop_censored=bool(tc.get("drop_censored", True)))
    module = LDLPModule(ldlp_config, _embedding_table(target), under_weight=float(mc.under_weight), lr=tc.lr,
                        weight_decay=tc.weight_decay, warmup_ratio=tc.warmup_ratio, min_lr_ratio=tc.min_lr_ratio)
    es = tc.early_stopping
    ckpt = ModelCheckpoint(dirpath=tc.ckpt_dir, filename="best", monitor=es.monitor, mode=es.mode, save_top_k=1,
                           save_last=True, enable_version_counter=False)
    callbacks = [ckpt, LearningRateMonitor("step"), EpochSeed(cfg.seed)]  # resume=true replays an uninterrupted run
    if es.patience is not None:
        callbacks.append(EarlyStopping(monitor=es.monitor, mode=es.mode, patience=es.patience))
    logger = hydra.utils.instantiate(cfg.logger)
    trainer = hydra.utils.instantiate(cfg.trainer, logger=logger, callbacks=callbacks)
    last = Path(tc.ckpt_dir) / "last.ckpt"
    clock = Clock()
    start = clock()
    resumed = last.exists()  # before fit writes one
    trainer.fit(module, datamodule=dm, ckpt_path=str(last) if cfg.get("resume") and last.exists() else None)
    train_s = clock() - start
    if not trainer.is_global_zero:
        return None

    meta = {"target": str(cfg.model.target), "model_name": str(cfg.model.get("name", "")),
            "oracle_dir": str(tc.oracle_dir), "under_weight": float(mc.under_weight),
            "epochs": trainer.current_epoch, "steps": trainer.global_step, "seed": int(cfg.seed),
            "allow_partial": collection["allow_partial"], "oracle_collection": collection,
            # resume=true continues bit for bit (EpochShuffle, EpochSeed, last.ckpt written at epoch ends)
            "resumed_from": str(last) if cfg.get("resume") and resumed else None,
            "made_for": manifest_made_for(manifest)}  # checked where a policy would load it (eagle_backbone/made_for.py)
    ldlp = load_best(module, ckpt.best_model_path or str(last), meta)

    ev = tc.evaluation
    results, fits = evaluate_against_baselines(ldlp, dm, module.embedding.cpu(), float(mc.under_weight),
                                               list(ev.baselines), ev.max_fit_rows, int(cfg.seed))
    timing = None
    if ev.benchmark:
        from ldlp.models.policy_cost import benchmark_ldlp

        from ldlp.models.policy_cost import HISTORY_FILE

        timing = benchmark_ldlp(ldlp, target, context_len=ev.benchmark_context, reps=ev.benchmark_reps,
                                history=Path(tc.out_dir) / HISTORY_FILE)
    summary = {"head": ldlp.config.head, "k_max": k_max, "input_dim": input_dim, "seed": int(cfg.seed),
               "oracle_collection": collection, "train_rows": len(dm.train), "val_rows": len(dm.val), "baseline_fit_rows": fits["fit_rows"],
               "epochs": trainer.current_epoch, "steps": trainer.global_step, "train_seconds": train_s,
               "baseline_seconds": fits["seconds"], "under_weight": float(mc.under_weight), "results": results,
               "timing": timing, "config": OmegaConf.to_container(cfg.ldlp, resolve=True)}
    atomic_write_json(Path(tc.out_dir) / "metrics.json", summary)
    if logger is not None:
        log_results(logger, results, timing, trainer.global_step)
    # the standalone checkpoint the `ldlp` policy loads; written last, so that its presence means "done" (the page,
    # metrics.md, is only metrics.json rendered: scripts/train_ldlp.py writes it after)
    ldlp.cpu().save_pretrained(tc.out_dir)
    return summary
