"""The oracle collector: prompts in, label shards out (``python scripts/collect_oracle.py``).

For every prompt the target generates its greedy response, then :func:`ldlp.labels.oracle.oracle_labels`
labels every position of it. Work is planned before anything runs, so it can be split and resumed:

* prompts get a ``seq_id`` in a fixed order (the data split first, then validation);
* collector ``shard_id`` of ``num_shards`` takes the prompts with ``seq_id % num_shards == shard_id``;
* its prompts, per split, are cut into parts of ``shard_size`` sequences; a part is written with
  atomic renames (rows, sequences, then the meta file that marks it complete), so a run killed at
  any moment loses at most the part in progress, and a rerun skips the complete parts and redoes that
  one: no position lost or duplicated, and the same files as an uninterrupted run.

``manifest.json`` (config, model folders and weight hashes, counts) guards the directory: a rerun with
settings that change the labels stops with the differing keys instead of mixing two collections.
``report.json`` summarises all complete parts (positions, label histogram, mean label, share at ``k_max``,
time, positions/s); its page, ``report.md``, is rendered from it (:mod:`ldlp.report.labels`, by the script).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from eagle_backbone.decoder import autoregressive_generate
from eagle_backbone.drafter_kinds import get_kind, kinds_labelled_by
from eagle_backbone.io import remove_leftovers
from eagle_backbone.runtime import Clock, resolve_dtype, set_threads
from ldlp.labels.oracle import oracle_labels
from ldlp.labels.work import IDENTITY_KEYS, Part, WorkItem, folder_digest, plan_items, plan_parts, settings_diff
from ldlp.labels.store import (
    META_SUFFIX,
    ROWS_SUFFIX,
    SEQS_SUFFIX,
    committed_parts,
    label_histogram,
    rows_features,
    sequences_features,
    write_arrow,
    write_json,
)

log = logging.getLogger(__name__)

def remove_collection(out: Path) -> None:
    """Remove a collection's parts, its manifest and its report: ``report.json`` and every page rendered from it
    (``report.*``: a stale page would outlive the labels it summed)."""
    for m in list(out.glob(f"*/*{META_SUFFIX}")) + list(out.glob(f"*/*{ROWS_SUFFIX}")) + list(out.glob(f"*/*{SEQS_SUFFIX}")):
        m.unlink()
    for f in [out / "manifest.json", *out.glob("report.*")]:
        f.unlink(missing_ok=True)


# ---- the run ---------------------------------------------------------------------------------------


def part_columns(results: list[tuple[WorkItem, list[int], dict]], eos: set[int]) -> tuple[dict, dict]:
    """The columns every label collection has, from ``(item, response, labels)`` per sequence: per row
    ``seq_id``, ``conversation_id`` and ``split`` (lists), per sequence all of :func:`sequences_features`.
    The collector adds its own row columns to the first dict."""
    rows = {k: [] for k in ("seq_id", "conversation_id", "split")}
    seqs = {k: [] for k in ("seq_id", "conversation_id", "split", "input_ids", "prompt_len", "positions", "eos")}
    for it, response, lab in results:
        r = len(lab["index"])
        rows["seq_id"] += [it.seq_id] * r
        rows["conversation_id"] += [it.conversation_id] * r
        rows["split"] += [it.split] * r
        seqs["seq_id"].append(it.seq_id)
        seqs["conversation_id"].append(it.conversation_id)
        seqs["split"].append(it.split)
        seqs["input_ids"].append(list(it.prompt_ids) + list(response))
        seqs["prompt_len"].append(len(it.prompt_ids))
        seqs["positions"].append(r)
        seqs["eos"].append(bool(response) and response[-1] in eos)
    return rows, seqs


def _part_columns(results: list[tuple[WorkItem, list[int], dict]], k_max: int, store_features: bool, d: int,
                  eos: set[int], store_draft_states: bool = False) -> tuple[dict, dict]:
    rows, seqs = part_columns(results, eos)
    rows.update({k: [] for k in ("index", "last_token", "label", "remaining", "draft_top1_prob", "draft_entropy",
                                 "target_prob", "target_stats", "feature", "draft_state")})
    for _, _, lab in results:
        r = len(lab["index"])
        for k in ("index", "last_token", "label", "remaining"):
            rows[k].append(lab[k].numpy())
        for k in ("draft_top1_prob", "draft_entropy", "target_prob"):
            rows[k].append(lab[k].float().numpy().reshape(r, k_max))
        rows["target_stats"].append(lab["target_stats"].float().numpy().reshape(r, 3))
        if store_features:
            rows["feature"].append(lab["feature"].float().numpy().reshape(r, d))
        if store_draft_states:  # (r, k_max, d) stored row-major as one list of k_max * d values
            rows["draft_state"].append(lab["draft_state"].float().numpy().reshape(r, k_max * d))
    for k in ("index", "last_token", "label", "remaining"):
        rows[k] = np.concatenate(rows[k]) if rows[k] else np.zeros(0, np.int64)
    for k, width in (("draft_top1_prob", k_max), ("draft_entropy", k_max), ("target_prob", k_max), ("target_stats", 3),
                     ("feature", d), ("draft_state", k_max * d)):
        rows[k] = np.concatenate(rows[k]) if rows[k] else np.zeros((0, width), np.float32)
    return rows, seqs


class Collector:
    """The driver both label collectors share: run (or continue) one collector into ``cfg.out_dir`` and
    return the report over its complete parts.

    :meth:`run` checks the config, seeds, guards the directory with ``manifest.json`` (``overwrite``, model
    digests, the settings in ``identity_keys``), plans the prompts and this collector's parts, labels and
    writes every part not yet complete (rows, sequences, then the meta file that marks it complete) and
    writes the report. A subclass says what differs: ``identity_keys``, the label collection it is (``collection``:
    a drafter kind's ``labelled_by`` says whether it labels that kind), why it needs an EAGLE drafter (``drafter_use``,
    for the error), the report keys the final manifest counts (``count_keys``) and the
    hooks below.
    """

    identity_keys: tuple[str, ...] = ()
    drafter_use = "labels need an EAGLE drafter"
    collection = ""  # "oracle", "acceptance": the drafter kinds it labels have it in their labelled_by
    count_keys: tuple[str, ...] = ("sequences", "positions")
    k_max_limit, k_max_why = 127, ""  # k_max in 1..k_max_limit; why the limit, for the error
    dtype_keys: tuple[str, ...] = ()  # settings that are float16 or float32
    rows_format: int | None = None  # the rows table's version: a collection of another one is not continued

    def __init__(self, cfg):
        self.cfg = cfg

    # ---- hooks ----

    def check_config(self) -> None:
        """Raise ``ValueError`` on a setting out of range; runs before anything else."""
        cfg = self.cfg
        if not isinstance(cfg.k_max, int) or not 1 <= cfg.k_max <= self.k_max_limit:
            raise ValueError(f"k_max must be an integer in 1..{self.k_max_limit}{self.k_max_why}, got {cfg.k_max!r}")
        if str(cfg.overwrite).lower() not in ("true", "false", "changed"):
            raise ValueError(f"overwrite must be false (continue; refuse other settings), true (start over) or "
                             f"changed (start over only when the settings differ), got {cfg.overwrite!r}")
        if not isinstance(cfg.num_shards, int) or cfg.num_shards < 1:
            raise ValueError(f"num_shards must be an integer >= 1, got {cfg.num_shards!r}")
        if not isinstance(cfg.shard_id, int) or not 0 <= cfg.shard_id < cfg.num_shards:
            raise ValueError(f"shard_id must be in 0..num_shards-1={cfg.num_shards - 1}, got {cfg.shard_id!r}")
        if not isinstance(cfg.shard_size, int) or cfg.shard_size < 1:
            raise ValueError(f"shard_size (sequences per part) must be an integer >= 1, got {cfg.shard_size!r}")
        if not isinstance(cfg.max_new_tokens, int) or cfg.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {cfg.max_new_tokens!r}")
        for key in self.dtype_keys:
            if cfg[key] not in ("float16", "float32"):
                raise ValueError(f"{key} must be float16 or float32, got {cfg[key]!r}")

    def prompt_margin(self) -> int:
        """Positions a prompt leaves free below ``target.max_length - 1`` (the labels look this far ahead)."""
        return 0

    def manifest_fields(self, target) -> dict:
        """The manifest's leading keys (what readers of the labels check), before identity, models and counts."""
        raise NotImplementedError

    def rows_features(self, target):
        raise NotImplementedError

    def progress(self, todo: list[Part], worker: str) -> dict:
        """``tqdm`` keyword arguments for the bar over ``todo``."""
        raise NotImplementedError

    def label_part(self, part: Part, target, drafter, bar, clock) -> tuple[dict, dict]:
        """The rows and sequences columns of one part."""
        raise NotImplementedError

    def part_stats(self, rows: dict, seqs: dict) -> dict:
        """The part's meta keys after ``positions``: what its report sums."""
        return {}

    def part_timings(self) -> dict:
        """The part's meta keys after ``seconds``."""
        return {}

    def write_report(self, out: Path, run: dict) -> dict:
        raise NotImplementedError

    # ---- the driver ----

    def identity(self, models: dict) -> dict:
        from omegaconf import OmegaConf

        cfg = self.cfg
        ident = {k: cfg[k] for k in self.identity_keys}
        if self.rows_format is not None:
            ident["rows_format"] = self.rows_format
        ident["data"] = OmegaConf.to_container(cfg.data, resolve=True)
        ident["model"] = {"dtype": resolve_dtype(cfg.model.dtype, str(cfg.model.get("device") or "cpu")), "drafter_kind": cfg.model.drafter_kind,
                          "attn_implementation": cfg.model.get("attn_implementation") or "sdpa",
                          **{name: {f: d.get("sha256") for f, d in m["files"].items()} for name, m in models.items()}}
        return ident

    def run(self) -> dict:
        from omegaconf import OmegaConf
        from tqdm.auto import tqdm

        from eagle_backbone.loading import load_pair

        cfg = self.cfg
        self.check_config()
        torch.manual_seed(cfg.seed)
        set_threads(cfg.get("threads"))
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        clock = Clock()  # stage wall time (a CPU clock: it must not wait for the GPU between items)
        t_start = clock()

        if self.collection not in get_kind(cfg.model.drafter_kind).labelled_by:  # an unknown kind: the registered ones
            raise ValueError(f"model.drafter_kind={cfg.model.drafter_kind!r}: {self.drafter_use}; use an "
                             f"{' or '.join(kinds_labelled_by(self.collection))} model config")
        pair = load_pair(cfg.model)
        target, drafter = pair.target, pair.drafter
        manifest_path = out / "manifest.json"
        old = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
        overwrite = str(cfg.overwrite).lower()
        if old is not None and overwrite == "true":
            log.warning("overwrite=true: removing the collection in %s", out)
            remove_collection(out)
            old = None
        models = {name: folder_digest(cfg.model.get(name) or cfg.model.target, (old or {}).get("models", {}).get(name),
                                      cfg.hash_weights, tokenizer=name == "tokenizer")
                  for name in ("target", "drafter", "tokenizer")}
        identity = self.identity(models)
        if old is not None and old.get("identity") != identity:
            diff = settings_diff(old.get("identity", {}), identity)
            if overwrite == "changed":
                log.warning("%s holds a collection made with other settings (%s): starting over (overwrite=changed)",
                            out, "; ".join(diff[:8]))
                remove_collection(out)
                old = None
        if old is not None and old.get("identity") != identity:
            raise ValueError(f"{out} holds a collection made with other settings ({'; '.join(diff[:8])}); continue it "
                             "with the same settings, choose another out_dir, or pass overwrite=true to start over")
        remove_leftovers(out, "*/*")  # temporary files of a killed write

        items, data_counts = plan_items(cfg.data, pair.tokenizer,
                                        max_prompt_len=target.max_length - 1 - self.prompt_margin())
        worker = f"{cfg.shard_id:03d}-of-{cfg.num_shards:03d}"
        parts = plan_parts(items, cfg.shard_id, cfg.num_shards, cfg.shard_size)
        manifest = {**self.manifest_fields(target),
                    "identity": identity, "models": models, "tokenizer": str(cfg.model.tokenizer),
                    "config": OmegaConf.to_container(cfg, resolve=True), "data_counts": data_counts,
                    "num_prompts": len(items)}
        write_json(manifest_path, {**(old or {}), **manifest})

        rows_feat, seqs_feat = self.rows_features(target), sequences_features()
        todo = [p for p in parts if not Path(str(p.stem(out, worker)) + META_SUFFIX).is_file()]
        log.info("%d prompts in the collection; collector %s has %d parts, %d to do", len(items), worker, len(parts),
                 len(todo))
        if cfg.max_parts_this_run is not None:
            todo = todo[: cfg.max_parts_this_run]
        run = {"parts_written": 0, "positions": 0, "sequences": 0, "seconds": 0.0}
        bar = tqdm(**self.progress(todo, worker), disable=not cfg.progress)
        for part in todo:
            t0 = clock()
            rows, seqs = self.label_part(part, target, drafter, bar, clock)
            stem = part.stem(out, worker)
            stem.parent.mkdir(parents=True, exist_ok=True)
            write_arrow(Path(str(stem) + ROWS_SUFFIX), rows, rows_feat)
            write_arrow(Path(str(stem) + SEQS_SUFFIX), seqs, seqs_feat)
            seconds = clock() - t0
            positions = int(len(rows["index"]))
            write_json(Path(str(stem) + META_SUFFIX), {
                "split": part.split, "part": part.index, "worker": worker, "seq_ids": [it.seq_id for it in part.items],
                "sequences": len(part.items), "positions": positions, **self.part_stats(rows, seqs),
                "seconds": seconds, **self.part_timings(),
            })
            run["parts_written"] += 1
            run["positions"] += positions
            run["sequences"] += len(part.items)
            run["seconds"] += seconds
        bar.close()
        done = sum(Path(str(p.stem(out, worker)) + META_SUFFIX).is_file() for p in parts)
        run.update(wall_seconds=clock() - t_start, worker=worker, parts=len(parts), parts_complete=done,
                   complete=done == len(parts))
        report = self.write_report(out, run)
        manifest["counts"] = {k: report[k] for k in self.count_keys}
        write_json(manifest_path, manifest)
        return report


class OracleCollector(Collector):
    """The oracle's hooks: greedy responses, :func:`oracle_labels` per position, label histograms per part."""

    identity_keys = IDENTITY_KEYS
    drafter_use = "the oracle labels an EAGLE drafter (EAGLE-1 or EAGLE-3)"
    collection = "oracle"  # each kind's oracle_rows says how oracle_labels drafts its rows
    count_keys = ("sequences", "positions", "splits")
    k_max_why = " (labels are stored as int8)"
    dtype_keys = ("feature_dtype", "stat_dtype")
    rows_format = 2  # 2: target_stats (ldlp.models.features.confidence of the distribution behind last_token)

    def manifest_fields(self, target) -> dict:
        cfg = self.cfg
        return {"k_max": cfg.k_max, "store_features": cfg.store_features, "feature_dim": target.hidden_size,
                "store_draft_states": cfg.store_draft_states}

    def rows_features(self, target):
        cfg = self.cfg
        return rows_features(cfg.k_max, target.hidden_size if cfg.store_features else None, cfg.stat_dtype,
                             cfg.feature_dtype, state_dim=target.hidden_size if cfg.store_draft_states else None)

    def progress(self, todo: list[Part], worker: str) -> dict:
        self._seq_total, self._seq_done = sum(len(p.items) for p in todo), 0
        return dict(total=None, unit="pos", unit_scale=True, desc=f"oracle {worker}")

    def label_part(self, part: Part, target, drafter, bar, clock) -> tuple[dict, dict]:
        cfg = self.cfg
        self._gen_s = 0.0
        results = []
        rows = get_kind(cfg.model.drafter_kind).oracle_rows  # how this kind's rows are drafted
        for it in part.items:
            g0 = clock()
            response = autoregressive_generate(target, it.prompt_ids, cfg.max_new_tokens).tokens
            self._gen_s += clock() - g0
            lab = oracle_labels(target, drafter, list(it.prompt_ids) + response, len(it.prompt_ids), cfg.k_max,
                                full_target_prob=cfg.full_target_prob, max_rows_per_pass=cfg.max_rows_per_pass,
                                rows=rows)
            results.append((it, response, lab))
            self._seq_done += 1
            bar.update(len(lab["index"]))
            bar.set_postfix(seq=f"{self._seq_done}/{self._seq_total}")
        return _part_columns(results, cfg.k_max, cfg.store_features, target.hidden_size, target.eos_token_ids,
                             cfg.store_draft_states)

    def part_stats(self, rows: dict, seqs: dict) -> dict:
        labels, remaining, k_max = rows["label"], rows["remaining"], self.cfg.k_max
        return {"generated_tokens": int(sum(len(s) - p for s, p in zip(seqs["input_ids"], seqs["prompt_len"]))),
                "eos": int(sum(seqs["eos"])), "label_sum": int(labels.sum()),
                "label_hist": label_histogram(labels, k_max),
                "label_hist_uncensored": label_histogram(labels[remaining >= k_max], k_max)}

    def part_timings(self) -> dict:
        return {"generate_seconds": self._gen_s}

    def write_report(self, out: Path, run: dict) -> dict:
        return write_report(out, self.cfg.k_max, run)


def collect_oracle(cfg) -> dict:
    """Run (or continue) one collector; returns the report over all complete parts in ``cfg.out_dir``."""
    return OracleCollector(cfg).run()


# ---- report ----------------------------------------------------------------------------------------


def _summary(metas: list[dict], k_max: int) -> dict:
    positions = sum(m["positions"] for m in metas)
    hist = np.sum([m["label_hist"] for m in metas], axis=0).tolist() if metas else [0] * (k_max + 1)
    unc = np.sum([m["label_hist_uncensored"] for m in metas], axis=0).tolist() if metas else [0] * (k_max + 1)
    seconds = sum(m["seconds"] for m in metas)
    return {
        "sequences": sum(m["sequences"] for m in metas), "positions": positions,
        "generated_tokens": sum(m["generated_tokens"] for m in metas),
        "ended_with_eos": sum(m["eos"] for m in metas),
        "label_hist": hist, "mean_label": sum(m["label_sum"] for m in metas) / positions if positions else float("nan"),
        "frac_at_k_max": hist[k_max] / positions if positions else float("nan"),
        "uncensored_positions": int(sum(unc)),
        "frac_at_k_max_uncensored": unc[k_max] / sum(unc) if sum(unc) else float("nan"),
        "seconds": seconds, "generate_seconds": sum(m["generate_seconds"] for m in metas),
        "positions_per_s": positions / seconds if seconds else float("nan"),
    }


def write_report(out: Path, k_max: int, run: dict | None = None) -> dict:
    """Sum the complete parts' meta files into ``report.json`` (overall, per split, this run's share); returns it
    (``ldlp.report.labels`` renders its page)."""
    metas = [json.loads(p.read_text()) for p in committed_parts(out)]
    splits = sorted({m["split"] for m in metas})
    report = {"k_max": k_max, **_summary(metas, k_max), "parts": len(metas),
              "splits": {s: _summary([m for m in metas if m["split"] == s], k_max) for s in splits},
              "this_run": run or {}}
    write_json(out / "report.json", report)
    return report
