"""Fit the per-position acceptance head (:class:`ldlp.models.acceptance.DraftAcceptanceHead`) at each temperature on
the labels of ``python scripts/collect_acceptance.py``, and predict on held-out and out-of-domain labels,
with and without online recalibration (:class:`ldlp.models.calibration.OnlineLogitCalibration`);
:mod:`ldlp.report.calibration` scores the predictions (``python scripts/train_draft_acceptance.py``).

One example per row and depth ``m`` whose earlier drafts were all kept (``valid``). Soft labels (beta) are
fitted with the standard trick: each example twice, label 1 with weight beta and label 0 with weight
1 - beta (greedy labels are 0/1, so one of the two weights is zero and that copy is dropped).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from eagle_backbone.errors import ConfigError
from eagle_backbone.made_for import manifest_made_for
from ldlp.models.acceptance import (
    DRAFT_STAT_NAMES,
    DraftAcceptanceHead,
    DraftAcceptanceHeadConfig,
)
from ldlp.models.calibration import OnlineLogitCalibration
from ldlp.labels.store import collection_status, read_manifest, read_rows, split_by_conversation

log = logging.getLogger(__name__)

COLUMNS = ("seq_id", "conversation_id", "split", "index", "draft_log_top1", "draft_entropy", "draft_sum_sq", "beta",
           "kept", "valid", "draft_state")


def temperature_tag(t: float) -> str:
    """The folder name of a temperature, as the collector's ``t${temperature}`` writes it: t0.0, t0.7, t1.0."""
    return f"t{float(t)}"


def label_folder(root: str | Path, name: str, t: float) -> Path:
    """The collection of set ``name`` at temperature ``t`` under ``root``: ``t<T>`` as the collector's
    ``t${temperature}`` wrote it, whichever way T was spelt on its command line (t1 and t1.0 are the same
    temperature); the canonical :func:`temperature_tag` when none exists."""
    folder = Path(root) / name
    canonical = folder / temperature_tag(t)
    if canonical.is_dir() or not folder.is_dir():
        return canonical
    for d in sorted(folder.glob("t*")):
        try:
            if d.is_dir() and float(d.name[1:]) == float(t):
                return d
        except ValueError:
            continue
    return canonical


def check_inputs(cfg) -> list[Path]:
    """Every temperature's training labels, checked before anything is fitted or written: a missing, partial or
    other-temperature collection at any temperature stops the run here, so no head of a run that cannot finish
    goes live (a policy reads whichever heads exist). Returns the label folders, one per temperature."""
    temps = list(cfg.temperatures or [])
    if not temps:
        raise ConfigError("temperatures: empty; give at least one, e.g. temperatures=[0.0,0.7,1.0]")
    folders = []
    for t in temps:
        folder = label_folder(Path(cfg.labels_root), cfg.in_domain, float(t))
        check_collection(folder, bool(cfg.allow_partial))
        got = float(read_manifest(folder).get("temperature", float(t)))
        if abs(got - float(t)) > 1e-9:
            raise ConfigError(f"{folder}/manifest.json: collected at temperature {got}, not {t} (temperatures=)")
        folders.append(folder)
    return folders


def check_collection(folder: str | Path, allow_partial: bool = False) -> None:
    """Refuse a missing or incomplete collection in one line (reads its manifest and part metas only)."""
    if not (Path(folder) / "manifest.json").is_file():
        name, tag = Path(folder).parent.name, Path(folder).name
        raise ConfigError(f"{folder}: no acceptance labels collected there; collect them with `python "
                          f"scripts/collect_acceptance.py data={name} temperature={tag[1:]}` (out_dir defaults to "
                          "that folder)")
    status = collection_status(folder)
    if status["missing_sequences"] and not allow_partial:
        raise ValueError(f"{folder}: incomplete acceptance collection ({status['missing_sequences']} of "
                         f"{status['sequences_planned']} sequences missing); rerun the scripts/collect_acceptance.py "
                         "command that started it, or pass allow_partial=true")


def load_labels(folder: str | Path, allow_partial: bool = False) -> dict:
    """The label rows of a collection (numpy; ``draft_state`` (R, k_max, d)), refusing an incomplete one."""
    check_collection(folder, allow_partial)
    data, manifest = read_rows(folder, list(COLUMNS),
                               hint="collect them with `python scripts/collect_acceptance.py store_draft_states=true`")
    if manifest.get("kind") != "draft_acceptance_labels":
        raise ValueError(f"{folder}/manifest.json: kind={manifest.get('kind')!r}, not per-position acceptance labels "
                         "(python scripts/collect_acceptance.py)")
    data["k_max"] = int(manifest["k_max"])
    data["temperature"] = float(manifest["temperature"])
    data["made_for"] = manifest_made_for(manifest)  # the setup the heads fitted on these labels were made for
    data["drafter_kind"] = data["made_for"]["drafter_kind"]
    return data


def examples(data: dict, rows: np.ndarray | None = None) -> dict:
    """Valid (row, depth) examples of ``rows`` (default all), in stream order (sequence, index, depth):
    ``states`` (n, d), ``stats`` (n, 4) = [log top-1, entropy, sum q^2, depth], ``beta``, ``kept``, ``row``, ``depth``."""
    order = np.lexsort((data["index"], data["seq_id"]))
    if rows is not None:
        order = order[np.isin(order, rows)]
    valid = data["valid"][order].astype(bool)
    r_local, m = np.nonzero(valid)  # row-major: a row's depths together, rows in stream order
    r = order[r_local]
    stats = np.stack([data["draft_log_top1"][r, m], data["draft_entropy"][r, m], data["draft_sum_sq"][r, m],
                      (m + 1).astype(np.float64)], 1).astype(np.float32)
    return {"states": data["draft_state"][r, m].astype(np.float32), "stats": stats,
            "beta": data["beta"][r, m].astype(np.float64), "kept": data["kept"][r, m].astype(np.float64),
            "row": r, "depth": m + 1}


def _fit(X: np.ndarray, beta: np.ndarray, C: float, seed: int):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    n = len(X)
    y = np.concatenate([np.ones(n), np.zeros(n)])
    w = np.concatenate([beta, 1.0 - beta])
    keep = w > 0
    Xd = np.concatenate([X, X])[keep]
    model = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=5000, random_state=seed))
    return model.fit(Xd, y[keep], logisticregression__sample_weight=w[keep])


def replay_online(p_est: np.ndarray, kept: np.ndarray, row: np.ndarray, options: dict | None = None
                  ) -> tuple[np.ndarray, dict]:
    """Replay a label stream in order through a fresh :class:`OnlineLogitCalibration`: each row (one
    verification) is predicted with the correction learnt from the rows before it, then its observed
    outcomes (``kept``: the seeded draw, mean beta; greedy: the hard label) update it. ``options``: keyword
    arguments of the calibrator (its own defaults when empty)."""
    cal = OnlineLogitCalibration(**(options or {}))
    out = np.empty(len(p_est))
    starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
    ends = np.r_[starts[1:], len(row)]
    p_t, k_t = torch.from_numpy(p_est).float(), torch.from_numpy(kept).float()
    for a, b in zip(starts, ends):
        out[a:b] = cal.calibrate(p_t[a:b]).numpy()
        cal.update(p_t[a:b], k_t[a:b])
    return out, cal.state()


def train_at_temperature(cfg, t: float) -> dict:
    """Fit, save and predict for one temperature; returns the predictions per evaluation set."""
    tag = temperature_tag(t)
    root = Path(cfg.labels_root)
    labels = label_folder(root, cfg.in_domain, t)
    data = load_labels(labels, bool(cfg.allow_partial))
    if abs(data["temperature"] - float(t)) > 1e-9:
        raise ValueError(f"{labels}: collected at temperature {data['temperature']}, not {t}")
    val = split_by_conversation(list(data["conversation_id"]), list(data["split"]), float(cfg.val_fraction),
                                int(cfg.seed))
    train = examples(data, np.flatnonzero(~val))
    idx = np.arange(len(train["beta"]))
    if cfg.get("max_examples") and len(idx) > cfg.max_examples:
        idx = np.sort(np.random.default_rng(int(cfg.seed)).choice(idx, int(cfg.max_examples), replace=False))
    X = np.concatenate([train["states"], train["stats"]], 1)[idx]
    model = _fit(X, train["beta"][idx], float(cfg.C), int(cfg.seed))
    probs_only = _fit(train["stats"][idx], train["beta"][idx], float(cfg.C), int(cfg.seed))
    depth_mean = {int(m): float(train["beta"][train["depth"] == m].mean()) for m in np.unique(train["depth"])}
    config = DraftAcceptanceHeadConfig(hidden_size=train["states"].shape[1], temperature=float(t), k_max=data["k_max"],
                                       C=float(cfg.C), meta={"labels": str(labels),
                                                             "drafter_kind": data["drafter_kind"],
                                                             "made_for": data["made_for"],
                                                             "train_examples": len(idx),
                                                             "stat_names": list(DRAFT_STAT_NAMES)})
    head = DraftAcceptanceHead.from_sklearn(model, config)
    out = Path(cfg.out_root) / tag
    head.save_pretrained(out)

    sets = {"validation (in domain)": (data, np.flatnonzero(val))}
    for name in cfg.ood:
        folder = label_folder(root, name, t)
        if not (folder / "manifest.json").is_file():
            log.warning("%s: no labels collected (out-of-domain set %s at t=%s skipped)", folder, name, t)
            continue
        ood = load_labels(folder, bool(cfg.allow_partial))
        sets[f"{name} (out of domain)"] = (ood, None)
    from omegaconf import OmegaConf

    online = OmegaConf.to_container(cfg.online_calibration, resolve=True) if cfg.get("online_calibration") else {}
    preds = {}
    for name, (d, rows) in sets.items():
        ex = examples(d, rows)
        with torch.no_grad():
            p = head.logit_from_stats(torch.from_numpy(ex["states"]), torch.from_numpy(ex["stats"])).sigmoid()
        p = p.double().numpy()
        p_online, state = replay_online(p, ex["kept"], ex["row"], online)
        preds[name] = {"beta": ex["beta"], "depth": ex["depth"],
                       "estimates": {"head": p, "head + online recalibration": p_online,
                                     "drafter probabilities only": probs_only.predict_proba(ex["stats"])[:, 1],
                                     "per-depth constant": np.array([depth_mean.get(int(m), np.nan)
                                                                     for m in ex["depth"]])},
                       "online_final": state}
    return {"temperature": float(t), "head_dir": str(out), "train_examples": len(idx),
            "k_max": data["k_max"], "C": float(cfg.C), "online_calibration": online, "sets": preds}
