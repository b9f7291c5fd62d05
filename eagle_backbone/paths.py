"""Where things live. Configs say ``${repo:data/embedded/target}`` so that every script works from any
working directory (Hydra multiruns change it) without hard-coded absolute paths."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

REPO_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_DIR = REPO_ROOT / "data" / "embedded"


def repo_path(rel: str = "") -> str:
    """Absolute path of ``rel`` under the repository root; absolute paths pass through."""
    p = Path(rel).expanduser()
    return str(p if p.is_absolute() else REPO_ROOT / p)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("repo"):
        OmegaConf.register_new_resolver("repo", repo_path)


register_resolvers()
