"""The main command (scripts/pipeline.py): plan the stages, print the plan, run what is not done for its inputs,
summarize the sweeps (and the head to head) into ``paths.results``, record the run, and publish when asked."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from eagle_backbone.paths import REPO_ROOT
from ldlp.pipeline.compose import compose_model
from ldlp.pipeline.plan import plan
from ldlp.pipeline.processes import FolderLock, lock_folders
from ldlp.pipeline.runner import StageRunner
from ldlp.pipeline.stage import Stage

TRAIN_COMMANDS = {"target": "python scripts/train_lm.py lm=embedded_target",
                  "drafter": "python scripts/train_drafter.py",
                  "draft_lm": "python scripts/train_lm.py lm=embedded_draft_lm"}


def check_models(cfg, model: str = "embedded", overrides=()) -> None:
    """Fail early, naming the command that makes them, when a sweep's models are missing."""
    models = [model] + ([cfg.peer.model] if cfg.peer.enabled else [])
    missing = []
    for option in models:
        m = compose_model(cfg, option, overrides, peer=option != model)
        for key in ("target", "drafter"):
            if not (Path(m[key]) / "config.json").exists():
                name = Path(m[key]).name
                missing.append(f"model={option}: {m[key]}" + (f" ({TRAIN_COMMANDS[name]})" if name in TRAIN_COMMANDS
                                                              else ""))
    if missing:
        raise ValueError("models missing: " + "; ".join(dict.fromkeys(missing)))


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
        lines, total = runner.preview(stages)
        source = "this machine's last run" if runner.times else "reference estimates"
        print(f"plan ({len(lines)} stages, expected {total / 60:.1f} min for those that run; times from {source}, "
              f"model.dtype={_dtype(stages) or '?'}):", flush=True)
        for line in lines:
            print("  " + line, flush=True)
        if dry:
            return None
        runner.stages = {s.name: s for s in stages}
        return _run(cfg, model, overrides, stages, runner)


def _run(cfg, model, overrides, stages: list[Stage], runner: StageRunner) -> dict:
    from ldlp.report.publish import publish_run, write_run_manifest, write_run_settings
    from ldlp.report.summary import summarize

    ar_impl = None  # decided (timed) by the first sweep, then fixed: later processes skip the calibration
    fixed_ar = any(o.startswith("evaluation.ar_baseline=") for o in cfg.sweep.overrides)
    for k, stage in enumerate(stages, 1):
        sweep = stage.name.startswith("sweep:")
        if sweep and ar_impl and not fixed_ar:
            stage.extra = [f"evaluation.ar_baseline={ar_impl}"]
        runner(stage, k, len(stages))
        if sweep:
            ar_impl = ar_impl or _ar_impl(stage.out)
    sweep_dirs = [s.out for s in stages if s.name.startswith("sweep:")]
    out_dir = Path(cfg.paths.results)
    write_run_settings(out_dir, _dtype(stages), overrides)
    head = next((s for s in stages if s.name == "head_to_head"), None)
    result = json.loads((head.out / "head_to_head.json").read_text()) if head is not None else None
    summary = summarize(sweep_dirs, out_dir, head_to_head=result)
    name = str(compose_model(cfg, model, overrides).name)
    summary["stage_seconds"] = {s.name: runner.times.get(s.name) for s in stages}
    summary["elapsed_s"] = time.perf_counter() - runner.t_start
    # what publishing takes: this run's stages (a disabled one's older files in paths.results are not this run's)
    write_run_manifest(out_dir, name, [s.name for s in stages], summary["stage_seconds"])
    if cfg.get("publish"):
        for line in publish_run(out_dir, Path(cfg.paths.published), REPO_ROOT / "README.md", summary, name,
                                command="python scripts/pipeline.py publish=true"):
            print(line, flush=True)
    return summary


def _dtype(stages: list[Stage]) -> str | None:
    """The dtype model.dtype resolved to on this machine (the first stage that loads the main model)."""
    return next((s.resolved["model.dtype"] for s in stages if s.resolved), None)


def _ar_impl(run_dir: Path | None) -> str | None:
    """The AR implementation the calibration in ``run_dir``'s runs found faster (None if none was timed)."""
    if run_dir is None or not run_dir.exists():
        return None
    for f in sorted(run_dir.rglob("results.json")):
        choice = json.loads(f.read_text()).get("ar_choice") or {}
        if choice.get("reason") == "faster in calibration":
            return choice["impl"]
    return None
