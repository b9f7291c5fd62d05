"""A stage of the main command, and its fingerprint: the digest of everything it reads, stored next to its output.

A :class:`Stage` is one command (``python scripts/<script> <overrides>``) writing one folder. Its fingerprint is a
sha256 over its script and overrides (without where things are written), the parsed YAML files it composes, the
content of the model folders it reads, its upstream stages' outputs and the settings its script resolves on this
machine; ``stage.json`` in its output folder holds it with the inputs themselves, so a changed one can be named.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from eagle_backbone.io import atomic_write_json, file_sha256, tmp_owner
from eagle_backbone.paths import CONF_DIR, REPO_ROOT

FINGERPRINT = "stage.json"  # next to every stage's output: the fingerprint of its inputs, and whether it finished
RUN_LOCK = ".run.lock"  # in a benchmark's out_dir: one run at a time writes it (ldlp/pipeline/processes.py)
SKIP_IN_OUTPUTS = {FINGERPRINT, RUN_LOCK, "logs", ".hydra"}  # not part of a stage's output for its downstream stages
COMMON_CONFIGS = ("paths/*.yaml", "model/*.yaml", "hydra/help/*.yaml")
CONTENT_HASH_LIMIT = 64 << 20  # upstream output files up to this size are hashed by content, larger ones by size and mtime


@dataclass
class Stage:
    """One step of the main command: ``python scripts/<script> <args>``, writing into ``out``."""

    name: str  # unique: corpus, oracle, ldlp, ldlp_survival, acceptance, cost, tune, sweep:<kind>:<round>,
    #            bench_batch, contenders, head_to_head
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
    resumes: bool = False  # continues a partial output (the oracle's parts): reset first when its inputs changed
    parallel: int = 1  # collectors side by side (shard_id=0..N-1 of num_shards=N, in args): see StageRunner.commands
    scale: float = 1.0  # of its reference time estimate (the head to head: its rounds over the estimate's two)

    @property
    def command(self) -> list[str]:
        return [sys.executable, str(REPO_ROOT / "scripts" / self.script)] + self.args + self.extra

    @property
    def force_group(self) -> str:
        return self.group or self.name


def override_key(override: str) -> str:
    """``model.dtype`` of ``model.dtype=float32``, ``+model.x=1``, ``++model.x=1`` or ``~model.x``."""
    return override.lstrip("+~").split("=", 1)[0]


# ---- fingerprints ------------------------------------------------------------------------------------------

def content_digest(folder: str | Path) -> dict:
    """{file: sha256} of a model folder's files (weights, configs, tokenizer), hashed once per size and mtime."""
    folder = Path(folder)
    if folder.is_file():
        return {folder.name: file_sha256(folder)}
    if not folder.is_dir():
        return {}
    return {str(f.relative_to(folder)): file_sha256(f) for f in sorted(folder.rglob("*"))
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
            out[str(rel)] = file_sha256(f) if st.st_size <= CONTENT_HASH_LIMIT else [st.st_size, st.st_mtime_ns]
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
    that is a stage's output folder (or a file in it), or a list of them, is named by that stage (``out_dir=<oracle>``,
    ``tuned_from=<tune>/tuning.json``). What the stage reads there is in the fingerprint by content (``after``),
    so moving ``paths.outputs`` or ``paths.published`` reruns nothing."""
    outs = sorted(((str(s.out), n) for n, s in {**stages, stage.name: stage}.items()), key=lambda x: -len(x[0]))

    def named(value: str) -> str:
        for folder, name in outs:
            if value == folder or value.startswith(folder + os.sep):
                return f"<{name}>" + value[len(folder):]
        return value

    out = []
    for a in stage.args:
        key, sep, value = a.partition("=")
        if sep and override_key(a).split(".", 1)[0] == "paths":
            continue
        if sep:  # a list of folders (the contenders' sweep.dirs=[...]) item by item
            listed = value.startswith("[") and value.endswith("]")
            value = f"[{','.join(named(v) for v in value[1:-1].split(','))}]" if listed else named(value)
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

