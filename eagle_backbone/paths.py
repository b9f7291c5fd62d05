"""Where things live. Configs say ``${repo:data/embedded/target}`` (or ``${paths.ldlp}``, conf/paths/) so
that every script works from any working directory (Hydra multiruns change it) without hard-coded
absolute paths; :func:`embedded_model_config` gives the shipped pair's model config from Python."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

REPO_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_DIR = REPO_ROOT / "data" / "embedded"
CONF_DIR = REPO_ROOT / "conf"


def repo_path(rel: str = "") -> str:
    """Absolute path of ``rel`` under the repository root; absolute paths pass through."""
    p = Path(rel).expanduser()
    return str(p if p.is_absolute() else REPO_ROOT / p)


def model_folder(path: str, variable: str, key: str = "target") -> str:
    """``path`` when it holds a model (config.json); otherwise an error that names the environment variable
    and the override to set. Configs of external models use it: ``${model_folder:${oc.env:VICUNA_PATH,...},VICUNA_PATH}``."""
    if not (Path(str(path)).expanduser() / "config.json").is_file():
        raise FileNotFoundError(f"no model at {path} (no config.json): set {variable} to the model "
                                f"folder or pass model.{key}=/path/to/it (nothing is downloaded)")
    return str(path)


def embedded_model_config(**overrides):
    """The shipped embedded pair's model config (conf/model/embedded.yaml) with absolute paths resolved from
    the package, not the working directory; ``overrides`` replace its fields. Pass it to
    ``eagle_backbone.loading.load_pair``::

        pair = load_pair(embedded_model_config())
    """
    cfg = OmegaConf.merge(OmegaConf.load(CONF_DIR / "model" / "embedded.yaml"), overrides)
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("repo"):
        OmegaConf.register_new_resolver("repo", repo_path)
    if not OmegaConf.has_resolver("model_folder"):
        OmegaConf.register_new_resolver("model_folder", model_folder)


register_resolvers()
