"""The starting weights of ``policy=learned_in_step`` (``ldlp/policies/in_step.py``), fitted on held-out oracle labels.

At each labelled position the predictor gives hazard logits ``z_m`` before drafting, and the drafter's probability
``q_m`` of its m-th greedy draft is stored (``draft_top1_prob``). Every depth m a chain reaches (label ≥ m − 1) is
an event, kept when label ≥ m. Two logistic regressions on those events, with one bias shared by the depths (the
form the policy corrects online):

* ``prior``: ``sigmoid(w z_m + c)``: the predictor recalibrated, for depths not yet drafted;
* ``drafted``: ``sigmoid(w' z_m + c' + v logit q_m)``: revised by the draft's probability, for depths drafted.

Fit on labels the predictor did not train on (the collection's validation split): on its own training rows its
logits are sharper than they are on new text. Scored by a two-fold cross-fit over sequences (log-loss and AUC of
the events), beside the predictor's raw hazards, the drafter's probability alone, and the drafts' entropy on top
(the policy leaves it out: it costs a pass over the vocabulary at every depth).
"""

from __future__ import annotations

import numpy as np
import torch

from ldlp.models.calibration import EPS, hazard_logits


def rows_hazard_logits(rows, predictor, embed, batch: int = 4096) -> np.ndarray:
    """(N, K) the predictor's hazard logits at every row of ``rows`` (an oracle collection's rows as
    :class:`~ldlp.bench.harness.replay.OracleRows` holds them); it reads ``[e; f]``: the last token's embedding and
    the stored feature."""
    c, K, out = rows.cols, predictor.config.k_max, []
    with torch.no_grad():
        for i in range(0, len(c["label"]), batch):
            e = embed(torch.as_tensor(c["last_token"][i: i + batch]).long()).float()
            f = torch.as_tensor(np.asarray(c["feature"][i: i + batch], dtype=np.float32))
            out.append(hazard_logits(predictor.survival(e, f)[:, :K]).numpy())
    return np.concatenate(out)


def depth_events(z: np.ndarray, q: np.ndarray, labels: np.ndarray, seq: np.ndarray, entropy=None):
    """Every reached depth as one event: columns ``[z, logit q]`` (and the draft's entropy, where given), outcome,
    and its sequence id."""
    K = z.shape[1]
    q = np.clip(q[:, :K].astype(np.float64), EPS, 1 - EPS)
    lq = np.log(q) - np.log1p(-q)
    X, y, g = [], [], []
    for m in range(1, K + 1):
        r = labels >= m - 1
        X.append(np.stack([z[r, m - 1], lq[r, m - 1]] + ([] if entropy is None else [entropy[r, m - 1]]), 1))
        y.append((labels[r] >= m).astype(np.int64))
        g.append(seq[r])
    return np.concatenate(X), np.concatenate(y), np.concatenate(g)


def _fit(X: np.ndarray, y: np.ndarray):
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=10.0, max_iter=2000).fit(X, y)


def fit_in_step(rows, predictor, embed) -> dict:
    """``{"prior": [w, c], "drafted": [w', c', v], "scores": ..., "events": n}`` (module docstring)."""
    from sklearn.metrics import log_loss, roc_auc_score

    if tuple(getattr(predictor.config, "inputs", ("ef",))) != ("ef",):
        raise ValueError(f"fit_in_step: the predictor reads {list(predictor.config.inputs)}; the in-step policy's "
                         "start is fitted for a predictor on [e; f] alone (python scripts/train_step_ldlp.py)")
    c = rows.cols
    X, y, g = depth_events(rows_hazard_logits(rows, predictor, embed), c["draft_top1_prob"], c["label"], c["seq_id"],
                           np.asarray(c["draft_entropy"], dtype=np.float64))
    prior, drafted = _fit(X[:, :1], y), _fit(X[:, :2], y)
    # two folds by sequence: each model scored on sequences it was not fitted on
    fold = np.unique(g, return_inverse=True)[1] % 2
    fits = (("prior", [0]), ("drafted", [0, 1]), ("drafter alone", [1]), ("drafted and its entropy", [0, 1, 2]))
    pred = {name: np.zeros(len(y)) for name, _ in fits}
    for k in (0, 1):
        tr, te = fold != k, fold == k
        for name, cols in fits:
            pred[name][te] = _fit(X[tr][:, cols], y[tr]).predict_proba(X[te][:, cols])[:, 1]
    pred["predictor as it is"] = 1.0 / (1.0 + np.exp(-X[:, 0]))
    scores = {name: {"log_loss": float(log_loss(y, p)), "auc": float(roc_auc_score(y, p))}
              for name, p in pred.items()}
    return {"prior": [float(prior.coef_[0][0]), float(prior.intercept_[0])],
            "drafted": [float(drafted.coef_[0][0]), float(drafted.intercept_[0]), float(drafted.coef_[0][1])],
            "scores": scores, "events": int(len(y)), "positions": int(len(c["label"])),
            "sequences": int(len(rows.sequences))}
