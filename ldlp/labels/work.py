"""What a collection is made of, planned before anything runs: the prompts as work items with a fixed
``seq_id`` (:func:`plan_items`), a collector's parts (:func:`plan_parts`), and the digests of the model folders
and settings that ``manifest.json`` guards (:func:`folder_digest`, :func:`settings_diff`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eagle_backbone.data.conversations import build_prompts, held_out, load_conversations
from eagle_backbone.io import file_sha256
from eagle_backbone.made_for import WEIGHT_SUFFIXES

# settings that change what the files contain; a rerun must agree on them to continue a collection
IDENTITY_KEYS = ("seed", "k_max", "max_new_tokens", "store_features", "store_draft_states", "feature_dtype",
                 "stat_dtype", "full_target_prob", "max_rows_per_pass", "shard_size", "num_shards")
MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


@dataclass
class WorkItem:
    seq_id: int
    split: str
    conversation_id: str
    prompt_ids: list[int]


@dataclass
class Part:
    split: str
    index: int
    items: list[WorkItem] = field(default_factory=list)

    def stem(self, out_dir: Path, worker: str) -> Path:
        return out_dir / self.split / f"{worker}.{self.index:05d}"


# ---- planning --------------------------------------------------------------------------------------


def _take(convs: list[dict], limit: int | None, seed: int | None) -> list[dict]:
    if limit is None or len(convs) <= limit:
        return convs
    if seed is None:
        return convs[:limit]
    keep = sorted(np.random.default_rng(seed).choice(len(convs), size=limit, replace=False).tolist())
    return [convs[i] for i in keep]


def excluded_conversations(dirs) -> set[str]:
    """Conversation ids already labelled in the collections ``dirs`` (data.exclude_collections)."""
    from pathlib import Path

    from eagle_backbone.errors import MissingInput
    from ldlp.labels.store import load_oracle_sequences

    ids: set[str] = set()
    for d in dirs:
        if not (Path(d) / "manifest.json").is_file():
            raise MissingInput(f"data.exclude_collections: {d} holds no collection (no manifest.json)")
        ids.update(str(c).split("@turn")[0] for c in load_oracle_sequences(d)["conversation_id"])  # ID@turnK: ID
    return ids


def _drop(convs: list[dict], exclude: set[str]) -> list[dict]:
    return [c for c in convs if c["id"] not in exclude]


def split_conversations(data) -> tuple[list[tuple[str, list[dict]]], dict]:
    """``[(split, conversations), ...]`` from a data config, and counts for the manifest.

    The data file's own conversations form split ``data.split``; validation conversations come from
    ``data.validation_path`` (same format) or, for a single file such as ShareGPT, from a stable
    ``data.holdout_percent`` share of it chosen by conversation id.
    """
    split = data.get("split", "train")
    holdout = float(data.get("holdout_percent", 0) or 0)
    val_path = data.get("validation_path")
    if holdout and val_path:
        raise ValueError("data.validation_path and data.holdout_percent are both set: choose one source of "
                         "validation conversations")
    seed = data.get("sample_seed")
    exclude = excluded_conversations(data.get("exclude_collections") or [])
    common = dict(fmt=data.get("format", "auto"), on_error=data.get("on_error", "raise"),
                  build_if_missing=bool(data.get("build_if_missing", False)))
    counts = {}
    if holdout:
        convs = load_conversations(data.path, **common)
        counts["skipped_records"] = convs.skipped
        val = [c for c in convs if held_out(c["id"], holdout)]
        convs = [c for c in convs if not held_out(c["id"], holdout)]
        out = [(split, _take(_drop(convs, exclude), data.get("limit"), seed)),
               ("validation", _take(_drop(val, exclude), data.get("validation_limit"), seed))]
    else:
        limit = lambda n: None if exclude else n  # noqa: E731 (sample after leaving the excluded out)
        convs = load_conversations(data.path, limit=limit(data.get("limit")), sample_seed=seed, **common)
        counts["skipped_records"] = convs.skipped
        out = [(split, _take(_drop(convs, exclude), data.get("limit"), seed) if exclude else convs)]
        if val_path:
            val = load_conversations(val_path, limit=limit(data.get("validation_limit")), sample_seed=seed, **common)
            counts["skipped_records"] += val.skipped
            out.append(("validation", _take(_drop(val, exclude), data.get("validation_limit"), seed) if exclude else val))
    if exclude:
        counts["excluded_conversations"] = len(exclude)
    if len({s for s, _ in out}) != len(out):
        raise ValueError(f"data.split={split!r} collides with the validation split; name it differently")
    counts["conversations"] = {s: len(c) for s, c in out}
    return [(s, c) for s, c in out if c], counts


def plan_items(data, tokenizer, max_prompt_len: int) -> tuple[list[WorkItem], dict]:
    """All prompts of the collection, numbered: the same list on every run and every collector."""
    splits, counts = split_conversations(data)
    items, dropped = [], 0
    max_tokens = data.get("max_prompt_tokens")
    max_tokens = max_prompt_len if max_tokens is None else min(max_tokens, max_prompt_len)
    for split, convs in splits:
        prompts = build_prompts(tokenizer, convs, max_tokens, data.get("turns", "first"), data.get("chat_template"))
        dropped += prompts.too_long
        for cid, ids in prompts:
            items.append(WorkItem(len(items), split, cid, ids))
    counts["prompts_dropped_too_long"] = dropped
    counts["prompts"] = {s: sum(1 for it in items if it.split == s) for s, _ in splits}
    if not items:
        raise ValueError(f"{data.path}: no prompts to collect (all conversations dropped; max_prompt_tokens="
                         f"{data.get('max_prompt_tokens')})")
    return items, counts


def plan_parts(items: list[WorkItem], shard_id: int, num_shards: int, shard_size: int) -> list[Part]:
    parts: list[Part] = []
    for it in items:
        if it.seq_id % num_shards != shard_id:
            continue
        if not parts or parts[-1].split != it.split or len(parts[-1].items) >= shard_size:
            index = sum(1 for p in parts if p.split == it.split)
            parts.append(Part(it.split, index))
        parts[-1].items.append(it)
    return parts


# ---- files -----------------------------------------------------------------------------------------


def folder_digest(folder, previous: dict | None = None, hash_weights: bool = True, tokenizer: bool = False) -> dict:
    """Weight and config files (or tokenizer files) of a folder with size and sha256; a hash is reused
    from ``previous`` while size and mtime agree, so reruns do not re-read multi-GB weights."""
    folder = Path(folder)
    previous = previous or {}
    files = {}
    for f in sorted(folder.iterdir()):
        wanted = f.name in TOKENIZER_FILES if tokenizer else (f.suffix in WEIGHT_SUFFIXES or f.name in MODEL_FILES)
        if not f.is_file() or not wanted:
            continue
        st = f.stat()
        old = previous.get("files", {}).get(f.name, {})
        entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if old.get("size") == st.st_size and old.get("mtime_ns") == st.st_mtime_ns and old.get("sha256"):
            entry["sha256"] = old["sha256"]
        elif hash_weights:
            entry["sha256"] = file_sha256(f)
        files[f.name] = entry
    return {"path": str(folder.resolve()), "files": files}


def settings_diff(a, b, prefix="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += settings_diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix[:-1]}: {a!r} -> {b!r}"]
