"""How the main command composes its stages' configs: Hydra composition from conf/, and which of the main command's
overrides reach which stage (those of :data:`FORWARDED` whose top-level key the stage's script's config has)."""

from __future__ import annotations

from pathlib import Path

from eagle_backbone.paths import CONF_DIR
from ldlp.pipeline.stage import Stage, override_key

# the main command's overrides of these top-level keys reach every stage whose script's config has the key
# (model.dtype=float32, generation.max_new_tokens=32, data.limit=8, paths.data_dir=X, threads=2); a stage on
# another model (the peer sweeps' draft LM) keeps its own name and drafter
FORWARDED = ("model", "generation", "data", "paths", "threads")
PEER_OWN = ("model.name", "model.drafter", "model.drafter_kind")


def list_arg(values) -> str:
    return ",".join(str(v) for v in values)


def checkpoint_args(cfg) -> list[str]:
    """The checkpoint folders the policies read, as overrides for every script that builds policies."""
    p = cfg.paths
    return [f"ldlp_path={p.ldlp}", f"acceptance_path={p.acceptance}", f"ldlp_survival_path={p.ldlp_survival}",
            f"learned_path={p.predictor}"]


def thread_args(cfg) -> list[str]:
    threads = cfg.get("threads")
    return [f"threads={'null' if threads is None else int(threads)}"]


def model_folders(cfg, model: str, overrides=(), peer: bool = False) -> tuple[str, ...]:
    """The folders (target, drafter, tokenizer) of ``model=<model>`` as the sweeps compose it."""
    m = compose_model(cfg, model, overrides, peer)
    return tuple(dict.fromkeys(str(m[k]) for k in ("target", "drafter", "tokenizer") if m.get(k)))


def compose(config_name: str, overrides: list[str]):
    """conf/<config_name>.yaml with ``overrides``, as its script composes it (inside a Hydra app: in its context)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import eagle_backbone.paths  # noqa: F401  (registers ${repo:...})

    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name=config_name, overrides=list(overrides))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


def compose_model(cfg, model: str, overrides=(), peer: bool = False):
    """``model=<model>`` as the stages compose it: the sweeps' model.* overrides, then the main command's."""
    mine = [o for o in forwarded(overrides, ("model",), peer) if override_key(o) != "model"]
    return compose("evaluate", [f"model={model}"] + [o for o in cfg.sweep.overrides if o.startswith("model.")]
                   + mine).model


def forwarded(overrides, keys, peer: bool = False) -> list[str]:
    """The main command's ``overrides`` that a script whose config has the top-level ``keys`` is given: those of
    FORWARDED it has (not ``model=``, the main command's model choice, which every stage gets as ``model=<option>``),
    without the peer model's own name and drafter on a stage that runs another model (``peer``)."""
    out = []
    for o in overrides or ():
        key = override_key(o)
        top = key.split(".", 1)[0]
        if top in FORWARDED and top in keys and key != "model" and not (peer and key in PEER_OWN):
            out.append(o)
    return out


_script_keys_cache: dict[str, frozenset] = {}


def script_keys(script: str) -> frozenset:
    """The top-level keys of ``scripts/<script>``'s config (conf/<stem>.yaml, composed)."""
    if script not in _script_keys_cache:
        _script_keys_cache[script] = frozenset(compose(Path(script).stem, []).keys())
    return _script_keys_cache[script]


def apply_overrides(cfg, stages: list[Stage], overrides, model: str) -> list[Stage]:
    """Give every stage the main command's overrides its script's config contains, after its own (an override of a
    key the stage sets replaces the stage's value), and record the dtype its model resolves to on this machine."""
    from eagle_backbone.runtime import resolve_dtype

    models: dict = {}
    for stage in stages:
        chosen = next((a.split("=", 1)[1] for a in stage.args if a.startswith("model=")), None)
        peer = chosen is not None and chosen != model
        add = forwarded(overrides, script_keys(stage.script), peer)
        if add:
            keys = {override_key(o) for o in add}
            stage.args = [a for a in stage.args if a == "-m" or override_key(a) not in keys] + add
        if chosen is not None:
            if (chosen, peer) not in models:
                models[chosen, peer] = compose_model(cfg, chosen, overrides, peer)
            m = models[chosen, peer]
            stage.resolved = {"model.dtype": resolve_dtype(m.get("dtype"), str(m.get("device") or "cpu"))}
    return stages

