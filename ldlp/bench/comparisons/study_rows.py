"""The oracle rows the predictor study and the shipped predictor read (``scripts/study_predictors.py``,
``scripts/train_step_ldlp.py``): one collection, or several of the same pair and labelling settings read as one
(a collection grown in a second folder with ``data.exclude_collections``)."""

from __future__ import annotations

import numpy as np

from ldlp.bench.harness.replay import OracleRows


def rows_subset(rows: OracleRows, keep_seqs: np.ndarray, max_new_tokens) -> OracleRows:
    """The rows of the sequences ``keep_seqs``."""
    mask = np.isin(rows.cols["seq_id"], keep_seqs)
    return OracleRows({k: v[mask] for k, v in rows.cols.items()}, max_new_tokens)


def oracle_dirs(oracle_dir) -> list[str]:
    """``oracle_dir`` as a list: one collection, or several of the same pair and settings (a collection grown in a
    second folder with ``data.exclude_collections``)."""
    return [str(oracle_dir)] if isinstance(oracle_dir, (str, bytes)) or not hasattr(oracle_dir, "__iter__") \
        else [str(d) for d in oracle_dir]


def require_collections(oracle_dir, allow_partial: bool = False) -> list[dict]:
    """Every collection of ``oracle_dir`` checked complete (:func:`ldlp.labels.store.require_complete`: an incomplete
    one is refused in one line naming what is missing, unless ``allow_partial``), before anything loads; their
    statuses, for the exported config."""
    from ldlp.labels.store import require_complete

    return [{"dir": d, **require_complete(d, bool(allow_partial))} for d in oracle_dirs(oracle_dir)]


def oracle_record(oracle_dir) -> dict | list:
    """What a study or a predictor records of its collections (one: a dict, as before; several: a list)."""
    from ldlp.labels.store import read_manifest

    out = []
    for d in oracle_dirs(oracle_dir):
        m = read_manifest(d)
        out.append({"dir": d, "counts": m.get("counts"), "identity": m.get("identity")})
    return out[0] if len(out) == 1 else out


def load_split(oracle_dir, split: str, limit: int | None) -> OracleRows:
    """The split's rows with the features the study reads (a collection without them: one line saying so), from one
    collection or several (their sequence ids numbered on, in the order given; collections without the split are
    skipped; collections of another pair or other labelling settings are refused)."""
    from ldlp.labels.store import committed_parts, read_manifest, read_rows

    dirs, chunks, offset, first = oracle_dirs(oracle_dir), [], 0, None
    for d in dirs:
        manifest = read_manifest(d)
        same = {k: (manifest.get("identity") or {}).get(k) for k in ("model", "k_max", "max_new_tokens", "rows_format",
                                                                        "temperature", "seed")}
        if first is None:
            first = (d, same)
        elif same != first[1]:
            diff = sorted(k for k in same if same[k] != first[1][k])
            raise ValueError(f"oracle_dir: {d} was labelled with other settings than {first[0]} ({', '.join(diff)}); "
                             "collections read together must share the pair and the labelling settings")
        if len(dirs) > 1 and not committed_parts(d, split):
            continue
        data, manifest = read_rows(d, OracleRows.COLUMNS + ("target_stats", "feature"), split,
                                   hint="the study needs a collection with features and target_stats (rows format 2): "
                                        "collect one with python scripts/collect_oracle.py")
        data["seq_id"] = np.asarray(data["seq_id"]) + offset
        offset = int(data["seq_id"].max()) + 1
        chunks.append((data, manifest.get("max_new_tokens")))
    if not chunks:
        raise ValueError(f"oracle_dir: no collection among {dirs} has a {split} split")
    data = {k: np.concatenate([np.asarray(c[0][k]) for c in chunks]) for k in chunks[0][0]}
    rows = OracleRows(data, chunks[0][1])
    if limit is not None:
        seqs = np.unique(rows.cols["seq_id"])[: int(limit)]
        rows = rows_subset(rows, seqs, manifest.get("max_new_tokens"))
    return rows
