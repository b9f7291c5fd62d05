"""Build target, candidate generator and tokenizer from a ``model`` config (``conf/model/*.yaml``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_backbone.candidates import CandidateGenerator
from eagle_backbone.drafter import EagleDrafter
from eagle_backbone.drafter_kinds import get_kind, make_candidates
from eagle_backbone.eagle3 import Eagle3Drafter
from eagle_backbone.runtime import resolve_dtype
from eagle_backbone.target import TargetModel


@dataclass
class ModelPair:
    target: TargetModel
    candidates: CandidateGenerator
    tokenizer: object
    drafter: torch.nn.Module  # EagleDrafter, Eagle3Drafter or a causal LM


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def load_drafter(kind: str, path: str | Path, dtype: str = "float32", device: str = "cpu",
                 trust_remote_code: bool = False):
    """The drafter model of ``model.drafter_kind`` ``kind`` (:mod:`eagle_backbone.drafter_kinds`) in folder ``path``."""
    cls = get_kind(kind)
    dtype = resolve_dtype(dtype, device)  # auto: bfloat16 where the device has bf16 matmuls, else float32
    return cls.load(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)


def check_drafter_fits(kind: str, drafter: str | Path, target: str | Path) -> None:
    """Refuse, before either model loads, a drafter folder that cannot serve the target folder: the kind's own
    check (an EAGLE drafter, ``eagle`` or ``eagle3``, reads the target's hidden states and tokens, so its
    ``hidden_size`` and ``vocab_size`` must be the target's; a draft LM has its own sizes: not checked)."""
    get_kind(kind).check_fits(drafter, target)


# what tells two targets apart in their config.json (a folder of the same model elsewhere has the same)
_MODEL_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "vocab_size", "max_position_embeddings")


def check_verifier(config_file: Path, raw: dict, target: str | Path, raw_target: dict) -> None:
    """An EAGLE-3 head in speculators' layout names the target it was trained for (``speculators_config.verifier
    .name_or_path``, what ``vllm serve <head>`` loads as its target): it must be this run's. The name is this target
    when it resolves (absolute, or relative to the repository root, the working directory or the head's folder) to
    the target's folder or to a folder whose config.json describes the same model; a name that is no folder here (a
    hub id) when its last part is the target folder's name. Otherwise the head is refused in one line naming both
    (:func:`~eagle_backbone.errors.mismatch`: ``accept_mismatch=true`` takes it, recorded). A head without the record
    (EAGLE's layout) is taken as it is."""
    from eagle_backbone.errors import mismatch
    from eagle_backbone.paths import REPO_ROOT

    name = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if not name or not isinstance(name, str):
        return
    target = Path(target)
    tried = [Path(name)] if Path(name).is_absolute() else [REPO_ROOT / name, Path.cwd() / name,
                                                             config_file.parent / name]
    local = next((p for p in tried if (p / "config.json").is_file()), None)
    if local is not None:
        if local.resolve() == target.resolve():
            return
        try:
            theirs = json.loads((local / "config.json").read_text())
        except (OSError, ValueError):
            theirs = {}
        differ = [f"{k} {theirs.get(k)!r} vs {raw_target.get(k)!r}" for k in _MODEL_FIELDS
                  if theirs.get(k) != raw_target.get(k)]
        if theirs and not differ:
            return  # the same model in another folder
        why = f"the folder {local}, whose config.json differs: {'; '.join(differ[:3]) or 'unreadable'}"
    else:
        if Path(name.rstrip("/")).name.lower() == target.resolve().name.lower():
            return
        why = f"no folder here, and not named {target.resolve().name!r}"
    mismatch(f"{config_file}: speculators_config.verifier.name_or_path is {name!r} ({why}), but this run's target is "
             f"{target}; an EAGLE-3 head drafts for the target it was trained on: give its own target (model.target) "
             "or a head trained for this one")


def tie_drafter_embedding(drafter, target: TargetModel) -> bool:
    """Give an EAGLE drafter whose checkpoint ships no ``embed_tokens.weight`` the target's embedding (EAGLE's
    releases share it with the target); checks the shapes. Returns whether it tied; a no-op otherwise."""
    if (isinstance(drafter, (EagleDrafter, Eagle3Drafter)) and not drafter.has_own_embedding
            and drafter.embed_tokens is not target.embed_tokens):
        drafter.tie_embedding(target.embed_tokens)
        return True
    return False


def load_target(cfg) -> TargetModel:
    """The target of a ``model`` config (path, dtype, device, attention implementation, remote code); dtype
    ``auto`` is bfloat16 where the device has bf16 matmuls and float32 elsewhere (eagle_backbone.runtime)."""
    device = cfg.get("device", "cpu")
    return TargetModel.from_pretrained(cfg["target"], dtype=resolve_dtype(cfg.get("dtype", "float32"), device),
                                       device=device,
                                       trust_remote_code=bool(cfg.get("trust_remote_code", False)),
                                       attn_implementation=cfg.get("attn_implementation") or "sdpa")


def load_pair(cfg) -> ModelPair:
    """``cfg`` (a DictConfig or dict) has target, tokenizer, drafter, drafter_kind, dtype, device, trust_remote_code
    and optionally attn_implementation (default sdpa)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(dict(cfg)) if isinstance(cfg, dict) else cfg
    for key in ("target", "drafter"):
        if not (Path(cfg[key]) / "config.json").exists():
            raise ValueError(f"model.{key}={cfg[key]} has no config.json: train or download it first "
                             "(nothing is fetched at run time)")
    check_drafter_fits(cfg.drafter_kind, cfg.drafter, cfg.target)
    remote = bool(cfg.get("trust_remote_code", False))
    target = load_target(cfg)
    drafter = load_drafter(cfg.drafter_kind, cfg.drafter, cfg.dtype, cfg.device, remote)
    tie_drafter_embedding(drafter, target)
    tokenizer = load_tokenizer(cfg.get("tokenizer") or cfg.target, remote)
    attn = cfg.get("attn_implementation") or "sdpa"
    return ModelPair(target, make_candidates(cfg.drafter_kind, drafter, target, attn if attn == "eager" else "sdpa"),
                     tokenizer, drafter)
