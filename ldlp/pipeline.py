"""The main command's stages: each a subprocess of a Hydra script, skipped when the fingerprint of its inputs
matches the one stored next to its output (docs/pipeline.md says why subprocesses, and how fingerprints work).

    corpus      python scripts/build_corpus.py        -> paths.embedded/corpus (gitignored)
    oracle      python scripts/collect_oracle.py      -> paths.oracle          (data/oracle/<model>)
    ldlp        python scripts/train_ldlp.py          -> paths.ldlp            (data/ldlp/<model>)
    acceptance  python scripts/train_acceptance.py    -> paths.acceptance      (data/acceptance/<model>)
    tune        python scripts/tune_policies.py       -> paths.results/tuning  (outputs/results/<model>/tuning)
    sweeps      python scripts/evaluate.py -m ...     -> paths.runs/round-R/<sweep>
    summary     ldlp.report.summary.summarize         -> paths.results         (results.md/.csv, tokens_per_s.png)
    bench_batch python scripts/bench_batch.py         -> paths.results/load_sweep (the load sweep's short version)
    head_to_head python scripts/compare.py            -> paths.runs/head_to_head
    publish     (publish=true only)                   -> paths.published       (results/<model>, committed) + README

Every stage is a :class:`Stage` record (script, overrides, output folder, upstream stages, inputs); :func:`plan`
lists them, :func:`head_to_head_stage` adds the last one once the sweeps' summary has chosen its contenders.
Sweeps are repeated ``sweep.rounds`` times, one after the other, so every policy is measured in every phase
of a noisy machine; the summary reports medians over rounds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle_backbone.io import atomic_write_json, tmp_owner
from eagle_backbone.paths import CONF_DIR, REPO_ROOT
from ldlp.report.publish import (PUBLISHED_FILES, headline_block, publish, publish_run,  # noqa: F401 (re-exported)
                                 results_page, write_run_manifest)

FINGERPRINT = "stage.json"  # next to every stage's output: the fingerprint of its inputs, and whether it finished
SKIP_IN_OUTPUTS = {FINGERPRINT, "logs", ".hydra"}  # not part of a stage's output for its downstream stages
COMMON_CONFIGS = ("paths/*.yaml", "model/*.yaml", "hydra/help/*.yaml")
CONTENT_HASH_LIMIT = 64 << 20  # upstream output files up to this size are hashed by content, larger ones by size and mtime
# the main command's overrides of these top-level keys reach every stage whose script's config has the key
# (model.dtype=float32, generation.max_new_tokens=32, data.limit=8, paths.data_dir=X, threads=2); a stage on
# another model (the peer sweeps' draft LM) keeps its own name and drafter
FORWARDED = ("model", "generation", "data", "paths", "threads")
PEER_OWN = ("model.name", "model.drafter", "model.drafter_kind")
LOCK = ".pipeline.lock"  # in paths.data_dir and paths.outputs: one main command at a time on those folders
# expected seconds per stage (by stage name, sweeps by kind; "start": a process that loads the models and exits) where this machine has no stage_seconds.json yet,
# on an idle 2-core CPU, per the dtype model.dtype resolves to (docs/pipeline.md#how-long-it-takes).
# bfloat16: a CPU with bf16 matmuls, the committed run's stage_seconds.json (the load sweep and the head to head
# scaled to their present sizes). float32: a CPU without them (AMD EPYC Zen 3), projected: the oracle from its
# 773 s in bf16 there and the 2.4x float32 gain measured on it, the decoding stages from its 2.3x lower
# tokens/s at static γ=6 (results/embedded/batch1_parity_float32) than the bf16 machine's sweep.
EXPECTED_S = {
    "bfloat16": {"start": 6, "corpus": 20, "oracle": 108, "ldlp": 22, "acceptance": 13, "tune": 24, "sweep:static": 59,
                 "sweep:adaptive": 58, "sweep:peer_static": 12, "sweep:peer": 39, "bench_batch": 125,
                 "head_to_head": 205},
    "float32": {"start": 8, "corpus": 21, "oracle": 326, "ldlp": 50, "acceptance": 30, "tune": 55, "sweep:static": 136,
                "sweep:adaptive": 133, "sweep:peer_static": 28, "sweep:peer": 90, "bench_batch": 290,
                "head_to_head": 470},
}


@dataclass
class Stage:
    """One step of the main command: ``python scripts/<script> <args>``, writing into ``out``."""

    name: str  # unique: corpus, oracle, ldlp, ldlp_survival, acceptance, tune, sweep:<kind>:<round>, head_to_head
    title: str
    script: str  # a file in scripts/
    args: list[str]  # Hydra overrides ("-m" first for a multirun)
    out: Path  # the folder it writes; its fingerprint is stored there
    after: tuple[str, ...] = ()  # upstream stages whose outputs it reads
    reads: tuple[str, ...] = ()  # folders it reads that no stage writes (model weights), hashed by content
    configs: tuple[str, ...] = ()  # globs under conf/ of the YAML files it composes
    group: str = ""  # what force= names it by (default: its name)
    clear: bool = False  # remove ``out`` before it runs (a half-finished multirun is redone whole)
    product: str | None = None  # a file in ``out`` without which the stage is not done, whatever stage.json says
    extra: list[str] = field(default_factory=list)  # overrides added at run time, not part of the fingerprint
    resolved: dict = field(default_factory=dict)  # settings its script resolves on this machine (model.dtype=auto)
    fills: tuple[str, ...] = ()  # reads it creates when missing (the cost table): hashed again once it finished
    resumes: bool = False  # continues a partial output (the oracle's parts): reset first when its inputs changed
    parallel: int = 1  # collectors side by side (shard_id=0..N-1 of num_shards=N, in args): see StageRunner.commands

    @property
    def command(self) -> list[str]:
        return [sys.executable, str(REPO_ROOT / "scripts" / self.script)] + self.args + self.extra

    @property
    def force_group(self) -> str:
        return self.group or self.name


# ---- fingerprints ------------------------------------------------------------------------------------------

_content_hashes: dict[tuple, str] = {}


def _file_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _content_hashes:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _content_hashes[key] = h.hexdigest()
    return _content_hashes[key]


def content_digest(folder: str | Path) -> dict:
    """{file: sha256} of a model folder's files (weights, configs, tokenizer), hashed once per size and mtime."""
    folder = Path(folder)
    if folder.is_file():
        return {folder.name: _file_sha256(folder)}
    if not folder.is_dir():
        return {}
    return {str(f.relative_to(folder)): _file_sha256(f) for f in sorted(folder.rglob("*"))
            if f.is_file() and not f.name.startswith(".") and f.suffix != ".md"}


def output_digest(folder: str | Path) -> dict:
    """{file: sha256, or [size, mtime_ns] for files over CONTENT_HASH_LIMIT} of what a stage wrote: a stage
    rerun with other results, or a folder rewritten by hand, changes it, so the stages downstream run
    again; the same files written again (a deterministic rebuild) do not."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    out = {}
    for f in sorted(folder.rglob("*")):
        rel = f.relative_to(folder)
        if f.is_file() and not SKIP_IN_OUTPUTS & set(rel.parts) and not f.name.endswith(".tmp") and tmp_owner(f) is None:
            st = f.stat()
            out[str(rel)] = _file_sha256(f) if st.st_size <= CONTENT_HASH_LIMIT else [st.st_size, st.st_mtime_ns]
    return out


def _yaml_digest(path: Path) -> str:
    """sha256 of a YAML file's parsed content: comments and layout do not count, keys and values do."""
    from omegaconf import OmegaConf

    content = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()


def _config_files(globs) -> dict:
    return {str(f.relative_to(CONF_DIR)): _yaml_digest(f) for g in globs for f in sorted(CONF_DIR.glob(g))}


def fingerprint(stage: Stage, stages: dict[str, Stage]) -> tuple[str, dict]:
    """The digest of everything ``stage`` reads: its command's overrides, the YAML files it composes, the
    model folders' contents and its upstream stages' outputs; and the inputs themselves (stored with it,
    so that a changed one can be found)."""
    inputs = {"script": stage.script, "args": _location_free(stage, stages),
              "configs": _config_files(COMMON_CONFIGS + stage.configs),
              "reads": {str(p): content_digest(p) for p in stage.reads},
              "after": {n: output_digest(stages[n].out) for n in stage.after if n in stages}}
    if stage.resolved:  # e.g. model.dtype=auto resolved on this machine: another CPU kind reruns the stage
        inputs["resolved"] = stage.resolved
    if stage.name == "corpus":  # built from the running Python's standard library
        inputs["python"] = sys.version
    return _digest(inputs), inputs


def _location_free(stage: Stage, stages: dict[str, Stage]) -> list[str]:
    """The stage's overrides without where things are written: ``paths.*`` overrides are left out, and a value
    that is a stage's output folder (or a file in it) is named by that stage (``out_dir=<oracle>``,
    ``tuned_from=<tune>/tuning.json``). What the stage reads there is in the fingerprint by content (``after``),
    so moving ``paths.outputs`` or ``paths.published`` reruns nothing."""
    outs = sorted(((str(s.out), n) for n, s in {**stages, stage.name: stage}.items()), key=lambda x: -len(x[0]))
    out = []
    for a in stage.args:
        key, sep, value = a.partition("=")
        if sep and override_key(a).split(".", 1)[0] == "paths":
            continue
        if sep:
            for folder, name in outs:
                if value == folder or value.startswith(folder + os.sep):
                    value = f"<{name}>" + value[len(folder):]
                    break
            a = f"{key}={value}"
        out.append(a)
    return out


def _digest(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def changed_inputs(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The inputs that differ between two fingerprints' inputs, e.g. ``configs/data/base.yaml`` or
    ``after/oracle/report.md``: what a rerun is for."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new), key=str)
        out = []
        for k in keys:
            if old.get(k) != new.get(k):
                deeper = changed_inputs(old.get(k), new.get(k), f"{prefix}{k}/")
                out += deeper if deeper else [f"{prefix}{k}"]
        return out
    return [] if old == new or prefix == "" else [prefix.rstrip("/")]


def stored_fingerprint(stage: Stage) -> dict | None:
    f = stage.out / FINGERPRINT
    try:
        return json.loads(f.read_text()) if f.is_file() else None
    except json.JSONDecodeError:
        return None


def store_fingerprint(stage: Stage, digest: str, inputs: dict, complete: bool) -> None:
    atomic_write_json(stage.out / FINGERPRINT, {"stage": stage.name, "fingerprint": digest, "complete": complete,
                                                "command": " ".join(stage.command), "inputs": inputs})


# ---- the plan ----------------------------------------------------------------------------------------------


def _list(values) -> str:
    return ",".join(str(v) for v in values)


def _checkpoints(cfg) -> list[str]:
    """The checkpoint folders the policies read, as overrides for every script that builds policies."""
    p = cfg.paths
    return [f"ldlp_path={p.ldlp}", f"acceptance_path={p.acceptance}", f"ldlp_survival_path={p.ldlp_survival}"]


def _threads(cfg) -> list[str]:
    threads = cfg.get("threads")
    return [f"threads={'null' if threads is None else int(threads)}"]


def _model_folders(cfg, model: str, overrides=(), peer: bool = False) -> tuple[str, ...]:
    """The folders (target, drafter, tokenizer) of ``model=<model>`` as the sweeps compose it."""
    m = _compose_model(cfg, model, overrides, peer)
    return tuple(dict.fromkeys(str(m[k]) for k in ("target", "drafter", "tokenizer") if m.get(k)))


def _compose(config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import eagle_backbone.paths  # noqa: F401  (registers ${repo:...})

    if GlobalHydra.instance().is_initialized():
        return compose(config_name=config_name, overrides=list(overrides))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def _compose_model(cfg, model: str, overrides=(), peer: bool = False):
    """``model=<model>`` as the stages compose it: the sweeps' model.* overrides, then the main command's."""
    mine = [o for o in forwarded(overrides, ("model",), peer) if override_key(o) != "model"]
    return _compose("evaluate", [f"model={model}"] + [o for o in cfg.sweep.overrides if o.startswith("model.")]
                    + mine).model


def override_key(override: str) -> str:
    """``model.dtype`` of ``model.dtype=float32``, ``+model.x=1``, ``++model.x=1`` or ``~model.x``."""
    return override.lstrip("+~").split("=", 1)[0]


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
        _script_keys_cache[script] = frozenset(_compose(Path(script).stem, []).keys())
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
                models[chosen, peer] = _compose_model(cfg, chosen, overrides, peer)
            m = models[chosen, peer]
            stage.resolved = {"model.dtype": resolve_dtype(m.get("dtype"), str(m.get("device") or "cpu"))}
    return stages


def _setting(cfg, key: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=None)


def _int_setting(cfg, key: str, low: int, default=None) -> int:
    """``key`` of the main command's config as an integer >= ``low``, or one line naming the key and the value."""
    from eagle_backbone.errors import ConfigError

    from eagle_backbone.runtime import int_setting

    value = _setting(cfg, key)
    if value is None and default is not None:
        return default
    try:
        return int_setting(f"pipeline: {key}", value, low, "conf/pipeline.yaml")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _list_setting(cfg, key: str, check, what: str, empty_ok: bool = False) -> list:
    from eagle_backbone.errors import ConfigError

    values = _setting(cfg, key)
    values = [] if values is None else list(values)
    if not values and not empty_ok:
        raise ConfigError(f"pipeline: {key} is empty; give at least one {what} (conf/pipeline.yaml)")
    for v in values:
        if not check(v):
            raise ConfigError(f"pipeline: {key} holds {v!r}, not {what} (conf/pipeline.yaml)")
    return values


def _known_policy(name) -> bool:
    return isinstance(name, str) and (CONF_DIR / "policy" / f"{name}.yaml").is_file()


def validate(cfg) -> None:
    """Every setting of the main command that a stage would otherwise refuse (or coerce) minutes later, checked once,
    before any stage runs or model loads, and in the dry run's plan too: one ConfigError line naming the key."""
    from eagle_backbone.errors import ConfigError

    _int_setting(cfg, "oracle.parallel", 1, default=1)
    if _setting(cfg, "threads") is not None:
        _int_setting(cfg, "threads", 1)
    _int_setting(cfg, "sweep.rounds", 1)
    gamma = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1  # noqa: E731
    _list_setting(cfg, "sweep.static_gammas", gamma, "an integer γ >= 1", empty_ok=True)
    _list_setting(cfg, "sweep.adaptive", _known_policy, "a policy of conf/policy/", empty_ok=True)
    if _setting(cfg, "peer.enabled"):
        _list_setting(cfg, "peer.static_gammas", gamma, "an integer γ >= 1", empty_ok=True)
        _list_setting(cfg, "peer.policies", _known_policy, "a policy of conf/policy/", empty_ok=True)
    if _setting(cfg, "head_to_head.enabled"):
        _int_setting(cfg, "head_to_head.rounds", 1)
        _int_setting(cfg, "head_to_head.adaptive", 0)
        if _setting(cfg, "head_to_head.choose_by") not in ("tuning", "sweep", None):
            raise ConfigError(f"pipeline: head_to_head.choose_by must be tuning or sweep, got "
                              f"{_setting(cfg, 'head_to_head.choose_by')!r}")
    if _setting(cfg, "bench_batch.enabled"):
        _int_setting(cfg, "bench_batch.rounds", 1)
        _int_setting(cfg, "bench_batch.blocks", 1)
        _list_setting(cfg, "bench_batch.concurrency", gamma, "a concurrency (integer >= 1)")
        _list_setting(cfg, "bench_batch.temperatures",
                      lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
                      "a temperature >= 0")
        for spec in _list_setting(cfg, "bench_batch.contenders", lambda v: isinstance(v, str), "a string"):
            names = [o.split("=", 1)[1] for o in spec.split() if o.startswith("policy=")]
            if len(names) != 1 or not _known_policy(names[0]):
                raise ConfigError(f"pipeline: bench_batch.contenders holds {spec!r}: a contender is one "
                                  "'policy=NAME [policy.key=value ...]' of conf/policy/NAME.yaml")
    if not (_setting(cfg, "sweep.static_gammas") or _setting(cfg, "sweep.adaptive")):
        raise ConfigError("pipeline: sweep.static_gammas and sweep.adaptive are both empty: nothing to sweep")


def plan(cfg, model: str = "embedded", overrides=()) -> list[Stage]:
    """Every stage before the head to head, in order; ``model`` is the conf/model option they run on and
    ``overrides`` the main command's (those a stage's config contains reach it: :func:`apply_overrides`)."""
    validate(cfg)
    p = cfg.paths
    threads = _threads(cfg)
    pair = _model_folders(cfg, model, overrides)
    oracle, ldlp, acceptance = Path(p.oracle), Path(p.ldlp), Path(p.acceptance)
    corpus = Path(p.embedded) / "corpus"
    shards = _int_setting(cfg, "oracle.parallel", 1, default=1)
    label_configs = ("collect_oracle.yaml", "data/*.yaml", "generation/*.yaml", "recipe/collect_oracle/*.yaml")
    ldlp_configs = ("train_ldlp.yaml", "ldlp/*.yaml", "trainer/*.yaml", "logger/*.yaml", "experiment/*.yaml",
                    "recipe/train_ldlp/*.yaml")
    eval_configs = ("evaluate.yaml", "data/*.yaml", "generation/*.yaml", "policy/*.yaml")
    stages = [
        Stage("corpus", "build the embedded conversation corpus", "build_corpus.py",
              [f"out_dir={corpus}"] + threads, corpus, configs=("build_corpus.yaml",), product="test.json"),
        Stage("oracle", "collect oracle draft-length labels (greedy)" + (f", {shards} collectors side by side"
                                                                         if shards > 1 else ""), "collect_oracle.py",
              [f"model={model}", f"out_dir={oracle}"] + threads + ([f"num_shards={shards}"] if shards > 1 else [])
              + list(cfg.oracle.overrides), oracle,
              after=("corpus",), reads=pair, configs=label_configs, product="report.md", resumes=True,
              parallel=shards),
        Stage("ldlp", "train the LDLP on the oracle labels", "train_ldlp.py",
              list(cfg.ldlp.overrides) + [f"model={model}", f"ldlp_training.oracle_dir={oracle}",
                                          f"ldlp_training.out_dir={ldlp}"] + threads,
              ldlp, after=("oracle",), reads=pair, configs=ldlp_configs, product="model.safetensors"),
        Stage("acceptance", "train the acceptance head on the drafter states of the oracle rows", "train_acceptance.py",
              [f"model={model}", f"oracle_dir={oracle}", f"out_dir={acceptance}"] + threads
              + list(cfg.acceptance.overrides), acceptance, after=("oracle",), configs=("train_acceptance.yaml",),
              product="model.safetensors"),
    ]
    if cfg.ldlp.get("survival"):
        stages.append(Stage("ldlp_survival", "train the LDLP with the survival (distribution) head", "train_ldlp.py",
                            list(cfg.ldlp.survival_overrides)
                            + [f"model={model}", f"ldlp_training.oracle_dir={oracle}",
                               f"ldlp_training.out_dir={p.ldlp_survival}", "ldlp_training.evaluation.benchmark=false"]
                            + threads, Path(p.ldlp_survival), after=("oracle",), reads=pair, configs=ldlp_configs,
                            product="model.safetensors"))
    checkpoints = tuple(s.name for s in stages if s.name in ("ldlp", "ldlp_survival", "acceptance"))
    tuned = None
    if cfg.tune.get("enabled"):
        tune_dir = Path(p.results) / "tuning"
        tuned = tune_dir / "tuning.json"
        stages.append(Stage("tune", "tune the adaptive policies by replay on the validation labels (measured cost table)",
                            "tune_policies.py",
                            [f"model={model}", f"oracle_dir={oracle}", f"out_dir={tune_dir}"] + _checkpoints(cfg)
                            + threads + list(cfg.tune.overrides),
                            tune_dir, after=("corpus", "oracle") + checkpoints, reads=pair,
                            configs=("tune_policies.yaml", "data/*.yaml", "policy/*.yaml"), product="tuning.json"))
    common = list(cfg.sweep.overrides) + threads
    runs = Path(p.runs)
    for r in range(1, int(cfg.sweep.rounds) + 1):
        sweeps = [("static", model, ["policy=static", f"policy.gamma={_list(cfg.sweep.static_gammas)}"], ()),
                  ("adaptive", model, [f"policy={_list(cfg.sweep.adaptive)}"] + _checkpoints(cfg)
                   + ([f"tuned_from={tuned}"] if tuned else []), checkpoints + (("tune",) if tuned else ()))]
        if cfg.peer.enabled:
            if cfg.peer.static_gammas:
                sweeps.append(("peer_static", cfg.peer.model,
                               ["policy=static", f"policy.gamma={_list(cfg.peer.static_gammas)}"], ()))
            if cfg.peer.policies:
                sweeps.append(("peer", cfg.peer.model, [f"policy={_list(cfg.peer.policies)}"], ()))
        for name, sweep_model, args, after in sweeps:
            if args[0].endswith("="):  # an empty policy list
                continue
            out = runs / f"round-{r}" / name
            reads = pair if sweep_model == model else _model_folders(cfg, sweep_model, overrides, peer=True)
            policies = args[0].split("=", 1)[1].split(",")
            extra, fills = _policy_reads(cfg, policies, stages, overrides)
            stages.append(Stage(f"sweep:{name}:{r}", f"round {r}/{cfg.sweep.rounds}: {name} ({sweep_model})",
                                "evaluate.py", ["-m", f"model={sweep_model}"] + args + common
                                + [f"hydra.sweep.dir={out}"], out, after=("corpus",) + after, reads=reads + extra,
                                configs=eval_configs, group="sweeps", clear=True, fills=fills))
    bench = bench_batch_stage(cfg, stages, model, pair, overrides)
    if bench is not None:
        stages.append(bench)
    return apply_overrides(cfg, stages, overrides, model)


_policy_cache: dict = {}


def _policy_reads(cfg, policies, stages: list[Stage], overrides) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The folders of ``cfg.paths`` that the policies read and no stage of the plan writes (the load-aware
    policies' cost tables in paths.cost, the per-temperature draft acceptance heads in paths.draft_acceptance),
    as (reads, fills): the fingerprint hashes their content, so a retrained head or a new cost table reruns the
    stages that use them; fills are those a run creates when missing (paths.cost: profiled on first use),
    hashed again after the stage, so that the next run does not redo it for the table it made itself."""
    written = {str(s.out) for s in stages} | {str(Path(cfg.paths.embedded) / "corpus")}
    roots = {str(cfg.paths.get(k)) for k in ("root", "data_dir", "outputs")}
    folders = {str(v) for k, v in cfg.paths.items() if isinstance(v, str)} - roots
    # the policies' paths as the stages resolve them: every leaf of the main command's paths
    paths_overrides = [f"paths.{k}={v}" for k, v in cfg.paths.items() if isinstance(v, str)]
    reads = []
    for name in dict.fromkeys(str(x) for x in policies):
        if not (CONF_DIR / "policy" / f"{name}.yaml").is_file():
            continue
        key = (name, tuple(paths_overrides), str(CONF_DIR))
        if key not in _policy_cache:
            try:
                from omegaconf import OmegaConf

                _policy_cache[key] = OmegaConf.to_container(
                    _compose("evaluate", [f"policy={name}"] + paths_overrides).policy, resolve=True)
            except Exception:  # a policy config that needs more than the defaults: the sweep itself will say so
                _policy_cache[key] = {}
        policy = _policy_cache[key]
        reads += [str(v) for v in policy.values() if isinstance(v, str) and v in folders and v not in written]
    reads = tuple(dict.fromkeys(reads))
    cost = str(cfg.paths.get("cost"))
    return reads, tuple(r for r in reads if r == cost)


def bench_batch_stage(cfg, stages: list[Stage], model: str, pair: tuple[str, ...], overrides=()) -> Stage | None:
    """The load sweep's short version (scripts/bench_batch.py): tokens/s against concurrency and temperature for
    batched AR, static γ and the adaptive policies, with paired ratios to the baselines. A contender whose
    conf/policy/<name>.yaml does not exist is refused by :func:`validate`."""
    b = cfg.get("bench_batch")
    if not b or not b.get("enabled"):
        return None
    contenders = [str(c) for c in b.contenders]
    out = Path(cfg.paths.results) / "load_sweep"
    args = ([f"model={model}", "concurrency=[" + _list(b.concurrency) + "]",
             "temperatures=[" + _list(b.temperatures) + "]",
             "contenders=[" + ",".join(f'"{c}"' for c in contenders) + "]",
             f"rounds={int(b.rounds)}", f"blocks={int(b.blocks)}", f"out_dir={out}", f"hydra.run.dir={out}"]
            + _checkpoints(cfg) + _threads(cfg) + list(b.overrides))
    names = {s.name for s in stages}
    used = {c.split("=", 1)[1].split()[0] for c in contenders}
    after = ("corpus",) + tuple(n for n in ("ldlp", "ldlp_survival", "acceptance")
                                if n in names and (n in used or (n == "ldlp" and "ldlp_ddd" in used)))
    # what the policies read besides the checkpoints, like the weights: the load-aware policy's measured cost
    # table (scripts/profile_cost.py; made by the stage itself when missing), the draft acceptance heads
    extra, fills = _policy_reads(cfg, used, stages, overrides)
    return Stage("bench_batch", f"load sweep (short): C={_list(b.concurrency)} x T={_list(b.temperatures)}, "
                 f"{len(contenders)} contenders and batched AR", "bench_batch.py", args, out, after=after,
                 reads=pair + extra, fills=fills,
                 configs=("bench_batch.yaml", "evaluate.yaml", "data/*.yaml", "generation/*.yaml", "policy/*.yaml"),
                 group="bench", product="batch_bench.json")


def _tuned_best(tuned: Path | None) -> dict:
    """{policy: its best replay-tuned result} from a tuning.json ({} when no tuning ran)."""
    if tuned is None or not tuned.is_file():
        return {}
    from ldlp.bench.replay import best_per_policy

    return best_per_policy(json.loads(tuned.read_text())["results"])


def static_contenders(cfg, best_swept: int, tuned_best: dict) -> list[int]:
    """The static γ the head to head times: the sweep's best, and the replay tuning's best (the sweep's
    when no tuning ran) with both neighbours. A sweep of a few prompts picks its best noisily; the
    tuning's comes from exact counts and a cost model; between them the best static γ is in the race."""
    static = tuned_best.get("static")
    around = int(static["params"]["gamma"]) if static else best_swept
    wanted = {best_swept, around - 1, around, around + 1}
    return sorted(g for g in wanted if g in cfg.sweep.static_gammas)


def adaptive_contenders(cfg, name: str, summary: dict, tuned_best: dict) -> list[str]:
    """The adaptive policies the head to head times: the best of the replay tuning (chosen on the
    validation labels, so the test prompts judge them without a winner's curse) or of the sweep."""
    swept = [p for p in cfg.sweep.adaptive if p != "oracle"]
    if cfg.head_to_head.get("choose_by", "tuning") == "tuning" and tuned_best:
        ranked = sorted((r for p, r in tuned_best.items() if p in swept), key=lambda r: -r["tokens_per_s"])
    else:
        ranked = sorted((r for r in summary["rows"] if r["model"] == name and r["policy"] in swept
                         and r.get("speedup") is not None), key=lambda r: -r["speedup"])
    return list(dict.fromkeys(r["policy"] for r in ranked))[: int(cfg.head_to_head.adaptive)]


def _tuning_file(cfg) -> Path | None:
    return Path(cfg.paths.results) / "tuning" / "tuning.json" if cfg.tune.get("enabled") else None


def head_to_head_stage(cfg, name: str, summary: dict, stages: list[Stage], model: str = "embedded",
                       overrides=()) -> Stage | None:
    """Static γ around the sweep's best and the best adaptive policies, timed in turns (scripts/compare.py);
    ``summary`` is the sweeps' (ldlp.report.summary.summarize), ``name`` the swept model's name."""
    head = summary["headline"].get(name) or {}
    if "best_static" not in head or "best_adaptive" not in head:
        return None
    tuned = _tuning_file(cfg)
    tuned_best = _tuned_best(tuned)
    gammas = static_contenders(cfg, int(head["best_static"]["gamma"]), tuned_best)
    policies = adaptive_contenders(cfg, name, summary, tuned_best)
    contenders = [f"policy=static policy.gamma={x}" for x in gammas] + [f"policy={p}" for p in policies]
    if "oracle" in cfg.sweep.adaptive:
        contenders.append("policy=oracle")  # the upper bound, timed in the same turns: headroom in paired numbers
    out = Path(cfg.paths.runs) / "head_to_head"
    args = ([f"model={model}", "contenders=[" + ",".join(f'"{c}"' for c in contenders) + "]",
             f"rounds={cfg.head_to_head.rounds}", f"out_dir={out}", f"hydra.run.dir={out}"] + _checkpoints(cfg)
            + ([f"tuned_from={tuned}"] if tuned else []) + _threads(cfg)
            + [o for o in cfg.sweep.overrides if not o.startswith("evaluation.repeats")]
            + list(cfg.head_to_head.overrides))
    by_name = {s.name: s for s in stages}
    after = tuple(n for n in ("corpus", "ldlp", "ldlp_survival", "acceptance", "tune") if n in by_name)
    extra, fills = _policy_reads(cfg, policies, stages, overrides)
    stage = Stage("head_to_head", f"head to head: static γ={gammas} vs {', '.join(policies)} (and the oracle), "
                  "timed in turns", "compare.py", args, out, after=after, reads=by_name["oracle"].reads + extra,
                  configs=("compare.yaml", "evaluate.yaml", "data/*.yaml", "generation/*.yaml", "policy/*.yaml"),
                  group="sweeps", product="head_to_head.json", fills=fills)
    return apply_overrides(cfg, [stage], overrides, model)[0]


# ---- running -----------------------------------------------------------------------------------------------


def _force_level(force) -> set[str]:
    if force in (False, None, "false", "none"):
        return set()
    if force in (True, "true", "sweeps"):
        return {"tune", "sweeps", "bench"}  # all time this machine
    if force == "all":
        return {"corpus", "oracle", "ldlp", "ldlp_survival", "acceptance", "tune", "sweeps", "bench"}
    raise ValueError(f"force must be false, true (redo tuning, sweeps and the load sweep) or all (also the labels, "
                     f"LDLP and acceptance head), got {force!r}")


TRAIN_COMMANDS = {"target": "python scripts/train_lm.py lm=embedded_target",
                  "drafter": "python scripts/train_drafter.py",
                  "draft_lm": "python scripts/train_lm.py lm=embedded_draft_lm"}


def check_models(cfg, model: str = "embedded", overrides=()) -> None:
    """Fail early, naming the command that makes them, when a sweep's models are missing."""
    models = [model] + ([cfg.peer.model] if cfg.peer.enabled else [])
    missing = []
    for option in models:
        m = _compose_model(cfg, option, overrides, peer=option != model)
        for key in ("target", "drafter"):
            if not (Path(m[key]) / "config.json").exists():
                name = Path(m[key]).name
                missing.append(f"model={option}: {m[key]}" + (f" ({TRAIN_COMMANDS[name]})" if name in TRAIN_COMMANDS
                                                              else ""))
    if missing:
        raise ValueError("models missing: " + "; ".join(dict.fromkeys(missing)))


def _ar_impl(run_dir: Path | None) -> str | None:
    """The AR implementation the calibration in ``run_dir``'s runs found faster (None if none was timed)."""
    if run_dir is None or not run_dir.exists():
        return None
    for f in sorted(run_dir.rglob("results.json")):
        choice = json.loads(f.read_text()).get("ar_choice") or {}
        if choice.get("reason") == "faster in calibration":
            return choice["impl"]
    return None


class StageRunner:
    """Runs stages in order: a stage whose stored fingerprint equals its inputs' is skipped."""

    def __init__(self, cfg, stages: list[Stage]):
        self.force = _force_level(cfg.force)
        h2h = cfg.get("head_to_head") or {}
        self.h2h_rounds = int(h2h.get("rounds") or 2)  # EXPECTED_S's head to head has 2 rounds
        self.h2h_out = Path(cfg.paths.runs) / "head_to_head" if cfg.paths.get("runs") else None
        self.stages = {s.name: s for s in stages}
        self.t_start = time.perf_counter()
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.times_file = Path(cfg.paths.results) / "stage_seconds.json"  # the last run of each stage
        try:
            self.times = json.loads(self.times_file.read_text()) if self.times_file.is_file() else {}
        except json.JSONDecodeError:
            self.times = {}
        # CPU seconds of each stage's processes: on a shared machine, close to what a one-thread stage takes idle
        self.cpu_times_file = self.times_file.with_name("stage_cpu_seconds.json")
        try:
            self.cpu_times = json.loads(self.cpu_times_file.read_text()) if self.cpu_times_file.is_file() else {}
        except json.JSONDecodeError:
            self.cpu_times = {}
        self.ran: list[str] = []
        self.lock: FolderLock | None = None  # the main command's lock: it records the running stage's pids
        self.grace_s = 30.0  # after forwarding a signal, how long a stage may take to stop before it is killed

    def decide(self, stage: Stage) -> tuple[bool, str, str, dict]:
        """(whether ``stage`` runs, why, its fingerprint, its inputs)."""
        digest, inputs = fingerprint(stage, self.stages)
        stored = stored_fingerprint(stage)
        forced = stage.force_group in self.force
        made = stage.product is None or (stage.out / stage.product).is_file()
        if stored and stored.get("complete") and stored.get("fingerprint") == digest and made and not forced:
            return False, "done for the same inputs", digest, inputs
        why = ("forced" if forced else "first run" if stored is None
               else "continuing" if stored.get("fingerprint") == digest and not stored.get("complete")
               else "its product is missing" if stored.get("fingerprint") == digest
               else "changed: " + ", ".join(changed_inputs(stored.get("inputs") or {}, inputs)[:6]))
        return True, why, digest, inputs

    def expected_s(self, stage: Stage) -> float | None:
        """This machine's last time for ``stage``, else the reference estimate for its kind and dtype."""
        if self.times.get(stage.name) is not None:
            return float(self.times[stage.name])
        table = EXPECTED_S.get(stage.resolved.get("model.dtype"), EXPECTED_S["float32"])
        kind = stage.name.rsplit(":", 1)[0] if stage.name.startswith("sweep:") else stage.name
        one = table.get(kind)  # one collector; N side by side on N idle cores, plus the check and report passes
        if one is None or stage.parallel <= 1:
            return one
        return one / min(stage.parallel, os.cpu_count() or 1) + 2 * table.get("start", 8)

    def __call__(self, stage: Stage, k: int, n: int) -> bool:
        """Run ``stage`` unless it is done for the same inputs; True when it ran."""
        self.stages[stage.name] = stage
        runs, why, digest, inputs = self.decide(stage)
        head = f"[{k}/{n}] {stage.title}"
        if not runs:
            print(f"{head}: done for the same inputs, skipped", flush=True)
            return False
        if stage.resumes:
            if why == "forced" or why.startswith("changed"):
                # other inputs: the output starts over. It is reset before the new fingerprint is stored, so an
                # interruption in between leaves the old fingerprint, and the next run resets it again
                _reset_collection(stage.out)
                stage.extra = stage.extra + ["overwrite=true"]
            else:  # first run or continuing: a collection this stage did not make (other settings) starts over
                stage.extra = stage.extra + ["overwrite=changed"]
        print(f"{head} ({why}) ...\n  $ {_shown(stage)}", flush=True)
        if stage.clear and stage.out.exists():
            shutil.rmtree(stage.out)  # a half-finished sweep is redone whole: its rows must share a process
        store_fingerprint(stage, digest, inputs, complete=False)
        t0 = time.perf_counter()
        cpu0 = _children_cpu_s()
        code = self.run_command(stage)
        cpu = _children_cpu_s() - cpu0
        if code != 0:
            raise StageFailed(f"stage {stage.name!r} failed (exit {code}); its own error line above names the "
                              "setting or input to fix; then rerun (finished stages are skipped)")
        if stage.fills:  # what the stage made for itself (a cost table) is its input from now on
            for f in stage.fills:
                inputs["reads"][str(f)] = content_digest(f)
            digest = _digest(inputs)
        store_fingerprint(stage, digest, inputs, complete=True)
        seconds = time.perf_counter() - t0
        self.times[stage.name] = round(seconds, 1)
        atomic_write_json(self.times_file, self.times)
        self.cpu_times[stage.name] = round(cpu, 1)
        atomic_write_json(self.cpu_times_file, self.cpu_times)
        self.ran.append(stage.name)
        print(f"  {stage.name} finished in {seconds:.0f} s, {cpu:.0f} s of CPU (total "
              f"{time.perf_counter() - self.t_start:.0f} s)", flush=True)
        return True

    def run_command(self, stage: Stage) -> int:
        """Run the stage's command (``stage.parallel`` > 1: its collectors side by side, :meth:`commands`), each
        process in its own process group; SIGTERM, SIGINT or SIGHUP to the main command is forwarded to those
        groups (the stage and anything it started), and the main command then stops with it: no stage keeps
        writing after the main command is gone. A stage still running ``grace_s`` after the signal is killed. A
        SIGKILLed main command runs no handler: the stages' parent-death signal and the watchdog stop them then."""
        code = 0
        for group in self.commands(stage):
            code = self._run_group(stage, group)
            if code != 0:
                break
        return code

    @staticmethod
    def commands(stage: Stage) -> list[list[list[str]]]:
        """The command groups of ``stage``, run one group after the other, the commands of a group side by side.
        ``parallel`` = N > 1 (its args hold ``num_shards=N``): shard 0 alone with ``max_parts_this_run=0`` (it
        checks or resets the folder: the ``overwrite`` of ``extra``), then the N shards side by side, then shard 0
        again with ``max_parts_this_run=0`` (it writes the report and manifest over every part)."""
        if stage.parallel <= 1:
            return [[stage.command]]
        base = [c for c in stage.command if not c.startswith("overwrite=")]
        check = [c for c in stage.command] + ["shard_id=0", "max_parts_this_run=0"]
        # every process its own log folder (Hydra's default names one by the second: side by side, one log was lost)
        logs = Path(stage.out) / "logs" / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{os.getpid()}"
        return [[check + [f"hydra.run.dir={logs}-check"]],
                [base + [f"shard_id={i}", f"hydra.run.dir={logs}-shard{i}"] for i in range(stage.parallel)],
                [base + ["shard_id=0", "max_parts_this_run=0", f"hydra.run.dir={logs}-report"]]]

    def _run_group(self, stage: Stage, commands: list[list[str]]) -> int:
        procs = [subprocess.Popen(c, cwd=REPO_ROOT, env=self.env, start_new_session=True,
                                  preexec_fn=_die_with_parent(os.getpid())) for c in commands]
        # the stages' process groups die with the main command even when it is SIGKILLed (no handler runs then)
        watchdog = _watchdog([p.pid for p in procs])
        if self.lock is not None:
            self.lock.record_stages([p.pid for p in procs])
        got: list[int] = []

        def signal_all(signum):
            for p in procs:
                try:
                    os.killpg(p.pid, signum)
                except ProcessLookupError:
                    pass

        def forward(signum, _frame):
            got.append(signum)
            signal_all(signum)

        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        try:
            previous = {s: signal.signal(s, forward) for s in handled}
        except ValueError:  # not the main thread: signals cannot be handled here
            previous = {}
        codes: list[int] = []
        try:
            deadline, stopping = None, False
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                if any(c not in (None, 0) for c in codes) and not got and not stopping:
                    stopping = True  # one collector failed: stop the others; the rerun continues where they were
                    signal_all(signal.SIGTERM)
                    deadline = time.monotonic() + self.grace_s
                if got and deadline is None:
                    deadline = time.monotonic() + self.grace_s
                if deadline is not None and time.monotonic() > deadline:
                    signal_all(signal.SIGKILL)
                time.sleep(0.2)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            _stop_watchdog(watchdog)
            if self.lock is not None:
                self.lock.record_stages([])
        code = next((c for c in codes if c != 0), 0)
        if got:
            name = signal.Signals(got[0]).name
            print(f"{name}: stopped stage {stage.name!r} (exit {code}); rerun the same command to continue",
                  file=sys.stderr, flush=True)
            raise SystemExit(128 + got[0])
        return code

    def preview(self, stages: list[Stage], head_to_head: bool) -> tuple[list[str], float]:
        """One line per stage: would it run and why, its expected time, its command; and the expected seconds of
        those that run. A stage downstream of one that runs is shown as running when its upstream's output
        changes (a deterministic rebuild leaves it as is)."""
        lines, total, runs = [], 0.0, set()
        n = len(stages) + (1 if head_to_head else 0)
        for k, stage in enumerate(stages, 1):
            self.stages[stage.name] = stage
            run, why, _, _ = self.decide(stage)
            ups = [u for u in stage.after if u in runs]
            if not run and ups:
                run, why = True, f"if {', '.join(ups)} writes other output"
            expected = self.expected_s(stage)
            if run:
                runs.add(stage.name)
                total += expected or 0.0
            t = f"~{expected:.0f} s" if expected is not None else "? s"
            lines.append(f"[{k}/{n}] {stage.name}: {'run' if run else 'skip'} ({why}), {t if run else 'skipped'}"
                         f"\n    $ {_shown(stage)}")
        if head_to_head:
            h = Stage("head_to_head", "", "compare.py", [], Path("."),
                      resolved=next((s.resolved for s in stages if s.resolved), {}))
            expected = self.expected_s(h)
            if expected is not None and "head_to_head" not in self.times:
                expected *= self.h2h_rounds / 2
            stored = stored_fingerprint(Stage("head_to_head", "", "", [], self.h2h_out)) if self.h2h_out else None
            if not runs and stored and stored.get("complete"):  # nothing upstream runs: its contenders stay
                lines.append(f"[{n}/{n}] head_to_head: skip (nothing before it runs: its contenders and inputs are "
                             "those of its last run), skipped")
            else:
                total += expected or 0.0
                lines.append(f"[{n}/{n}] head_to_head: run if its contenders (chosen from the sweeps' summary) or its "
                             f"inputs changed, ~{expected or 0:.0f} s")
        return lines, total


def _shown(stage: Stage) -> str:
    """The stage's command as a shell line (its shards in one line)."""
    return shlex.join(stage.command) + (f" shard_id=0..{stage.parallel - 1}   ({stage.parallel} collectors side by side)"
                                        if stage.parallel > 1 else "")


def _children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _reset_collection(out: Path) -> None:
    """Remove a label collection (parts, manifest, report) and the fingerprint next to it."""
    from ldlp.labels.collect import remove_collection

    if out.is_dir():
        remove_collection(out)
    (out / FINGERPRINT).unlink(missing_ok=True)


class StageFailed(ValueError):
    """A stage ended with an error: the main command stops with one line (the stage's own error is above it)."""


_libc = None


def _die_with_parent(parent: int):
    """A ``preexec_fn``: the stage gets SIGKILL when the main command dies (Linux ``PR_SET_PDEATHSIG``), and exits
    at once if the main command is already gone; elsewhere a no-op (the watchdog still stops its group)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    libc = _libc

    def preexec():
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return preexec


_WATCHDOG = """
import os, signal, sys, time
parent, groups = int(sys.argv[1]), [int(g) for g in sys.argv[2:]]
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # the main command stops it when the stage has ended
while os.getppid() == parent:
    time.sleep(0.1)
def alive():
    out = []
    for g in groups:
        try:
            os.killpg(g, 0)
            out.append(g)
        except OSError:
            pass
    return out
for sig in (signal.SIGTERM, signal.SIGKILL):
    for g in alive():
        try:
            os.killpg(g, sig)
        except OSError:
            pass
    for _ in range(50):
        if not alive():
            break
        time.sleep(0.1)
"""


def _watchdog(groups: list[int]) -> subprocess.Popen | None:
    """A small process that outlives a killed main command just long enough to stop the stage's process groups
    (``groups``: the stages and whatever they started): when its parent, the main command, is gone, it sends them
    SIGTERM, then SIGKILL. In its own session, so a Ctrl-C at the terminal leaves it to the main command."""
    try:
        return subprocess.Popen([sys.executable, "-I", "-c", _WATCHDOG, str(os.getpid())] + [str(g) for g in groups],
                                start_new_session=True, stdin=subprocess.DEVNULL)
    except OSError:
        return None


def _stop_watchdog(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    with contextlib.suppress(OSError):
        proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux /proc, clock ticks since boot): with the pid, it tells the process
    that wrote a lock from a later one that got the same pid. None where unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _running(pid, start=None) -> bool:
    from eagle_backbone.io import pid_alive

    if not isinstance(pid, int) or not pid_alive(pid):
        return False
    now = _start_time(pid)
    return start is None or now is None or now == start


class FolderLock:
    """An exclusive lock per folder (``LOCK`` inside it): flock, plus a record of the holder (pid, its start time,
    command) and of the stage processes it runs. A record whose holder and stages are gone is stale: it is taken
    over with one line saying so; a live holder (or a stage a killed holder left running) refuses."""

    def __init__(self, folders):
        self.folders = [Path(f) for f in dict.fromkeys(str(f) for f in folders)]
        self.files: list = []
        self.record = {"pid": os.getpid(), "start": _start_time(os.getpid()),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "stages": []}

    @staticmethod
    def _read(f) -> dict | None:
        f.seek(0)
        text = f.read().strip()
        try:
            held = json.loads(text) if text else None
        except json.JSONDecodeError:
            return None
        return held if isinstance(held, dict) and not held.get("released") else None

    @staticmethod
    def _holder(held: dict | None) -> str:
        if not held:
            return "another process"
        return f"pid {held.get('pid')}, started {held.get('started')}: {held.get('command')}"

    def __enter__(self):
        for folder in self.folders:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / LOCK
            f = open(path, "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = self._holder(self._read(f))
                f.close()
                self.__exit__()
                raise ValueError(f"{folder} is in use by another main command ({holder}); wait for it to finish, "
                                 "or give this one other folders (paths.data_dir=..., paths.outputs=...)") from None
            held = self._read(f)
            if held and held.get("pid") != os.getpid():
                live = [s for s in held.get("stages") or [] if _running(s.get("pid"), s.get("start"))]
                if _running(held.get("pid"), held.get("start")) or live:
                    f.close()
                    self.__exit__()
                    what = (f"its stage process {', '.join(str(s['pid']) for s in live)} is still running"
                            if live else "its holder is still running")
                    raise ValueError(f"the lock at {path} is held by pid {held.get('pid')} and {what} ("
                                     f"{self._holder(held)}); wait for it or stop it (kill <pid>), then rerun")
                print(f"the lock at {path} was held by dead pid {held.get('pid')} and is taken over", file=sys.stderr,
                      flush=True)
            self.files.append(f)
            self._write(f)
        return self

    def _write(self, f, record: dict | None = None) -> None:
        f.seek(0)
        f.truncate()
        f.write(json.dumps(record or self.record) + "\n")
        f.flush()

    def record_stages(self, pids: list[int]) -> None:
        """Name the running stage's processes in every lock file (none: ``[]``), so a main command that finds
        this lock after a kill sees whether anything of this one still runs."""
        self.record["stages"] = [{"pid": p, "start": _start_time(p)} for p in pids]
        for f in self.files:
            self._write(f)

    def __exit__(self, *exc):
        for f in self.files:
            try:
                self._write(f, {"released": True, "pid": os.getpid(), "at": time.strftime("%Y-%m-%d %H:%M:%S")})
                fcntl.flock(f, fcntl.LOCK_UN)
            finally:
                f.close()
        self.files = []


def lock_folders(cfg, stages: list[Stage]) -> list[Path]:
    """The folders a main command locks: paths.data_dir and paths.outputs, and the parent of any stage output
    outside both."""
    roots = [Path(cfg.paths.data_dir).resolve(), Path(cfg.paths.outputs).resolve()]
    out = list(roots)
    for s in stages:
        o = Path(s.out).resolve()
        if not any(r == o or r in o.parents for r in roots):
            out.append(o.parent)
    return list(dict.fromkeys(out))


def run(cfg, model: str = "embedded", overrides=()) -> dict | None:
    """Run the stages that are not done for their inputs yet, summarize into ``paths.results``, and publish
    when ``cfg.publish``; returns the summary (see ldlp.report.summary.summarize). ``overrides``: the main
    command's, passed to every stage whose config has their keys. ``cfg.dry_run``: print the plan, run nothing
    (returns None)."""
    check_models(cfg, model, overrides)
    stages = plan(cfg, model, overrides)
    dry = bool(cfg.get("dry_run"))
    with (contextlib.nullcontext() if dry else FolderLock(lock_folders(cfg, stages))) as lock:  # a dry run only reads
        runner = StageRunner(cfg, stages)
        runner.lock = lock
        h2h = cfg.get("head_to_head")
        lines, total = runner.preview(stages, bool(h2h and h2h.get("enabled")))
        source = "this machine's last run" if runner.times else "reference estimates"
        print(f"plan ({len(lines)} stages, expected {total / 60:.1f} min for those that run; times from {source}, "
              f"model.dtype={next((s.resolved['model.dtype'] for s in stages if s.resolved), '?')}):", flush=True)
        for line in lines:
            print("  " + line, flush=True)
        if dry:
            return None
        runner.stages = {s.name: s for s in stages}
        return _run(cfg, model, overrides, stages, runner)


def _run(cfg, model, overrides, stages, runner) -> dict:
    from ldlp.report.summary import summarize

    ar_impl = None  # decided (timed) by the first sweep, then fixed: later processes skip the calibration
    fixed_ar = any(o.startswith("evaluation.ar_baseline=") for o in cfg.sweep.overrides)
    h2h = cfg.get("head_to_head")
    n = len(stages) + (1 if h2h and h2h.get("enabled") else 0)
    for k, stage in enumerate(stages, 1):
        if stage.group == "sweeps" and ar_impl and not fixed_ar:
            stage.extra = [f"evaluation.ar_baseline={ar_impl}"]
        runner(stage, k, n)
        if stage.group == "sweeps":
            ar_impl = ar_impl or _ar_impl(stage.out)
    sweep_dirs = [s.out for s in stages if s.group == "sweeps"]
    out_dir = Path(cfg.paths.results)
    write_run_settings(out_dir, stages, overrides)
    summary = summarize(sweep_dirs, out_dir)
    name = str(_compose_model(cfg, model, overrides).name)
    if h2h and h2h.get("enabled"):
        stage = head_to_head_stage(cfg, name, summary, stages, model, overrides)
        if stage is not None:
            runner(stage, n, n)
            stages.append(stage)
            result = json.loads((stage.out / "head_to_head.json").read_text())
            summary = summarize(sweep_dirs, out_dir, head_to_head=result)
    summary["stage_seconds"] = {s.name: runner.times.get(s.name) for s in stages}
    summary["elapsed_s"] = time.perf_counter() - runner.t_start
    # what publishing takes: this run's stages (a disabled one's older files in paths.results are not this run's)
    write_run_manifest(out_dir, name, [s.name for s in stages], summary["stage_seconds"])
    if cfg.get("publish"):
        for line in publish_run(out_dir, Path(cfg.paths.published), REPO_ROOT / "README.md", summary, name,
                                command="python scripts/pipeline.py publish=true"):
            print(line, flush=True)
    return summary


def write_run_settings(out_dir: Path, stages: list[Stage], overrides) -> dict:
    """``paths.results/run_settings.json``: what the figures were measured with (the dtype model.dtype resolved to,
    the main command's overrides, the CPU and whether it has bf16 matmuls); the results page states it."""
    from eagle_backbone.runtime import bf16_matmuls
    from ldlp.bench.loaders import machine_info

    machine = machine_info()
    settings = {"model.dtype": next((s.resolved["model.dtype"] for s in stages if s.resolved), None),
                "overrides": list(overrides or ()), "cpu": machine.get("cpu"), "cpu_bf16": bf16_matmuls("cpu"),
                "gpu": machine.get("gpu"), "torch": machine.get("torch")}
    atomic_write_json(out_dir / "run_settings.json", settings)
    return settings
