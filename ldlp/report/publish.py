"""What the publish step may copy: one complete set of files from one run of one model.

``python scripts/publish_results.py`` (and the main command's ``publish=true``) copy a run's pages from
``paths.results`` to the committed ``paths.published``. Before anything is copied, :func:`check_publishable`
refuses, in one line, a run that lacks its core files, holds half of an optional group (the tuning, the load
sweep), was made for another model than ``model.name``, or whose load sweep is an unfinished checkpoint; and
:func:`prune_published` removes the published files of every group the run does not have, so that the page
never links an older run's tuning or plots next to this run's tables.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from eagle_backbone.errors import ConfigError

# the core every run has (scripts/summarize.py), then the groups a run may lack; every file of a group or none
CORE = ("results.md", "results.csv", "tokens_per_s.png", "summary.json")
GROUPS = {
    "stage times": (("stage_seconds.json",), ()),
    "run settings": (("run_settings.json",), ()),
    "tuning": (("tuning/tuning.md", "tuning/tuning.json"), ()),
    # (files the group needs, files it may lack): the ratio plot exists only when a row has a ratio
    "load sweep": (("load_sweep/batch_bench.md", "load_sweep/batch_bench.json", "load_sweep/batch_bench.png"),
                   ("load_sweep/batch_bench_ratio.png",)),
}


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


def check_publishable(results: str | Path, name: str) -> list[str]:
    """The run's files to publish (relative paths), or a ConfigError naming what is wrong and what to do."""
    results = Path(results)
    missing = [f for f in CORE if not (results / f).is_file()]
    if missing:
        raise ConfigError(f"{results}: not a finished run of the main command (missing {', '.join(missing)}); run "
                          "python scripts/pipeline.py first, or point results= at a finished run")
    files = list(CORE)
    for group, (need, maybe) in GROUPS.items():
        have = [f for f in need if (results / f).is_file()]
        if have and len(have) < len(need):
            raise ConfigError(f"{results}: the {group} is incomplete ({', '.join(sorted(set(need) - set(have)))} "
                              f"missing next to {', '.join(have)}): rerun its stage, or remove the group's files")
        if have:
            files += have + [f for f in maybe if (results / f).is_file()]
    for f, models in _models_of(results).items():
        if models and name not in models:  # a run's sweep may add a variant (embedded_draft_lm) next to it
            raise ConfigError(f"{results / f}: results of model {', '.join(sorted(models))}, not model.name={name}; "
                              f"publish them with model=<their model>, or point results= at {name}'s run")
    sweep = results / "load_sweep" / "batch_bench.json"
    if sweep.is_file():
        try:
            rows = json.loads(sweep.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{sweep}: not valid JSON ({e}); rerun the load sweep") from None
        if any(isinstance(r, dict) and r.get("complete") is False for r in rows):
            raise ConfigError(f"{sweep}: an unfinished load sweep (a checkpoint: complete=false); rerun it to the "
                              "end before publishing")
    return files


def prune_published(published: str | Path, files: list[str]) -> list[str]:
    """Remove from ``published`` every publishable file (:func:`group_files`) that is not in ``files`` (the
    run's); returns what was removed."""
    published, keep = Path(published), set(files)
    removed = []
    for f in group_files():
        if f not in keep and (published / f).is_file():
            (published / f).unlink()
            removed.append(f)
    return removed
