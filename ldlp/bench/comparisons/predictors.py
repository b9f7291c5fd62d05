"""The predictor study (``python scripts/study_predictors.py``): which features and models predict how many
drafts the target keeps, how that grows with labels, and what it is worth once a decision rule turns it into γ.

Examples are *recorded by replay*: a behaviour policy (a static γ) walks every oracle sequence as the engine
would (:func:`ldlp.bench.harness.replay.replay`), and :func:`~ldlp.models.features.step_features`, as the deployed
policy computes them, records the features at every step it visits; the label of a step is the oracle label of
its row (the agreement length of the drafter's chain there). Several behaviour γ give several histories.

A model estimates the survival curve S_m = P(label >= m), m = 1..K. It is scored on the validation split by

* MAE: its median length (the largest m with S_m >= 0.5) against the label;
* AUC of S_m for the event label >= m, at m = 1 and averaged over m = 1..K (where both outcomes occur);
* modelled speed: :class:`~ldlp.policies.learned.LearnedPolicy` (the model and :func:`gamma_by_cost`) replayed
  on the validation sequences and priced by the cost table, as a ratio to the best static γ and as the share of
  the oracle's headroom it captures.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from eagle_backbone.made_for import run_made_for
from ldlp.bench.harness.replay import OracleRows, replay
from ldlp.bench.harness.stats import headroom_captured
from ldlp.bench.comparisons.study_rows import load_split, oracle_record, rows_subset
from ldlp.models.features import feature_names
from ldlp.policies.learned import LearnedPolicy, step_seconds_table

log = logging.getLogger(__name__)


# ---- examples ----------------------------------------------------------------------------------------


@dataclass
class Examples:
    x: np.ndarray  # (n, F) features in step_features order
    label: np.ndarray  # (n,) the oracle label of the step's row
    seq: np.ndarray  # (n,) sequence id (for subsets by sequence)
    behaviour: np.ndarray  # (n,) the static γ that walked there

    def __len__(self) -> int:
        return len(self.label)

    def take(self, idx) -> "Examples":
        return Examples(self.x[idx], self.label[idx], self.seq[idx], self.behaviour[idx])

    @property
    def stream(self) -> np.ndarray:
        """(n,) one id per walk (a behaviour's pass over one sequence): its steps are contiguous, in step order."""
        return self.behaviour.astype(np.int64) * (int(self.seq.max(initial=0)) + 1) + self.seq


def record_examples(rows: OracleRows, behaviours, groups, costs, embed=None, vocab_size: int = 2 ** 15) -> Examples:
    """Walk ``rows`` under each static γ in ``behaviours`` and record every step's features and label."""
    xs, labels, seqs, beh = [], [], [], []
    seconds = step_seconds_table(costs, rows.k_max)
    for g in behaviours:
        rec, at = [], []
        policy = LearnedPolicy(max_gamma=rows.k_max, groups=groups, seconds=seconds, record=rec, fixed=int(g))
        replay(rows, policy, costs, embed, vocab_size, on_step=lambda r, k, a: at.append(r))
        at = np.asarray(at)
        xs.append(np.stack(rec))
        labels.append(rows.cols["label"][at])
        seqs.append(rows.cols["seq_id"][at])
        beh.append(np.full(len(at), g))
    return Examples(np.concatenate(xs), np.concatenate(labels).astype(np.int64), np.concatenate(seqs),
                    np.concatenate(beh))


def column_slices(groups, d: int) -> dict[str, slice]:
    """Where each group's columns sit in a feature vector of ``groups``."""
    out, at = {}, 0
    for g in groups:
        width = len(feature_names([g], d))
        out[g] = slice(at, at + width)
        at += width
    return out


# ---- models: survival curves ----------------------------------------------------------------------------


class SurvivalModel:
    """A classifier over the clipped label 0..K whose class probabilities give S_m = P(label >= m)."""

    # ldlp: AdaEAGLE's network, distribution head (Lightning); gru: a GRU over the last steps' vectors
    # (ldlp.models.step_history, Lightning), which needs the history group to tell where a sequence starts
    KINDS = ("constant", "logistic", "gbt", "mlp", "ldlp", "gru")
    TRAINED_ELSEWHERE = {"ldlp": "fit_step_ldlp", "gru": "fit_step_history"}

    def __init__(self, kind: str, K: int, seed: int = 0, ef: slice | None = None, ef_components: int = 32,
                 groups=None, fitters: dict | None = None):
        self.kind, self.K, self.seed, self.ef, self.ef_components = kind, K, seed, ef, ef_components
        self.groups = groups  # the feature groups of x (the LDLP records them in its config)
        # kinds trained outside this package (ldlp: Lightning, ldlp.training.step_predictor.fit_step_ldlp), passed in
        # by the script that composes them
        self.fitters = fitters or {}

    def _pipeline(self):
        from sklearn.decomposition import PCA
        from sklearn.ensemble import HistGradientBoostingClassifier
        from sklearn.linear_model import LogisticRegression
        from sklearn.neural_network import MLPClassifier
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        if self.kind == "gbt":
            # [e; f] through a PCA (fitted on the training rows): trees on 768 raw columns are slow and no better
            steps = [HistGradientBoostingClassifier(max_iter=300, learning_rate=0.1, max_leaf_nodes=31,
                                                    early_stopping=True, validation_fraction=0.1,
                                                    n_iter_no_change=20, random_state=self.seed)]
            if self.ef is not None:
                from sklearn.compose import ColumnTransformer

                cols = list(range(self.ef.start, self.ef.stop))
                steps.insert(0, ColumnTransformer([("ef", PCA(self.ef_components, random_state=self.seed), cols)],
                                                  remainder="passthrough"))
            return make_pipeline(*steps)
        if self.kind == "logistic":
            return make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=500))
        if self.kind == "mlp":  # the LDLP's shape: an MLP on the standardised inputs
            return make_pipeline(StandardScaler(), MLPClassifier((256, 256), early_stopping=True, max_iter=200,
                                                                 random_state=self.seed))
        raise ValueError(f"unknown model kind {self.kind!r}")

    def fit(self, x: np.ndarray, label: np.ndarray, seq: np.ndarray | None = None,
            stream: np.ndarray | None = None) -> "SurvivalModel":
        """``seq``: each row's sequence (whole ones validate the Lightning models); ``stream``: each row's walk, for
        the step-history model (:attr:`Examples.stream`)."""
        y = np.minimum(label, self.K)
        self.pipe = None
        if self.kind in self.TRAINED_ELSEWHERE:
            fitter = self.TRAINED_ELSEWHERE[self.kind]
            if self.kind not in self.fitters:
                raise ValueError(f"the {self.kind} model is trained with Lightning: pass fitters={{'{self.kind}': "
                                 f"{fitter}}} (ldlp.training.step_predictor; scripts/study_predictors.py does)")
            seq = seq if seq is not None else np.arange(len(x))
            if self.kind == "ldlp":
                self.ldlp = self.fitters["ldlp"](x, label, seq, self.groups, self.K, self.seed)
                return self
            if "history" not in (self.groups or ()):
                raise ValueError("the gru model needs the history feature group (where a sequence starts)")
            from ldlp.models.step_history import StreamingHistory

            self.gru = self.fitters["gru"](x, label, seq, seq if stream is None else stream, self.K, self.seed)
            self.streaming = StreamingHistory(self.gru, self._steps_col(x.shape[1]))
            return self
        if self.kind == "constant" or len(np.unique(y)) < 2:  # one outcome only: nothing to tell apart
            self.pipe = None
            counts = np.bincount(y, minlength=self.K + 1).astype(float)
            self._const = counts / counts.sum()
            return self
        pipe = self._pipeline()
        counts = np.bincount(y)
        if self.kind == "gbt" and (counts[counts > 0] < 2).any():  # its stratified early-stopping split needs 2 a class
            pipe[-1].set_params(early_stopping=False, max_iter=50)
        self.pipe = pipe.fit(x, y)
        return self

    def _steps_col(self, width: int) -> int:
        names = feature_names([g for g in self.groups if g != "ef"])
        at = names.index("steps")
        before_ef = list(self.groups).index("ef") if "ef" in self.groups else len(self.groups)
        history_after_ef = list(self.groups).index("history") > before_ef
        return at + (width - len(names) if history_after_ef else 0)

    def survival(self, x: np.ndarray, stream: np.ndarray | None = None) -> np.ndarray:
        """(n, K) S_m of feature rows ``x``. The step-history model reads each row's walk: give ``stream`` (rows of
        whole walks, in step order), or ask one row at a time, in step order (a policy's use)."""
        if self.kind == "ldlp":
            return self.ldlp.survival_of(x)
        if self.kind == "gru":
            if stream is None:
                return self.streaming.survival(x)
            import torch

            from ldlp.models.step_history import gather, windows

            out = []
            idx = torch.as_tensor(windows(stream, self.gru.config.window))
            xt = torch.as_tensor(np.asarray(x, dtype=np.float32))
            with torch.no_grad():
                for b in range(0, len(idx), 8192):
                    out.append(self.gru.survival_tensor(*gather(xt, idx[b: b + 8192])).numpy())
            return np.concatenate(out)
        if self.pipe is None:
            p = np.broadcast_to(self._const, (len(x), self.K + 1))
        else:
            proba = self.pipe.predict_proba(x)
            p = np.zeros((len(x), self.K + 1))
            p[:, self.pipe.classes_] = proba
        # S_m = P(y >= m), m = 1..K
        return np.ascontiguousarray(p[:, ::-1].cumsum(1)[:, ::-1][:, 1:])


# ---- scores --------------------------------------------------------------------------------------------


def median_length(S: np.ndarray) -> np.ndarray:
    return (S >= 0.5).sum(1)


def scores(S: np.ndarray, label: np.ndarray) -> dict:
    from sklearn.metrics import roc_auc_score

    K = S.shape[1]
    aucs = []
    for m in range(1, K + 1):
        y = label >= m
        aucs.append(float(roc_auc_score(y, S[:, m - 1])) if 0 < y.sum() < len(y) else float("nan"))
    known = [a for a in aucs if not np.isnan(a)]
    return {"mae": float(np.abs(median_length(S) - np.minimum(label, K)).mean()), "auc_1": aucs[0],
            "auc_mean": float(np.mean(known)) if known else float("nan"), "auc": aucs}


# ---- modelled speed ------------------------------------------------------------------------------------


def static_and_oracle(rows: OracleRows, costs, gammas, oracle_cap: int) -> dict:
    """Replayed tokens/s of each static γ and of the oracle."""
    from eagle_backbone.policy import StaticPolicy

    out = {f"static {g}": replay(rows, StaticPolicy(g), costs).tokens_per_s for g in gammas}
    out["oracle"] = replay(rows, "oracle", costs, oracle_cap=oracle_cap).tokens_per_s
    return out


def token_seconds(rows: OracleRows, model, groups, costs, embed, vocab_size: int, start: float, iterations: int = 2,
                  max_gamma: int = 8) -> float:
    """The fixed point of "seconds a token is worth" = the policy's own seconds per emitted token (Dinkelbach's
    iteration for the best ratio of tokens to seconds), from ``start``, on ``rows``."""
    seconds, token_s = step_seconds_table(costs, rows.k_max), start
    for _ in range(iterations):
        r = replay(rows, LearnedPolicy(max_gamma=max_gamma, predictor=model, groups=groups, seconds=seconds,
                                       token_s=token_s), costs, embed, vocab_size)
        token_s = r.seconds / r.new_tokens
    return token_s


def modelled(rows: OracleRows, model, groups, costs, token_s: float, embed, vocab_size: int, reference: dict,
             max_gamma: int = 8, rule: str = "cost") -> dict:
    """Replay the cost rule (or ``rule``) with ``model`` on ``rows``: tokens/s, τ, the ratio to the best static γ
    and the headroom captured (``reference``: :func:`static_and_oracle` of the same rows)."""
    r = replay(rows, LearnedPolicy(max_gamma=max_gamma, rule=rule, predictor=model, groups=groups,
                                   seconds=step_seconds_table(costs, rows.k_max), token_s=token_s),
               costs, embed, vocab_size)
    best = max(v for k, v in reference.items() if k.startswith("static"))
    return {"tokens_per_s": r.tokens_per_s, "tau": r.tau, "drafted": r.drafted, "wasted": r.wasted,
            "vs_best_static": r.tokens_per_s / best,
            "headroom": headroom_captured(r.tokens_per_s, best, reference["oracle"])}


# ---- the study -----------------------------------------------------------------------------------------

SECTIONS = ("models", "learning_curve", "ablation", "rules")


def sequence_subset(ex: Examples, size: int, seed: int) -> np.ndarray:
    """Indices of the examples of whole sequences, drawn in a seeded order until at least ``size`` examples."""
    seqs = np.unique(ex.seq)
    order = np.random.default_rng(seed).permutation(seqs)
    counts = np.bincount(np.searchsorted(seqs, ex.seq), minlength=len(seqs))[np.searchsorted(seqs, order)]
    take = order[: int(np.searchsorted(np.cumsum(counts), size)) + 1]
    return np.flatnonzero(np.isin(ex.seq, take))


def decision_us(model, x: np.ndarray, seconds: np.ndarray, token_s: float, calls: int = 200) -> float:
    """Median microseconds of one decision (one row's survival curve and the cost rule), as the policy makes it."""
    import time

    from ldlp.policies.learned import gamma_by_cost

    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        gamma_by_cost(model.survival(x[i % len(x)][None])[0], seconds, token_s)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


class Study:
    """The study's runs over one pair of train and validation examples; every result is kept in ``done`` (keyed
    by section and name) and saved after each by ``save``, so a killed study resumes where it stopped."""

    def __init__(self, train: OracleRows, val: OracleRows, costs, embed, vocab_size: int, groups, behaviours,
                 K: int, seed: int, d: int, done: dict, save, max_gamma: int = 8, calibration_rows=None,
                 fitters: dict | None = None):
        self.train_rows, self.val_rows, self.costs, self.embed, self.vocab = train, val, costs, embed, vocab_size
        self.groups, self.K, self.seed, self.d, self.max_gamma = tuple(groups), K, seed, d, max_gamma
        self.done, self.save, self.fitters = done, save, fitters
        self.slices = column_slices(self.groups, d)
        self.tr = record_examples(train, behaviours, self.groups, costs, embed, vocab_size)
        self.va = record_examples(val, behaviours, self.groups, costs, embed, vocab_size)
        self.reference = done.setdefault("reference", static_and_oracle(val, costs, range(1, K + 1), K))
        self.seconds = step_seconds_table(costs, val.k_max)
        # the seconds a token is worth start at the best static γ's (on the training rows) and are refined per model
        self.calibration = calibration_rows or train
        ref_train = done.setdefault("reference_train", static_and_oracle(self.calibration, costs, range(1, K + 1), K))
        self.token_s0 = 1.0 / max(v for k, v in ref_train.items() if k.startswith("static"))
        save(done)

    def columns(self, groups) -> tuple[np.ndarray, slice | None]:
        cols = np.concatenate([np.arange(self.slices[g].start, self.slices[g].stop) for g in groups])
        ef = None
        if "ef" in groups:
            before = sum(self.slices[g].stop - self.slices[g].start for g in groups if groups.index(g) < groups.index("ef"))
            ef = slice(before, before + 2 * self.d)
        return cols, ef

    def run(self, section: str, name: str, kind: str, groups, idx=None, rule: str = "cost", timing: bool = False) -> dict:
        key = f"{section}/{name}"
        if key in self.done.setdefault("runs", {}):
            return self.done["runs"][key]
        import time

        groups = tuple(g for g in self.groups if g in groups)
        size = len(self.tr) if idx is None else len(idx)
        for r in self.done["runs"].values():  # the same fit under another heading: reuse it
            if (r["model"], tuple(r["groups"]), r["train_examples"], r["rule"]) == (kind, groups, size, rule) \
                    and (not timing or "decision_us" in r):
                self.done["runs"][key] = {**r, "section": section, "name": name}
                self.save(self.done)
                return self.done["runs"][key]
        cols, ef = self.columns(groups)
        tr = self.tr if idx is None else self.tr.take(idx)
        t0 = time.perf_counter()
        model = SurvivalModel(kind, self.K, self.seed, ef=ef, groups=groups, fitters=self.fitters).fit(
            tr.x[:, cols], tr.label, tr.seq, tr.stream)
        fit_s = time.perf_counter() - t0
        sc = scores(model.survival(self.va.x[:, cols], self.va.stream), self.va.label)
        token_s = token_seconds(self.calibration, _Cols(model, cols), self.groups, self.costs, self.embed, self.vocab,
                                self.token_s0, max_gamma=self.max_gamma) if rule == "cost" else self.token_s0
        md = modelled(self.val_rows, _Cols(model, cols), self.groups, self.costs, token_s, self.embed, self.vocab,
                      self.reference, self.max_gamma, rule)
        out = {"section": section, "name": name, "model": kind, "groups": list(groups), "rule": rule,
               "train_examples": len(tr), "train_sequences": int(len(np.unique(tr.seq))), "fit_s": fit_s,
               "token_s": token_s, **sc, **md}
        if timing:
            out["decision_us"] = decision_us(_Cols(model, cols), self.va.x, self.seconds, token_s)
        self.done["runs"][key] = out
        self.save(self.done)
        log.info("%s: MAE %.3f, AUC %.3f (first draft %.3f), modelled %.3f of the best static γ", key, out["mae"],
                 out["auc_mean"], out["auc_1"], out["vs_best_static"])
        return out


class _Cols:
    """A model fitted on some columns of the full feature vector, asked with the full vector."""

    def __init__(self, model, cols):
        self.model, self.cols = model, cols

    def survival(self, x: np.ndarray) -> np.ndarray:
        return self.model.survival(x[:, self.cols])


def run_predictor_study(cfg, pair=None, fitters: dict | None = None) -> dict:
    """Run (or continue) every section of the study into ``cfg.out_dir/study.json``; returns the record (the
    page is :func:`ldlp.report.predictors.study_page`'s). ``pair``: the loaded model pair (default: ``cfg.model``
    loaded); ``fitters``: model kinds trained elsewhere (``{"ldlp": fit_step_ldlp}``)."""
    import json
    from pathlib import Path

    from omegaconf import OmegaConf

    from eagle_backbone.io import atomic_write_json
    from eagle_backbone.loading import load_pair
    from ldlp.bench.harness.loaders import replay_costs
    from ldlp.bench.harness.replay import costs_record
    from ldlp.models.features import GROUPS

    bad = [g for g in cfg.groups if g not in GROUPS]
    if bad:
        raise ValueError(f"groups: unknown feature groups {bad}; known: {list(GROUPS)}")
    bad = [m for m in cfg.models if m not in SurvivalModel.KINDS]
    if bad:
        raise ValueError(f"models: unknown model kinds {bad}; known: {list(SurvivalModel.KINDS)}")
    sections = list(cfg.get("sections") or SECTIONS)
    bad = [x for x in sections if x not in SECTIONS]
    if bad:
        raise ValueError(f"sections: unknown sections {bad}; known: {list(SECTIONS)}")
    record = oracle_record(cfg.oracle_dir)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pair = pair or load_pair(cfg.model)
    costs = replay_costs(cfg.costs, cfg.model.name, pair, "study_predictors")
    identity = {"oracle": record,
                "costs": costs_record(costs),
                **{k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
                   for k in ("seed", "behaviours", "K", "max_gamma", "groups", "max_train_sequences",
                             "max_val_sequences", "calibration_sequences")}}
    identity = json.loads(json.dumps(identity, default=str))
    path = out / "study.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    if done and done.get("identity") != identity:
        if not cfg.overwrite:
            diff = sorted(k for k in set(identity) | set(done.get("identity", {}))
                          if identity.get(k) != done.get("identity", {}).get(k))
            raise ValueError(f"{path} was made with other settings ({', '.join(diff)}); continue it with the same "
                             "settings, choose another out_dir, or pass overwrite=true")
        done = {}
    done["identity"] = identity
    save = lambda d: atomic_write_json(path, d, indent=1)  # noqa: E731

    train = load_split(cfg.oracle_dir, "train", cfg.max_train_sequences)
    val = load_split(cfg.oracle_dir, "validation", cfg.max_val_sequences)
    calib = rows_subset(train, np.unique(train.cols["seq_id"])[: int(cfg.calibration_sequences)],
                         train.max_new_tokens)
    log.info("train %d positions in %d sequences, validation %d in %d", len(train), len(train.sequences),
             len(val), len(val.sequences))
    study = Study(train, val, costs, pair.target.embed, pair.target.vocab_size, cfg.groups, cfg.behaviours,
                  int(cfg.K), int(cfg.seed), pair.target.hidden_size, done, save, cfg.max_gamma, calib, fitters)
    done["examples"] = {"train": len(study.tr), "validation": len(study.va)}
    groups = list(study.groups)
    # models on every feature (first: the later sections reuse the fits they share, with their decision times)
    for kind in cfg.models if "models" in sections else []:
        study.run("models", kind, kind, groups if kind != "constant" else groups[:1], timing=True)
    # learning curve
    sizes = [s for s in cfg.learning_curve.sizes if s < len(study.tr)] + [len(study.tr)]
    for size in sizes if "learning_curve" in sections else []:
        idx = None if size == len(study.tr) else sequence_subset(study.tr, size, int(cfg.seed))
        study.run("learning_curve", str(size), cfg.learning_curve.model, groups, idx)
    # ablation: each group alone, every group but one, all (on a subset of whole sequences when asked)
    cap = cfg.ablation.get("max_examples")
    sub = None if cap is None or cap >= len(study.tr) else sequence_subset(study.tr, int(cap), int(cfg.seed))
    for name, kept in ([(f"only {g}", [g]) for g in groups] + [(f"without {g}", [h for h in groups if h != g])
                                                                for g in groups] + [("all", groups)]
                       if "ablation" in sections else []):
        study.run("ablation", name, cfg.ablation.model, kept, sub)
    best = max((r for r in done["runs"].values() if r["section"] == "models" and r["model"] != "constant"),
               key=lambda r: r["vs_best_static"], default=None)
    if best is not None and "rules" in sections:
        for rule in cfg.rules:
            study.run("rules", f"{best['model']} {rule}", best["model"], groups, rule=rule)
    save(done)
    return done


def predictor_examples(cfg, pair, costs) -> tuple[Examples, Examples, OracleRows]:
    """The shipped predictor's training and validation examples (``scripts/train_step_ldlp.py``), and the training
    rows (its calibration replays them)."""
    train = load_split(cfg.oracle_dir, "train", cfg.get("max_train_sequences"))
    val = load_split(cfg.oracle_dir, "validation", cfg.get("max_val_sequences"))
    tr = record_examples(train, cfg.behaviours, list(cfg.groups), costs, pair.target.embed, pair.target.vocab_size)
    va = record_examples(val, cfg.behaviours, list(cfg.groups), costs, pair.target.embed, pair.target.vocab_size)
    return tr, va, train


def shipped_meta(cfg, ldlp, tr: Examples, va: Examples, train: OracleRows, costs, pair, command: str | None) -> dict:
    """What the shipped predictor's config.json records: the seconds a token is worth as a ratio to a plain step
    (the cost rule's fixed point on the first ``calibration_sequences`` training sequences, the policy's start), its
    validation scores and its provenance."""
    from ldlp.bench.harness.replay import costs_record

    records = oracle_record(cfg.oracle_dir)
    records = records if isinstance(records, list) else [records]
    n = cfg.get("calibration_sequences")
    calib = train if n is None else rows_subset(train, np.unique(train.cols["seq_id"])[: int(n)], train.max_new_tokens)
    K = int(cfg.K)
    best_static = max(v for k, v in static_and_oracle(calib, costs, range(1, K + 1), K).items() if k.startswith("static"))
    token_s = token_seconds(calib, ldlp, list(cfg.groups), costs, pair.target.embed, pair.target.vocab_size,
                            1.0 / best_static, max_gamma=K)
    seconds = step_seconds_table(costs, train.k_max)
    return {"token_ratio": token_s / float(seconds[0, 0]), "groups": list(cfg.groups), "behaviours": list(cfg.behaviours),
            "oracle_dir": [r["dir"] for r in records] if len(records) > 1 else records[0]["dir"],
            "oracle_counts": {k: sum((r["counts"] or {}).get(k) or 0 for r in records) for k in ("sequences", "positions")}
            if len(records) > 1 else records[0]["counts"],
            "oracle_identity": [r["identity"] for r in records] if len(records) > 1 else records[0]["identity"],
            "costs": costs_record(costs),
            "train_examples": len(tr), "validation_examples": len(va), "seed": int(cfg.seed),
            "validation": scores(ldlp.survival_of(va.x), va.label), "command": command,
            "made_for": run_made_for(cfg.model)}  # the pair it replayed on (eagle_backbone/made_for.py)
