"""The on-disk oracle store: every reader and writer of label files, and the manifest.

An oracle directory holds ``manifest.json`` (what was collected, with which models) and, per split,
parts of ``shard_size`` sequences written by one collector (``shard_id`` of ``num_shards``):
``{split}/{worker}.{part:05d}.rows.arrow`` (one row per index), ``.seqs.arrow`` (one row per
sequence) and ``.json`` (counts; written last, it marks the part as complete). The Arrow files are IPC
streams that ``datasets.Dataset.from_file`` memory-maps, so loading a collection of any size costs no
copy and no cache. Reading labels imports neither torch models nor Lightning.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from eagle_backbone.io import atomic_path, atomic_write_json

ROWS_SUFFIX, SEQS_SUFFIX, META_SUFFIX = ".rows.arrow", ".seqs.arrow", ".json"


def label_histogram(labels: np.ndarray, k_max: int) -> list[int]:
    return np.bincount(np.asarray(labels, dtype=np.int64), minlength=k_max + 1)[: k_max + 1].tolist()


def rows_features(k_max: int, feature_dim: int | None, stat_dtype: str = "float16", feature_dtype: str = "float16",
                  state_dim: int | None = None):
    """``datasets.Features`` of the rows table (``feature`` only when ``feature_dim`` is given; ``draft_state``,
    the drafter states of the k_max draft steps flattened row-major, only when ``state_dim`` is given)."""
    from datasets import Features, List, Value

    cols = {
        "seq_id": Value("int64"), "conversation_id": Value("string"), "split": Value("string"),
        "index": Value("int32"), "last_token": Value("int32"), "label": Value("int8"), "remaining": Value("int32"),
        "draft_top1_prob": List(Value(stat_dtype), length=k_max), "draft_entropy": List(Value(stat_dtype), length=k_max),
        "target_prob": List(Value(stat_dtype), length=k_max),
        # top-1 probability, top-1 - top-2 margin and entropy of the target's distribution that produced
        # last_token (ldlp.models.features.confidence), float32: the policies compute them from the engine's
        "target_stats": List(Value("float32"), length=3),
    }
    if feature_dim:
        cols["feature"] = List(Value(feature_dtype), length=feature_dim)
    if state_dim:
        cols["draft_state"] = List(Value(feature_dtype), length=k_max * state_dim)
    return Features(cols)


def acceptance_rows_features(k_max: int, state_dim: int | None, stat_dtype: str = "float32",
                              state_dtype: str = "float16"):
    """``datasets.Features`` of a per-position acceptance collection's rows table
    (:mod:`ldlp.labels.acceptance_labels`): per row, ``k_max`` values per depth of the drafted token, the
    drafter's probability features, the acceptance probability ``beta``, whether the draft was kept, and
    whether every earlier draft was (``valid``); ``draft_state`` (k_max, d) flattened when ``state_dim``."""
    from datasets import Features, List, Value

    per_depth = lambda dtype: List(Value(dtype), length=k_max)
    cols = {
        "seq_id": Value("int64"), "conversation_id": Value("string"), "split": Value("string"),
        "index": Value("int32"), "last_token": Value("int32"), "draft_tokens": per_depth("int32"),
        "draft_prob": per_depth(stat_dtype), "target_prob": per_depth(stat_dtype),
        "draft_log_top1": per_depth(stat_dtype), "draft_entropy": per_depth(stat_dtype),
        "draft_sum_sq": per_depth(stat_dtype), "beta": per_depth(stat_dtype),
        "kept": per_depth("int8"), "valid": per_depth("int8"),
    }
    if state_dim:
        cols["draft_state"] = List(Value(state_dtype), length=k_max * state_dim)
    return Features(cols)


def sequences_features():
    from datasets import Features, List, Value

    return Features({"seq_id": Value("int64"), "conversation_id": Value("string"), "split": Value("string"),
                     "input_ids": List(Value("int32")), "prompt_len": Value("int32"), "positions": Value("int32"),
                     "eos": Value("bool")})


def committed_parts(out_dir, split: str | None = None) -> list:
    """Meta files of the complete parts under ``out_dir`` (sorted: split, worker, part)."""
    from pathlib import Path

    out = Path(out_dir)
    metas = sorted(out.glob(f"{split or '*'}/*{META_SUFFIX}"))
    stem = lambda m: str(m)[: -len(META_SUFFIX)]  # noqa: E731
    return [m for m in metas if Path(stem(m) + ROWS_SUFFIX).is_file() and Path(stem(m) + SEQS_SUFFIX).is_file()]


def _load_tables(out_dir, suffix: str, split: str | None):
    from datasets import Dataset, concatenate_datasets

    metas = committed_parts(out_dir, split)
    if not metas:
        raise ValueError(f"{out_dir} holds no complete oracle parts" + (f" for split {split!r}" if split else "")
                         + ": collect them first (python scripts/collect_oracle.py)")
    parts = [Dataset.from_file(str(m)[: -len(META_SUFFIX)] + suffix) for m in metas]
    return concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def load_oracle_rows(out_dir, split: str | None = None):
    """All label rows as one memory-mapped ``datasets.Dataset``: seq_id, conversation_id, split, index,
    last_token, label, remaining, draft_top1_prob, draft_entropy, target_prob (and feature and draft_state when
    stored; draft_state is (k_max, d) flattened row-major)."""
    return _load_tables(out_dir, ROWS_SUFFIX, split)


def require_columns(rows, columns, where, hint: str = "") -> None:
    """Raise a ValueError naming the ``columns`` that the rows table lacks (and ``hint``: how to get them)."""
    missing = [c for c in columns if c not in rows.column_names]
    if missing:
        raise ValueError(f"{where}: the oracle rows lack the columns {missing} (have {rows.column_names})"
                         + (f"; {hint}" if hint else ""))


def read_rows(oracle_dir, columns, split: str | None = None, optional=(), hint: str = "") -> tuple[dict, dict]:
    """The oracle rows as numpy arrays, and the manifest: the one reader of rows into memory.

    ``columns`` must be stored (else a ValueError that names them, and ``hint``), ``optional`` ones are read
    when they are; ``draft_state`` comes back as (rows, k_max, d)."""
    manifest = read_manifest(oracle_dir)
    rows = load_oracle_rows(oracle_dir, split)
    require_columns(rows, columns, oracle_dir, hint)
    names = list(columns) + [c for c in optional if c in rows.column_names and c not in columns]
    data = rows.select_columns(names).with_format("numpy")[:]
    if "draft_state" in data:
        states = np.asarray(data["draft_state"])
        data["draft_state"] = states.reshape(len(states), int(manifest["k_max"]), -1)
    return data, manifest


def load_oracle_sequences(out_dir, split: str | None = None):
    """One row per sequence: seq_id, conversation_id, split, input_ids (prompt + response), prompt_len,
    positions (its number of label rows) and eos (whether the response ended with EOS)."""
    return _load_tables(out_dir, SEQS_SUFFIX, split)


def write_json(path: Path, obj) -> None:
    atomic_write_json(path, obj, newline=False, sort_keys=True, default=str)


def write_arrow(path: Path, columns: dict, features) -> None:
    """One Arrow IPC stream, schema from ``datasets.Features`` (so ``Dataset.from_file`` reads it back)."""
    schema = features.arrow_schema
    arrays = []
    for f in schema:
        col = columns[f.name]
        if pa.types.is_fixed_size_list(f.type):
            flat = np.ascontiguousarray(col).reshape(-1).astype(f.type.value_type.to_pandas_dtype())
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(flat), f.type.list_size))
        else:
            arrays.append(pa.array(col, type=f.type))
    table = pa.Table.from_arrays(arrays, schema=schema)
    with atomic_path(path) as tmp, pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_table(table)


def read_manifest(oracle_dir: str | Path) -> dict:
    path = Path(oracle_dir) / "manifest.json"
    if not path.is_file():
        raise ValueError(f"{oracle_dir} has no manifest.json: is it an oracle directory? "
                         f"(collect labels first: python scripts/collect_oracle.py)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if "k_max" not in manifest:
        raise ValueError(f"{path}: missing key 'k_max'")
    return manifest


def collection_status(oracle_dir: str | Path) -> dict:
    """How much of the collection ``manifest.json`` plans is on disk: sequences planned (``num_prompts``,
    every collector's together), sequences in complete parts, and the difference."""
    manifest = read_manifest(oracle_dir)
    metas = committed_parts(oracle_dir)
    planned = manifest.get("num_prompts")
    on_disk = 0
    for m in metas if planned is not None else ():
        try:
            on_disk += int(json.loads(m.read_text())["sequences"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{m}: not a part's meta file ({e!r}); remove the part's three files and rerun the "
                             "collector to redo it") from None
    shards = int((manifest.get("config") or {}).get("num_shards") or 1)
    return {"sequences_planned": planned, "sequences_on_disk": on_disk, "parts_on_disk": len(metas),
            "missing_sequences": None if planned is None else max(0, int(planned) - on_disk), "num_shards": shards}


def require_complete(oracle_dir: str | Path, allow_partial: bool = False) -> dict:
    """Refuse an incomplete collection (fewer sequences in complete parts than the manifest plans), naming
    how many are missing and the command that completes it; ``allow_partial`` trains on it anyway (with a
    warning). Returns :func:`collection_status` with ``complete`` and ``allow_partial``, for the exported config."""
    import logging

    status = collection_status(oracle_dir)
    missing = status["missing_sequences"]
    status.update(complete=missing == 0 if missing is not None else None, allow_partial=bool(allow_partial))
    log = logging.getLogger(__name__)
    if missing is None:
        log.warning("%s/manifest.json does not record num_prompts (an older collector): cannot check that the "
                    "collection is complete", oracle_dir)
    elif missing:
        n = status["num_shards"]
        cmd = f"python scripts/collect_oracle.py out_dir={oracle_dir}" + (
            f" num_shards={n} shard_id=I, for every I in 0..{n - 1}" if n > 1 else "")
        msg = (f"{oracle_dir}: incomplete oracle collection: {missing} of {status['sequences_planned']} sequences "
               f"are missing ({status['sequences_on_disk']} in {status['parts_on_disk']} complete parts); complete it "
               f"with `{cmd}` and the settings it was started with")
        if not allow_partial:
            raise ValueError(msg + ", or pass allow_partial=true to train on the parts there are")
        log.warning("%s; training anyway (allow_partial=true)", msg)
    return status


def split_by_conversation(conversation_ids: list[str], splits: list[str], val_fraction: float,
                          seed: int) -> np.ndarray:
    """Boolean mask of validation rows. Keeps the oracle's split when it has both train and validation
    rows; otherwise holds out a seeded ``val_fraction`` of the conversations (never part of one)."""
    splits = np.asarray(splits)
    if (splits == "validation").any() and (splits == "train").any():
        return splits == "validation"
    convs = np.asarray(conversation_ids)
    unique = np.unique(convs)
    if len(unique) < 2:
        raise ValueError(f"cannot split {len(unique)} conversation(s) into train and validation")
    n_val = min(len(unique) - 1, max(1, round(val_fraction * len(unique))))
    held = np.random.default_rng(seed).permutation(unique)[:n_val]
    return np.isin(convs, held)
