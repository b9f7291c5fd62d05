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

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle_backbone.io import atomic_write_json, atomic_write_text
from eagle_backbone.paths import CONF_DIR, REPO_ROOT

FINGERPRINT = "stage.json"  # next to every stage's output: the fingerprint of its inputs, and whether it finished
SKIP_IN_OUTPUTS = {FINGERPRINT, "logs", ".hydra"}  # not part of a stage's output for its downstream stages
COMMON_CONFIGS = ("paths/*.yaml", "model/*.yaml", "hydra/help/*.yaml")
CONTENT_HASH_LIMIT = 64 << 20  # upstream output files up to this size are hashed by content, larger ones by size and mtime


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
        if f.is_file() and not SKIP_IN_OUTPUTS & set(rel.parts) and not f.name.endswith(".tmp"):
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
    inputs = {"script": stage.script, "args": stage.args,
              "configs": _config_files(COMMON_CONFIGS + stage.configs),
              "reads": {str(p): content_digest(p) for p in stage.reads},
              "after": {n: output_digest(stages[n].out) for n in stage.after if n in stages}}
    if stage.name == "corpus":  # built from the running Python's standard library
        inputs["python"] = sys.version
    blob = json.dumps(inputs, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest(), inputs


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


def _model_folders(cfg, model: str) -> tuple[str, ...]:
    """The folders (target, drafter, tokenizer) of ``model=<model>`` as the sweeps compose it."""
    m = _compose_model(cfg, model)
    return tuple(dict.fromkeys(str(m[k]) for k in ("target", "drafter", "tokenizer") if m.get(k)))


def _compose_model(cfg, model: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = [f"model={model}"] + [o for o in cfg.sweep.overrides if o.startswith("model.")]
    if GlobalHydra.instance().is_initialized():
        return compose(config_name="evaluate", overrides=overrides).model
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="evaluate", overrides=overrides).model


def plan(cfg, model: str = "embedded") -> list[Stage]:
    """Every stage before the head to head, in order; ``model`` is the conf/model option they run on."""
    p = cfg.paths
    threads = _threads(cfg)
    pair = _model_folders(cfg, model)
    oracle, ldlp, acceptance = Path(p.oracle), Path(p.ldlp), Path(p.acceptance)
    corpus = Path(p.embedded) / "corpus"
    label_configs = ("collect_oracle.yaml", "data/*.yaml", "generation/*.yaml", "recipe/collect_oracle/*.yaml")
    ldlp_configs = ("train_ldlp.yaml", "ldlp/*.yaml", "trainer/*.yaml", "logger/*.yaml", "experiment/*.yaml",
                    "recipe/train_ldlp/*.yaml")
    eval_configs = ("evaluate.yaml", "data/*.yaml", "generation/*.yaml", "policy/*.yaml")
    stages = [
        Stage("corpus", "build the embedded conversation corpus", "build_corpus.py",
              [f"out_dir={corpus}"] + threads, corpus, configs=("build_corpus.yaml",), product="test.json"),
        Stage("oracle", "collect oracle draft-length labels (greedy)", "collect_oracle.py",
              [f"model={model}", f"out_dir={oracle}"] + threads + list(cfg.oracle.overrides), oracle,
              after=("corpus",), reads=pair, configs=label_configs, product="report.md"),
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
        stages.append(Stage("tune", "tune the adaptive policies by replay on the validation labels (timed cost model)",
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
            reads = pair if sweep_model == model else _model_folders(cfg, sweep_model)
            stages.append(Stage(f"sweep:{name}:{r}", f"round {r}/{cfg.sweep.rounds}: {name} ({sweep_model})",
                                "evaluate.py", ["-m", f"model={sweep_model}"] + args + common
                                + [f"hydra.sweep.dir={out}"], out, after=("corpus",) + after, reads=reads,
                                configs=eval_configs, group="sweeps", clear=True))
    bench = bench_batch_stage(cfg, stages, model, pair)
    if bench is not None:
        stages.append(bench)
    return stages


def bench_batch_stage(cfg, stages: list[Stage], model: str, pair: tuple[str, ...]) -> Stage | None:
    """The load sweep's short version (scripts/bench_batch.py): tokens/s against concurrency and temperature for
    batched AR, static γ and the adaptive policies, with paired ratios to the baselines. A contender whose
    conf/policy/<name>.yaml does not exist (yet) is left out, so the stage runs before every policy is written."""
    b = cfg.get("bench_batch")
    if not b or not b.get("enabled"):
        return None
    contenders = [str(c) for c in b.contenders if _policy_exists(str(c))]
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
    # the load-aware policy's measured cost table (scripts/profile_cost.py) is an input like the weights
    cost = cfg.paths.get("cost") if any(u.startswith("load_aware") for u in used) else None
    return Stage("bench_batch", f"load sweep (short): C={_list(b.concurrency)} x T={_list(b.temperatures)}, "
                 f"{len(contenders)} contenders and batched AR", "bench_batch.py", args, out, after=after,
                 reads=pair + ((str(cost),) if cost else ()),
                 configs=("bench_batch.yaml", "evaluate.yaml", "data/*.yaml", "generation/*.yaml", "policy/*.yaml"),
                 group="bench", product="batch_bench.json")


def _policy_exists(spec: str) -> bool:
    """Whether the ``policy=NAME`` of a contender string has its conf/policy/NAME.yaml."""
    names = [o.split("=", 1)[1] for o in spec.split() if o.startswith("policy=")]
    return len(names) == 1 and (CONF_DIR / "policy" / f"{names[0]}.yaml").is_file()


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


def head_to_head_stage(cfg, name: str, summary: dict, stages: list[Stage], model: str = "embedded") -> Stage | None:
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
    return Stage("head_to_head", f"head to head: static γ={gammas} vs {', '.join(policies)} (and the oracle), "
                 "timed in turns", "compare.py", args, out, after=after, reads=by_name["oracle"].reads,
                 configs=("compare.yaml", "evaluate.yaml", "data/*.yaml", "generation/*.yaml", "policy/*.yaml"),
                 group="sweeps", product="head_to_head.json")


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


def check_models(cfg, model: str = "embedded") -> None:
    """Fail early, naming the command that makes them, when a sweep's models are missing."""
    models = [model] + ([cfg.peer.model] if cfg.peer.enabled else [])
    missing = []
    for option in models:
        m = _compose_model(cfg, option)
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
        self.stages = {s.name: s for s in stages}
        self.t_start = time.perf_counter()
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.times_file = Path(cfg.paths.results) / "stage_seconds.json"  # the last run of each stage
        self.times = json.loads(self.times_file.read_text()) if self.times_file.is_file() else {}
        self.ran: list[str] = []

    def __call__(self, stage: Stage, k: int, n: int) -> bool:
        """Run ``stage`` unless it is done for the same inputs; True when it ran."""
        self.stages[stage.name] = stage
        digest, inputs = fingerprint(stage, self.stages)
        stored = stored_fingerprint(stage)
        head = f"[{k}/{n}] {stage.title}"
        forced = stage.force_group in self.force
        made = stage.product is None or (stage.out / stage.product).is_file()
        if stored and stored.get("complete") and stored.get("fingerprint") == digest and made and not forced:
            print(f"{head}: done for the same inputs, skipped", flush=True)
            return False
        why = ("forced" if forced else "first run" if stored is None
               else "continuing" if stored.get("fingerprint") == digest and not stored.get("complete")
               else "its product is missing" if stored.get("fingerprint") == digest
               else "changed: " + ", ".join(changed_inputs(stored.get("inputs") or {}, inputs)[:6]))
        if stage.name == "oracle" and (forced or (stored is not None and stored.get("fingerprint") != digest)):
            stage.extra = stage.extra + ["overwrite=true"]  # other inputs: the collection starts over
        print(f"{head} ({why}) ...\n  $ {' '.join(stage.command)}", flush=True)
        if stage.clear and stage.out.exists():
            shutil.rmtree(stage.out)  # a half-finished sweep is redone whole: its rows must share a process
        store_fingerprint(stage, digest, inputs, complete=False)
        t0 = time.perf_counter()
        proc = subprocess.run(stage.command, cwd=REPO_ROOT, env=self.env, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"stage {stage.name!r} failed (exit {proc.returncode}); fix it and rerun the same "
                               f"command: finished stages are skipped")
        store_fingerprint(stage, digest, inputs, complete=True)
        seconds = time.perf_counter() - t0
        self.times[stage.name] = round(seconds, 1)
        atomic_write_json(self.times_file, self.times)
        self.ran.append(stage.name)
        print(f"  {stage.name} finished in {seconds:.0f} s (total {time.perf_counter() - self.t_start:.0f} s)",
              flush=True)
        return True


def run(cfg, model: str = "embedded") -> dict:
    """Run the stages that are not done for their inputs yet, summarize into ``paths.results``, and publish
    when ``cfg.publish``; returns the summary (see ldlp.report.summary.summarize)."""
    from ldlp.report.summary import summarize

    check_models(cfg, model)
    stages = plan(cfg, model)
    runner = StageRunner(cfg, stages)
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
    summary = summarize(sweep_dirs, out_dir)
    name = str(_compose_model(cfg, model).name)
    if h2h and h2h.get("enabled"):
        stage = head_to_head_stage(cfg, name, summary, stages, model)
        if stage is not None:
            runner(stage, n, n)
            stages.append(stage)
            result = json.loads((stage.out / "head_to_head.json").read_text())
            summary = summarize(sweep_dirs, out_dir, head_to_head=result)
    summary["stage_seconds"] = {s.name: runner.times.get(s.name) for s in stages}
    summary["elapsed_s"] = time.perf_counter() - runner.t_start
    if cfg.get("publish"):
        for line in publish(out_dir, Path(cfg.paths.published), REPO_ROOT / "README.md", summary, name,
                            command="python scripts/pipeline.py publish=true"):
            print(line, flush=True)
    return summary


# ---- publishing --------------------------------------------------------------------------------------------

# what publish=true copies from paths.results (outputs/, gitignored) to paths.published (results/, committed)
PUBLISHED_FILES = ("results.md", "results.csv", "tokens_per_s.png", "summary.json", "stage_seconds.json",
                   "tuning/tuning.md", "tuning/tuning.json", "load_sweep/batch_bench.md", "load_sweep/batch_bench.json",
                   "load_sweep/batch_bench.png", "load_sweep/batch_bench_ratio.png")


def _minutes(stage_seconds: dict) -> str:
    done = [s for s in stage_seconds.values() if s is not None]
    if not done or len(done) < len(stage_seconds):
        return ""
    return f"{sum(done) / 60:.1f} min"


def results_page(results_md: str, name: str, command: str, stage_seconds: dict, published: Path) -> str:
    """The committed results page (results/<model>/README.md): the main command's tables and plot, the time
    its stages took, and links to the other generated pages next to it."""
    total = _minutes(stage_seconds)
    links = [("results.md", "sweeps and head to head"), ("results.csv", "CSV"),
             ("tuning/tuning.md", "replay tuning on the validation labels"),
             ("head_to_head_long/pooled.md", "pooled long head-to-head runs (scripts/pool_head_to_head.py)"),
             ("bench_target.md", "target forward costs (scripts/bench_target.py)"),
             ("batch_bench/README.md", "batched engine against concurrency (scripts/bench_batch.py)"),
             ("batch1_parity/parity.md", "batch 1: the engine against the retired loop (scripts/bench_retired_loop.py)"),
             ("load_sweep/batch_bench.md", "the main command's load sweep: policies against concurrency and temperature")]
    times = ", ".join(f"{k} {v:.0f} s" for k, v in stage_seconds.items() if v is not None)
    pooled = (published / "head_to_head_long" / "pooled.md").is_file()
    lines = [f"# Results: {name}", "",
             f"Generated by `{command}` from the main command's last run (do not edit: the next publish rewrites "
             "it)." + (f" Its stages took {total} in all when they last ran ({times})." if total else ""), "",
             "Next to this page: " + " · ".join(f"[{label}]({f})" for f, label in links if (published / f).is_file()),
             "", "How to read the figures below: the sweep ranks policies by speedup over each run's own AR baseline, "
             "with runs minutes apart on a shared machine, so its \"best adaptive in the sweep\" is a screening "
             "number; the head to head times its contenders in turns on the same prompts, but its 60 prompts give "
             "an interval too wide to resolve a gain of 2%."
             + (" The pooled long head-to-head runs ([head_to_head_long/pooled.md](head_to_head_long/pooled.md)) "
                "are the measurement to quote." if pooled else ""),
             "", results_md.strip(), "", "![tokens/s against γ](tokens_per_s.png)", ""]
    # the batched benchmark's plot, from the run its README names as the one to read (written by bench_batch.py)
    batch_plot = next((f"{d}/batch_bench.png" for d in ("batch_bench_r2", "batch_bench")
                       if (published / d / "batch_bench.png").is_file()), None)
    if batch_plot:
        lines += ["## Batched decoding against concurrency", "",
                  "From `scripts/bench_batch.py` (commands and findings: [batch_bench/README.md](batch_bench/README.md)).",
                  "", f"![tokens/s against concurrency]({batch_plot})", ""]
    if (published / "load_sweep" / "batch_bench.png").is_file():
        took = stage_seconds.get("bench_batch")
        lines += ["## The load sweep (short version)", "",
                  "The main command's `bench_batch` stage" + (f" ({took:.0f} s when it last ran)" if took else "")
                  + ": batched AR, static γ and the adaptive policies against concurrency, a panel per temperature; "
                  "the table, the baselines per (C, T) and the paired ratios with their 95% intervals: "
                  "[load_sweep/batch_bench.md](load_sweep/batch_bench.md). A screening run (few prompts, one round); "
                  "docs/batched.md gives the full sweep's command.", "",
                  "![tokens/s against concurrency, per temperature](load_sweep/batch_bench.png)", ""]
        if (published / "load_sweep" / "batch_bench_ratio.png").is_file():
            lines += ["![adaptive / best static γ](load_sweep/batch_bench_ratio.png)", ""]
    return "\n".join(lines)


def headline_block(summary: dict, name: str, command: str, page: str) -> str:
    """README's generated block: the main command's head to head as a short table, and a link to the page."""
    head = summary["headline"].get(name) or {}
    total = _minutes(summary.get("stage_seconds") or {})
    lines = [f"Generated by `{command}`" + (f" (its stages took {total} in all when they last ran)" if total else "")
             + f"; all tables and the plot: [{page}]({page}).", ""]
    h2h = head.get("head_to_head")
    if h2h:
        ref = h2h["reference"]
        # n_dropped next to n_prompts, in bold above 5%
        from ldlp.bench.headtohead import dropped_note

        lines += [(f"Head to head of the main command ({h2h['n_prompts']} prompts{dropped_note(h2h)} × {h2h['rounds']} "
                   "rounds, timed in "
                   f"turns, greedy; ratios of seconds on the same prompts, > 1: faster than {ref}):"), "",
                  f"| contender | τ | tokens/s | vs {ref} | 95% interval |", "|---|---:|---:|---:|---:|"]
        for r in h2h["rows"]:
            if r["contender"] == "AR":
                continue
            vs = f"{r['vs_best_static']:.3f}" if "vs_best_static" in r else ("1" if r["contender"] == ref else "–")
            ci = f"{r['ci95'][0]:.3f} – {r['ci95'][1]:.3f}" if "ci95" in r else "–"
            lines.append(f"| {r['contender']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {vs} | {ci} |")
    else:
        for key, label in (("best_static", "best static"), ("best_adaptive", "best adaptive")):
            if key in head:
                r = head[key]
                lines.append(f"- {label} in the sweep: {r.get('policy', 'static')} at {r['tokens_per_s']:.1f} tokens/s")
    return "\n".join(lines) + "\n"


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    from eagle_backbone.io import atomic_replace

    atomic_replace(tmp, dst)


def publish(results: Path, published: Path, readme: Path, summary: dict | None, name: str, command: str) -> list[str]:
    """Copy the run's tables, plot and tuning from ``results`` (outputs/, gitignored) to ``published``
    (results/<model>, committed), write its README.md, and README's ``results`` block when README has one;
    returns what it did. ``summary`` (the pipeline's) defaults to the run's summary.json and stage_seconds.json."""
    from ldlp.report.pages import replace_readme_block

    results, published = Path(results), Path(published)
    if summary is None:
        summary = json.loads((results / "summary.json").read_text())
        times = results / "stage_seconds.json"
        summary["stage_seconds"] = json.loads(times.read_text()) if times.is_file() else {}

    copied = []
    for f in PUBLISHED_FILES:
        if (results / f).is_file() and (results / f).resolve() != (published / f).resolve():
            _copy(results / f, published / f)
            copied.append(f)
    page = published / "README.md"
    atomic_write_text(page, results_page((results / "results.md").read_text(), name, command,
                                         summary.get("stage_seconds") or {}, published))
    done = [f"published {', '.join(copied + ['README.md'])} to {published}"]
    rel = os.path.relpath(page, readme.parent)
    if replace_readme_block(readme, "results", headline_block(summary, name, command, rel)):
        done.append(f"updated the results block of {readme}")
    else:
        done.append(f"{readme} has no <!-- results:start --> ... <!-- results:end --> block: left as is")
    return done
