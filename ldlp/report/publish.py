"""Publishing: one run's whole result, and nothing else, from ``paths.results`` to the committed ``paths.published``.

``python scripts/publish_results.py`` and the main command's ``publish=true`` both go through :func:`publish_run`.
The main command writes ``run.json`` into ``paths.results`` when it finishes (:func:`write_run_manifest`: the
stages of that run and their seconds; :func:`write_run_settings`: what its figures were measured with); publishing
reads it, so the files of a stage that run did not have (a disabled load sweep, a tuning left from an earlier run)
are neither published nor listed. Before anything is
copied, :func:`check_publishable` refuses, in one line, a folder that is no finished main-command run, lacks its
core files, holds half of an optional group, was made for another model than ``model.name``, or whose load sweep
is an unfinished checkpoint. Every published file of an earlier publish that this run does not replace is removed
(:func:`prune_published`), and ``manifest.json`` in ``paths.published`` lists what this publish wrote (with
sha256), so the folder holds one run's result.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

from eagle_backbone.errors import ConfigError
from eagle_backbone.io import atomic_path, atomic_write_json, atomic_write_text

RUN_MANIFEST = "run.json"  # in paths.results: the stages of the main command's last finished run, and their seconds
PUBLISHED_MANIFEST = "manifest.json"  # in paths.published: what the last publish wrote

# the core every run has (scripts/summarize.py), then the groups a run may lack; every file of a group or none
CORE = ("results.md", "results.csv", "tokens_per_s.png", "summary.json")
GROUPS = {
    "stage times": (("stage_seconds.json",), ()),
    "run settings": (("run_settings.json",), ()),
    "tuning": (("tuning/tuning.md", "tuning/tuning.json"), ()),
    # (files the group needs, files it may lack): the ratio plot exists only when a row has a ratio
    "load sweep": (("load_sweep/batch_bench.md", "load_sweep/batch_bench.json", "load_sweep/batch_bench.png"),
                   ("load_sweep/batch_bench_ratio.png", "load_sweep/batch_bench_runs.json")),
}
# the stage of the main command that writes a group: a run without that stage publishes none of its files
GROUP_STAGE = {"tuning": "tune", "load sweep": "bench_batch"}


def group_files() -> tuple[str, ...]:
    return CORE + tuple(f for need, maybe in GROUPS.values() for f in need + maybe)


def _models_of(results: Path) -> dict[str, set]:
    """The model names each self-describing file of the run names."""
    out: dict[str, set] = {}
    try:
        out["summary.json"] = set(json.loads((results / "summary.json").read_text()).get("headline") or {})
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise ConfigError(f"{results / 'summary.json'}: not a readable summary ({e}); rerun python scripts/summarize.py")
    try:
        with open(results / "results.csv", newline="") as f:
            out["results.csv"] = {row.get("model") for row in csv.DictReader(f)} - {None, ""}
    except OSError:
        pass
    runs = results / "load_sweep" / "batch_bench_runs.json"
    if runs.is_file():
        try:
            meta = json.loads(runs.read_text()).get("meta") or {}
        except json.JSONDecodeError as e:
            raise ConfigError(f"{runs}: not valid JSON ({e}); rerun the load sweep") from None
        if meta.get("model"):
            out["load_sweep/batch_bench_runs.json"] = {meta["model"]}
    return out


def check_publishable(results: str | Path, name: str, run: dict | None = None) -> list[str]:
    """The run's files to publish (relative paths), or a ConfigError naming what is wrong and what to do. ``run``:
    the run manifest (:func:`read_run_manifest`); a group whose stage is not in its stages is left out, whatever
    an earlier run left in the folder."""
    results = Path(results)
    missing = [f for f in CORE if not (results / f).is_file()]
    if missing:
        raise ConfigError(f"{results}: not a finished run of the main command (missing {', '.join(missing)}); run "
                          "python scripts/pipeline.py first, or point results= at a finished run")
    files = list(CORE)
    for group, (need, maybe) in GROUPS.items():
        if run is not None and GROUP_STAGE.get(group) and GROUP_STAGE[group] not in run["stages"]:
            continue  # not this run's: an earlier run's files
        have = [f for f in need if (results / f).is_file()]
        if have and len(have) < len(need):
            raise ConfigError(f"{results}: the {group} is incomplete ({', '.join(sorted(set(need) - set(have)))} "
                              f"missing next to {', '.join(have)}): rerun its stage, or remove the group's files")
        if have:
            files += have + [f for f in maybe if (results / f).is_file()]
    for f, models in _models_of(results).items():
        if f not in files and f != "summary.json" and f != "results.csv":
            continue
        if models and name not in models:  # a run's sweep may add a variant (embedded_draft_lm) next to it
            raise ConfigError(f"{results / f}: results of model {', '.join(sorted(models))}, not model.name={name}; "
                              f"publish them with model=<their model>, or point results= at {name}'s run")
    sweep = results / "load_sweep" / "batch_bench.json"
    if "load_sweep/batch_bench.json" in files:
        try:
            rows = json.loads(sweep.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{sweep}: not valid JSON ({e}); rerun the load sweep") from None
        if any(isinstance(r, dict) and r.get("complete") is False for r in rows):
            raise ConfigError(f"{sweep}: an unfinished load sweep (a checkpoint: complete=false); rerun it to the "
                              "end before publishing")
    for f in files:
        cell = nan_cell(results / f)
        if cell is not None:
            raise ConfigError(f"{results / f}: a NaN cell ({cell}): the run measured nothing there "
                              "(generation.max_new_tokens=0, no prompts?); fix and rerun it before publishing")
    return files


_NAN = re.compile(r"(?<![A-Za-z])nan(?![a-wyzA-Z])", re.IGNORECASE)  # nan, -nan, nan%, nanx; not "nano"


def nan_cell(path: Path) -> str | None:
    """The first table row of a page (``.md``) or CSV line of ``path`` with a NaN cell (where it is), or None."""
    if path.suffix not in (".md", ".csv"):
        return None
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        cells = line.strip("|").split("|") if path.suffix == ".md" and line.startswith("|") else \
            line.split(",") if path.suffix == ".csv" else []
        if any(_NAN.search(c) for c in cells):
            return f"line {i}: {line.strip()[:80]}"
    return None


def prune_published(published: str | Path, files: list[str]) -> list[str]:
    """Remove from ``published`` every file an earlier publish wrote (its manifest.json, and every publishable file
    of :func:`group_files`) that is not in ``files`` (this run's); returns what was removed. The folder's other
    pages (long runs, batched benchmarks published by their own scripts) are left alone."""
    published, keep = Path(published), set(files) | {"README.md", PUBLISHED_MANIFEST}
    earlier = list(group_files())
    manifest = published / PUBLISHED_MANIFEST
    if manifest.is_file():
        try:
            earlier += list((json.loads(manifest.read_text()).get("files") or {}))
        except (json.JSONDecodeError, AttributeError):
            pass
    removed = []
    for f in dict.fromkeys(earlier):
        target = published / f
        if f not in keep and target.is_file() and published.resolve() in target.resolve().parents:
            target.unlink()
            removed.append(f)
    return removed


def write_run_manifest(results: str | Path, name: str, stages: list[str], stage_seconds: dict) -> dict:
    """``paths.results/run.json``: the model, the stages of the run that just finished (a disabled stage is not
    among them) and their seconds; what :func:`publish_run` publishes from."""
    run = {"model": name, "stages": list(stages),
           "stage_seconds": {k: stage_seconds.get(k) for k in stages},
           "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    atomic_write_json(Path(results) / RUN_MANIFEST, run)
    return run


def write_run_settings(results: str | Path, dtype: str | None, overrides) -> dict:
    """``paths.results/run_settings.json``: what the figures were measured with (``dtype``: the one model.dtype
    resolved to, the main command's overrides, the CPU and whether it has bf16 matmuls); the results page states it."""
    from eagle_backbone.runtime import bf16_matmuls
    from ldlp.bench.harness.loaders import machine_info

    machine = machine_info()
    settings = {"model.dtype": dtype, "overrides": list(overrides or ()), "cpu": machine.get("cpu"),
                "cpu_bf16": bf16_matmuls("cpu"), "gpu": machine.get("gpu"), "torch": machine.get("torch")}
    atomic_write_json(Path(results) / "run_settings.json", settings)
    return settings


def read_run_manifest(results: str | Path) -> dict:
    path = Path(results) / RUN_MANIFEST
    if not path.is_file():
        raise ConfigError(f"{results}: not a finished run of the main command (no {RUN_MANIFEST}); run python "
                          "scripts/pipeline.py to the end first, or point results= at a finished run")
    try:
        run = json.loads(path.read_text())
        if not isinstance(run, dict) or not isinstance(run.get("stages"), list):
            raise ValueError("no stages list")
    except ValueError as e:
        raise ConfigError(f"{path}: not a run manifest ({e}); rerun python scripts/pipeline.py") from None
    return run


# what publish copies from paths.results (outputs/, gitignored) to paths.published (results/, committed)
PUBLISHED_FILES = group_files()


def _minutes(stage_seconds: dict) -> str:
    done = [s for s in stage_seconds.values() if s is not None]
    if not done or len(done) < len(stage_seconds):
        return ""
    return f"{sum(done) / 60:.1f} min"


def results_page(results_md: str, name: str, command: str, stage_seconds: dict, published: Path) -> str:
    """The committed results page (results/<model>/README.md): the main command's tables and plot, the time
    its stages took, and links to the other generated pages next to it."""
    total = _minutes(stage_seconds)
    settings = published / "run_settings.json"
    settings = json.loads(settings.read_text()) if settings.is_file() else {}
    links = [("results.md", "sweeps and head to head"), ("results.csv", "CSV"),
             ("tuning/tuning.md", "replay tuning on the validation labels"),
             ("head_to_head_long/pooled.md", "pooled long head-to-head runs (scripts/pool_head_to_head.py)"),
             ("bench_target.md", "target forward costs (scripts/bench_target.py)"),
             ("batch_bench/README.md", "batched engine against concurrency (scripts/bench_batch.py)"),
             ("batch1_parity/parity.md", "batch 1: the engine against the retired loop (scripts/bench_retired_loop.py)"),
             ("load_sweep/batch_bench.md", "the load sweep: policies against concurrency and temperature"),
             ("trees/batch_bench.md", "draft trees against chains under load (docs/trees.md)")]
    times = ", ".join(f"{k} {v:.0f} s" for k, v in stage_seconds.items() if v is not None)
    pooled = (published / "head_to_head_long" / "pooled.md").is_file()
    lines = [f"# Results: {name}", "",
             f"Generated by `{command}` from the main command's run (do not edit: the next publish rewrites "
             "it)." + (f" The run's stages took {total} in all ({times})." if total else "")
             + (f" Models in {settings['model.dtype']} on {settings.get('cpu')} (bf16 matmuls in hardware: "
                f"{'yes' if settings.get('cpu_bf16') else 'no'})" + (f"; overrides: `{' '.join(settings['overrides'])}`"
                                                                   if settings.get("overrides") else "") + "."
                if settings.get("model.dtype") else ""), "",
             "Next to this page: " + " · ".join(f"[{label}]({f})" for f, label in links if (published / f).is_file()),
             "", "How to read the figures below: the sweep ranks policies by speedup over each run's own AR baseline, "
             "with runs minutes apart on a shared machine, so its \"best adaptive in the sweep\" is a screening "
             "number; the head to head times its contenders in turns on the same prompts, but its few dozen prompts "
             "give an interval too wide to resolve a gain of 2%."
             + (" The pooled long head-to-head runs ([head_to_head_long/pooled.md](head_to_head_long/pooled.md)) "
                "are the measurement to quote." if pooled else ""),
             "", results_md.strip(), "",
             "Tokens/s against γ for every policy of the sweeps above (the main command, `python scripts/pipeline.py`, "
             f"then `{command}`):", "", "![tokens/s against γ](tokens_per_s.png)", ""]
    # the batched benchmark's plot, from the run its README names as the one to read (written by bench_batch.py)
    batch_plot = next((f"{d}/batch_bench.png" for d in ("batch_bench_r2", "batch_bench")
                       if (published / d / "batch_bench.png").is_file()), None)
    if batch_plot:
        lines += ["## Batched decoding against concurrency", "",
                  "Tokens/s of batched AR and static γ against the number of sequences in flight, made by "
                  "`scripts/bench_batch.py`; each committed run's command and what it shows: "
                  "[batch_bench/README.md](batch_bench/README.md).",
                  "", f"![tokens/s against concurrency]({batch_plot})", ""]
    if (published / "load_sweep" / "batch_bench.png").is_file():
        took = stage_seconds.get("bench_batch")
        lines += ["## The load sweep", "",
                  "Batched AR, static γ and the adaptive policies against concurrency, a panel per temperature, made by "
                  "`scripts/bench_batch.py` (the main command's `bench_batch` stage runs a short version"
                  + (f", {took:.0f} s in the run above" if took else "") + "; docs/batched.md gives the commands, and "
                  "the page's header the prompts, rounds and temperatures of this run). The table, the baselines per "
                  "(C, T) and the paired ratios with their 95% intervals: "
                  "[load_sweep/batch_bench.md](load_sweep/batch_bench.md).", "",
                  "![tokens/s against concurrency, per temperature](load_sweep/batch_bench.png)", ""]
        if (published / "load_sweep" / "batch_bench_ratio.png").is_file():
            lines += ["![adaptive / best static γ](load_sweep/batch_bench_ratio.png)", ""]
    return "\n".join(lines)


def headline_block(summary: dict, name: str, command: str, page: str) -> str:
    """README's generated block: the main command's head to head as a short table, and a link to the page."""
    head = summary["headline"].get(name) or {}
    total = _minutes(summary.get("stage_seconds") or {})
    lines = [f"Generated by `{command}`" + (f" (the main command's stages took {total} in all)" if total else "")
             + f"; all tables and the plot: [{page}]({page}).", ""]
    h2h = head.get("head_to_head")
    if h2h:
        ref = h2h["reference"]
        # n_dropped next to n_prompts, in bold above 5%
        from ldlp.report.notes import dropped_note, skipped_note

        lines += [(f"Head to head of the main command ({h2h['n_prompts']} prompts{dropped_note(h2h)}{skipped_note(h2h)} "
                   f"× {h2h['rounds']} "
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
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def publish_run(results: Path, published: Path, readme: Path, summary: dict | None, name: str, command: str) -> list[str]:
    """Publish one run's whole result: the files of the stages the main command's last run had (its ``run.json``),
    or a one-line error before anything is copied (:func:`check_publishable`); every earlier published file this
    run does not replace is removed, and ``manifest.json`` lists what was written."""
    results, published = Path(results), Path(published)
    if results.resolve() == published.resolve() and not (results / RUN_MANIFEST).is_file():
        # rewriting the page from the committed files: they are one publish's result already
        times = results / "stage_seconds.json"
        seconds = json.loads(times.read_text()) if times.is_file() else {}
        run = {"model": name, "stages": list(seconds) + list(GROUP_STAGE.values()), "stage_seconds": seconds}
    else:
        run = read_run_manifest(results)
    files = check_publishable(results, name, run)
    if summary is None:
        summary = json.loads((results / "summary.json").read_text())
    summary = {**summary, "stage_seconds": run.get("stage_seconds") or {}}  # this run's stages only
    files = [f for f in files if f != "stage_seconds.json"] + ["stage_seconds.json"]
    removed = prune_published(published, files)  # an older run's files this run does not replace
    done = publish(results, published, readme, summary, name, command, files=files)
    left = [g for g, st in GROUP_STAGE.items() if st not in run["stages"]]
    return done + ([f"removed {', '.join(removed)} from {published} (not in this run)"] if removed else []) + \
        ([f"not published: {', '.join(left)} (not run by this run)"] if left else [])


def publish(results: Path, published: Path, readme: Path, summary: dict | None, name: str, command: str,
            files: list[str] | None = None) -> list[str]:
    """Copy the run's ``files`` (default: every publishable file in ``results``) from ``results`` (outputs/,
    gitignored) to ``published`` (results/<model>, committed), write stage_seconds.json from the summary's
    stage seconds, the page README.md, manifest.json, and README's ``results`` block when README has one; returns
    what it did. ``summary`` (the pipeline's) defaults to the run's summary.json and stage_seconds.json."""
    from ldlp.report.pages import replace_readme_block

    results, published = Path(results), Path(published)
    if summary is None:
        summary = json.loads((results / "summary.json").read_text())
        times = results / "stage_seconds.json"
        summary["stage_seconds"] = json.loads(times.read_text()) if times.is_file() else {}
    if files is None:
        files = [f for f in PUBLISHED_FILES if (results / f).is_file()]
    stage_seconds = summary.get("stage_seconds") or {}
    copied = []
    for f in files:
        if f == "stage_seconds.json" and stage_seconds:
            atomic_write_json(published / f, stage_seconds)  # the run's stages, not every stage ever timed here
            copied.append(f)
        elif (results / f).is_file() and (results / f).resolve() != (published / f).resolve():
            _copy(results / f, published / f)
            copied.append(f)
    page = published / "README.md"
    atomic_write_text(page, results_page((results / "results.md").read_text(), name, command, stage_seconds,
                                         published))
    written = copied + ["README.md"]
    atomic_write_json(published / PUBLISHED_MANIFEST, {
        "model": name, "command": command, "published": time.strftime("%Y-%m-%d %H:%M:%S"),
        "from": str(results), "files": {f: _sha256(published / f) for f in written}})
    done = [f"published {', '.join(written)} and {PUBLISHED_MANIFEST} to {published}"]
    rel = os.path.relpath(page, readme.parent)
    if replace_readme_block(readme, "results", headline_block(summary, name, command, rel)):
        done.append(f"updated the results block of {readme}")
    else:
        done.append(f"{readme} has no <!-- results:start --> ... <!-- results:end --> block: left as is")
    return done
