"""What a learned file was made for, and the check against the run it would drive.

Every learned file records the setup it was fitted on as ``made_for``: the model's name, the dtype, the drafter
kind and a digest of the drafter's weight files (``drafter_weights``), and where the file prices steps the CPU's
capabilities (``cpu_caps``). Before a run loads any weights, a file made for another setup is refused in one line
naming the file and both sides (:func:`check_made_for`; ``accept_mismatch=true`` takes it and the run's results
record it: :mod:`eagle_backbone.errors`). A field either side does not know is not compared, so files of before
the record are taken as they are.

Which fields a file is checked on is what its numbers depend on:

* acceptance models (LDLP checkpoints, the shipped predictor, acceptance and draft-acceptance heads) predict what
  a drafter's drafts keep: :data:`ACCEPTANCE_FIELDS`, the model, the drafter kind and its weights. The dtype is
  recorded but not refused: the labels of one dtype drive the other's drafts within rounding (the shipped
  predictor is trained on bfloat16 labels and runs in float32 where the CPU has no bf16 matmuls);
* costs (vLLM schedules; step-cost tables and tuned policy files carry their own keys) price a step on one
  machine: :data:`COST_FIELDS`, the dtype and the CPU's capabilities too.

The drafter digest is of the weight files (their sha256, as the label collectors' manifests record them), not of
the loaded tensors, so one file loaded in either dtype is one drafter.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eagle_backbone.io import file_sha256

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
ACCEPTANCE_FIELDS = ("model", "drafter_kind", "drafter_weights")
COST_FIELDS = ("model", "dtype", "drafter_kind", "drafter_weights", "cpu_caps")

def weights_digest(files: dict) -> str | None:
    """One digest of a folder's weight files from ``{file name: sha256}`` (or ``{name: {"sha256": ...}}``, as a
    manifest's folder digests hold them); config and tokenizer files do not count. None when a weight file has no
    hash or there is none."""
    shas = {}
    for name, entry in (files or {}).items():
        if Path(name).suffix not in WEIGHT_SUFFIXES:
            continue
        sha = entry.get("sha256") if isinstance(entry, dict) else entry
        if not isinstance(sha, str):
            return None
        shas[name] = sha
    if not shas:
        return None
    return hashlib.sha256(json.dumps(shas, sort_keys=True).encode()).hexdigest()


def folder_weights(folder: str | Path) -> str | None:
    """:func:`weights_digest` of the weight files in ``folder`` (each hashed once per process while its size and
    mtime hold: :func:`~eagle_backbone.io.file_sha256`); None for no such folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    return weights_digest({f.name: file_sha256(f) for f in sorted(folder.iterdir())
                           if f.is_file() and f.suffix in WEIGHT_SUFFIXES})


def run_made_for(model_cfg, costs: bool = False) -> dict:
    """This run's side (a ``model`` config; no weights load): the model's name, the dtype it loads in, the
    drafter kind and :func:`folder_weights` of its drafter folder; with ``costs`` the CPU's capabilities."""
    from eagle_backbone.runtime import resolve_dtype

    device = str(model_cfg.get("device") or "cpu")
    kind = model_cfg.get("drafter_kind")
    run = {"model": str(model_cfg.get("name", "")) or None, "dtype": resolve_dtype(model_cfg.get("dtype"), device),
           "drafter_kind": None if kind is None else str(kind),
           "drafter_weights": folder_weights(model_cfg.drafter) if model_cfg.get("drafter") else None}
    if costs:
        from eagle_backbone.cost import processor_caps

        run["cpu_caps"] = processor_caps(device)
    return run


def manifest_made_for(manifest: dict) -> dict:
    """``made_for`` of a label collector's ``manifest.json`` (its config's model name, its identity's dtype,
    drafter kind and drafter files): what a file fitted on those labels was made for."""
    model = (manifest.get("identity") or {}).get("model") or {}
    name = ((manifest.get("config") or {}).get("model") or {}).get("name")
    return {"model": None if name is None else str(name), "dtype": model.get("dtype"),
            "drafter_kind": model.get("drafter_kind"), "drafter_weights": weights_digest(model.get("drafter") or {})}


def made_for_of(meta: dict | None) -> dict | None:
    """The record of a learned file's ``meta``: its ``made_for``, else what its labels' identity (the shipped
    predictor's ``oracle_identity``) says; None for a file of before the record."""
    meta = meta or {}
    if isinstance(meta.get("made_for"), dict):
        return meta["made_for"]
    if isinstance(meta.get("oracle_identity"), dict):
        return manifest_made_for({"identity": meta["oracle_identity"]})
    return None


def check_made_for(where: str, made_for: dict | None, run: dict, fields, remedy: str, verb: str = "made") -> None:
    """Refuse (:func:`~eagle_backbone.errors.mismatch`) the file ``where`` when its ``made_for`` and ``run``
    differ on one of ``fields`` both know: one line naming the file ("was ``verb`` for another setup"), each
    field's two sides (digests to 12 characters) and ``remedy``."""
    from eagle_backbone.errors import mismatch

    if not isinstance(made_for, dict):
        return
    wrong = [f"{k}: {_short(made_for[k])} vs {_short(run[k])}" for k in fields
             if made_for.get(k) is not None and run.get(k) is not None and made_for[k] != run[k]]
    if wrong:
        mismatch(f"{where} was {verb} for another setup than this run's (the file's vs this run's: {'; '.join(wrong)}); "
                 f"{remedy}")


def _short(value) -> str:
    """A digest shortened to 12 characters (both sides stay told apart); anything else as repr."""
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return repr(value[:12])
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(value.items())) + "}"
    return repr(value)
