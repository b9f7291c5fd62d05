"""Fit the acceptance head (:class:`ldlp.models.acceptance.AcceptanceHead`) on oracle rows with scikit-learn
(``python scripts/train_acceptance.py``): one example per row and draft step whose outcome the labels know."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from eagle_backbone.io import atomic_write_json
from eagle_backbone.runtime import Clock
from ldlp.models.acceptance import AcceptanceHead, AcceptanceHeadConfig
from ldlp.labels.store import read_rows, split_by_conversation


def examples(label: np.ndarray, remaining: np.ndarray, top1: np.ndarray, states: np.ndarray,
             k_max: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One example per row and step ``m = 1 .. k_max-1`` whose outcome the labels know.

    ``label``/``remaining`` (R,), ``top1`` (R, k_max) the drafter's probability of each greedy draft,
    ``states`` (R, k_max, d). Returns ``states`` (n, d), ``stats`` (n, 3), the outcome ``label >= m+1``
    (n,) and the row of each example. A row whose response ends before step ``m+1`` (``remaining <= m``)
    cannot tell whether the draft would have been kept, so it gives no example for that step.
    """
    log_p = np.log(np.clip(top1.astype(np.float64), 1e-6, None))  # clip_log_p, vectorised
    cum = np.cumsum(log_p, axis=1)
    X, S, Y, rows = [], [], [], []
    for m in range(1, k_max):
        ok = np.flatnonzero(remaining >= m + 1)
        X.append(states[ok, m - 1])
        S.append(np.stack([log_p[ok, m - 1], cum[ok, m - 1], np.full(len(ok), m)], 1))
        Y.append(label[ok] >= m + 1)
        rows.append(ok)
    d = states.shape[-1]
    cat = lambda xs, shape: np.concatenate(xs) if xs else np.zeros(shape)  # noqa: E731
    return (cat(X, (0, d)).astype(np.float32), cat(S, (0, 3)).astype(np.float32), cat(Y, (0,)).astype(bool),
            cat(rows, (0,)).astype(np.int64))


def load_rows(oracle_dir: str | Path) -> dict:
    """The oracle rows an acceptance head trains on (numpy), with states reshaped to (R, k_max, d)."""
    data, manifest = read_rows(oracle_dir, ["conversation_id", "split", "label", "remaining", "draft_top1_prob",
                                            "draft_state"],
                               hint="collect them with `python scripts/collect_oracle.py store_draft_states=true` "
                                    "(a new out_dir, or overwrite=true)")
    data["k_max"] = int(manifest["k_max"])
    return data


def _fit(X: np.ndarray, y: np.ndarray, C: float, seed: int):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=5000, random_state=seed)).fit(X, y)


def _scores(y: np.ndarray, p: np.ndarray) -> dict:
    from sklearn.metrics import brier_score_loss, log_loss, roc_auc_score

    both = len(np.unique(y)) == 2
    return {"auc": float(roc_auc_score(y, p)) if both else None,
            "log_loss": float(log_loss(y, np.clip(p, 1e-7, 1 - 1e-7), labels=[False, True])),
            "brier": float(brier_score_loss(y, p)), "positive_rate": float(np.mean(y)), "examples": int(len(y))}


def train_acceptance_head(cfg) -> dict:
    """Fit the head on the oracle's train rows, score it on its validation rows next to the same model
    without the state (the drafter's probabilities alone), save it with ``metrics.json``; returns the metrics
    (scripts/train_acceptance.py renders their page, ``ldlp.report.training``)."""
    clock = Clock()
    t0 = clock()
    from ldlp.labels.store import require_complete

    collection = require_complete(cfg.oracle_dir, bool(cfg.get("allow_partial", False)))
    data = load_rows(cfg.oracle_dir)
    k = data["k_max"]
    if k < 2:
        raise ValueError(f"{cfg.oracle_dir}: k_max={k}; an acceptance head needs k_max >= 2 (a next step to decide on)")
    val = split_by_conversation(list(data["conversation_id"]), list(data["split"]), float(cfg.val_fraction),
                                int(cfg.seed))
    X, S, y, rows = examples(data["label"], data["remaining"], data["draft_top1_prob"], data["draft_state"], k)
    is_val = val[rows]
    train = np.flatnonzero(~is_val)
    if cfg.get("max_examples") and len(train) > cfg.max_examples:
        train = np.sort(np.random.default_rng(int(cfg.seed)).choice(train, int(cfg.max_examples), replace=False))
    if len(np.unique(y[train])) < 2:
        raise ValueError(f"{cfg.oracle_dir}: the training examples have one outcome only; collect more labels")
    full = np.concatenate([X, S], 1)
    model = _fit(full[train], y[train], float(cfg.C), int(cfg.seed))
    from eagle_backbone.made_for import manifest_made_for
    from ldlp.labels.store import read_manifest

    # the drafter the states came from: a policy refuses the head on another kind's states (same width, other meaning)
    made_for = manifest_made_for(read_manifest(cfg.oracle_dir))  # checked where a policy would load the head
    config = AcceptanceHeadConfig(hidden_size=X.shape[1], k_max=k, C=float(cfg.C),
                                  meta={"allow_partial": collection["allow_partial"], "oracle_collection": collection,
                                        "drafter_kind": made_for["drafter_kind"], "made_for": made_for})
    head = AcceptanceHead.from_sklearn(model, config)
    out = Path(cfg.out_dir)
    head.save_pretrained(out)

    metrics = {"oracle_dir": str(cfg.oracle_dir), "train_examples": int(len(train)), "k_max": k, "C": float(cfg.C),
               "oracle_collection": collection}
    val_idx = np.flatnonzero(is_val)
    if len(val_idx):
        with torch.no_grad():
            p_head = head(torch.from_numpy(X[val_idx]), torch.from_numpy(S[val_idx])).numpy()
        p_stats = _fit(S[train], y[train], float(cfg.C), int(cfg.seed)).predict_proba(S[val_idx])[:, 1]
        metrics["validation"] = {"acceptance_head": _scores(y[val_idx], p_head),
                                 "drafter_probabilities_only": _scores(y[val_idx], p_stats)}
        steps = S[val_idx, 2].astype(int)
        metrics["validation_auc_by_step"] = {int(m): _scores(y[val_idx][steps == m], p_head[steps == m])["auc"]
                                             for m in np.unique(steps)}
    metrics["seconds"] = round(clock() - t0, 1)
    atomic_write_json(out / "metrics.json", metrics)
    return metrics
