"""The main command's stages, each a subprocess of a Hydra script, skipped when its output exists.

    corpus   python scripts/build_corpus.py             (data/embedded/corpus, gitignored, 3 s)
    oracle   python scripts/collect_oracle.py           (data/oracle/embedded)
    ldlp     python scripts/train_ldlp.py +experiment=tiny   (data/ldlp/embedded)
    acceptance  python scripts/train_acceptance.py      (data/acceptance/embedded: the acceptance head)
    tune     python scripts/tune_policies.py            (results/embedded/tuning: thresholds by replay on the
             validation labels, with a cost model timed on this machine; the adaptive sweep uses them)
    sweeps   python scripts/evaluate.py -m ...          (outputs/pipeline/embedded/round-R/<sweep>)
             per round: static γ, adaptive policies, and the peer rows on the standalone draft LM
    summary  ldlp.report.summary.summarize                     (results/embedded: results.md/.csv, tokens_per_s.png)

Sweeps are repeated ``sweep.rounds`` times, one round after the other, so every policy is measured in
every phase of a noisy machine; the summary reports medians over rounds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from eagle_backbone.paths import REPO_ROOT, repo_path

DONE = ".done"


class Stage:
    def __init__(self, name: str, title: str, cmd: list[str] | None, done_when: Path | None, marker: Path | None = None,
                 run_dir: Path | None = None):
        self.name, self.title, self.cmd = name, title, cmd
        self.done_when, self.marker, self.run_dir = done_when, marker, run_dir

    def done(self) -> bool:
        if self.done_when is None or not self.done_when.exists():
            return False
        # a sweep counts as done only for the same command (other settings: run it again)
        return self.marker is None or self.marker.read_text() == self.signature

    @property
    def signature(self) -> str:
        return " ".join(self.cmd[1:]) + "\n"


def _script(name: str) -> list[str]:
    return [sys.executable, str(REPO_ROOT / "scripts" / name)]


def _list(values) -> str:
    return ",".join(str(v) for v in values)


def _checkpoints(cfg) -> list[str]:
    """The checkpoint folders the policies read, as overrides for every script that builds policies."""
    survival = cfg.ldlp.get("survival_out_dir")
    return ([f"ldlp_path={cfg.ldlp.out_dir}", f"acceptance_path={cfg.acceptance.out_dir}"]
            + ([f"ldlp_survival_path={survival}"] if survival else []))


def plan(cfg) -> list[Stage]:
    """Every stage of the pipeline, in order."""
    threads = [f"threads={cfg.threads}"] if cfg.get("threads") else []
    oracle_dir, ldlp_dir, acceptance_dir = Path(cfg.oracle.out_dir), Path(cfg.ldlp.out_dir), Path(cfg.acceptance.out_dir)
    runs = Path(cfg.runs_dir)
    corpus = Path(repo_path("data/embedded/corpus"))
    stages = [
        Stage("corpus", "build the embedded conversation corpus", _script("build_corpus.py"),
              corpus / "test.json"),
        Stage("oracle", "collect oracle draft-length labels (greedy, embedded pair)",
              _script("collect_oracle.py") + [f"out_dir={oracle_dir}"] + threads + list(cfg.oracle.overrides),
              oracle_dir / "report.md"),
        Stage("ldlp", "train the LDLP on the oracle labels",
              _script("train_ldlp.py") + list(cfg.ldlp.overrides) + [f"ldlp_training.oracle_dir={oracle_dir}",
                                                                    f"ldlp_training.out_dir={ldlp_dir}"] + threads,
              ldlp_dir / "model.safetensors"),
        Stage("acceptance", "train the acceptance head on the drafter states of the oracle rows",
              _script("train_acceptance.py") + [f"oracle_dir={oracle_dir}", f"out_dir={acceptance_dir}"]
              + list(cfg.acceptance.overrides), acceptance_dir / "model.safetensors"),
    ]
    survival_dir = cfg.ldlp.get("survival_out_dir")
    if survival_dir:
        survival_dir = Path(survival_dir)
        stages.append(Stage("ldlp_survival", "train the LDLP with the survival (distribution) head",
                            _script("train_ldlp.py") + list(cfg.ldlp.survival_overrides)
                            + [f"ldlp_training.oracle_dir={oracle_dir}", f"ldlp_training.out_dir={survival_dir}",
                               "ldlp_training.evaluation.benchmark=false"] + threads,
                            survival_dir / "model.safetensors"))
    sweep_threads = cfg.sweep.get("threads") or cfg.get("threads")
    tuned = None
    if cfg.get("tune") and cfg.tune.get("enabled"):
        tune_dir = Path(cfg.tune.out_dir)
        tuned = tune_dir / "tuning.json"
        stages.append(Stage("tune", "tune the adaptive policies by replay on the validation labels (timed cost model)",
                            _script("tune_policies.py") + [f"model={cfg.sweep.model}", f"oracle_dir={oracle_dir}",
                                                           f"out_dir={tune_dir}"] + _checkpoints(cfg)
                            + ([f"threads={sweep_threads}"] if sweep_threads else []) + list(cfg.tune.overrides),
                            tuned))
    common = list(cfg.sweep.overrides) + ([f"threads={sweep_threads}"] if sweep_threads else [])
    for r in range(1, int(cfg.sweep.rounds) + 1):
        sweeps = [
            ("static", cfg.sweep.model, ["policy=static", f"policy.gamma={_list(cfg.sweep.static_gammas)}"]),
            ("adaptive", cfg.sweep.model, [f"policy={_list(cfg.sweep.adaptive)}"] + _checkpoints(cfg)
             + ([f"tuned_from={tuned}"] if tuned else [])),
        ]
        if cfg.peer.enabled:
            if cfg.peer.static_gammas:
                sweeps.append(("peer_static", cfg.peer.model,
                               ["policy=static", f"policy.gamma={_list(cfg.peer.static_gammas)}"]))
            if cfg.peer.policies:
                sweeps.append(("peer", cfg.peer.model, [f"policy={_list(cfg.peer.policies)}"]))
        for name, model, args in sweeps:
            if args[0].endswith("="):  # an empty policy list
                continue
            out = runs / f"round-{r}" / name
            cmd = _script("evaluate.py") + ["-m", f"model={model}"] + args + common + [f"hydra.sweep.dir={out}"]
            stages.append(Stage(f"sweep:{name}:{r}", f"round {r}/{cfg.sweep.rounds}: {name} ({model})", cmd,
                                out / DONE, marker=out / DONE, run_dir=out))
    return stages


def _model_name(cfg) -> str:
    from hydra import compose

    return str(compose(config_name="evaluate", overrides=[f"model={cfg.sweep.model}"] + list(cfg.sweep.overrides)).model.name)


def _tuned_best(tuned: Path | None) -> dict:
    """{policy: its best replay-tuned result} from a tuning.json ({} when no tuning ran)."""
    if tuned is None or not tuned.is_file():
        return {}
    from ldlp.bench.replay import best_per_policy

    return best_per_policy(json.loads(tuned.read_text())["results"])


def _static_gammas(cfg, best_swept: int, tuned_best: dict) -> list[int]:
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


def head_to_head_stage(cfg, name: str, summary: dict) -> Stage | None:
    """Static γ around the sweep's best and the best adaptive policies, timed in turns (scripts/compare.py);
    ``summary`` is the sweeps' (ldlp.report.summary.summarize), ``name`` the swept model's name."""
    head = summary["headline"].get(name) or {}
    if "best_static" not in head or "best_adaptive" not in head:
        return None
    tuned = Path(cfg.tune.out_dir) / "tuning.json" if cfg.get("tune") and cfg.tune.get("enabled") else None
    tuned_best = _tuned_best(tuned)
    gammas = _static_gammas(cfg, int(head["best_static"]["gamma"]), tuned_best)
    policies = adaptive_contenders(cfg, name, summary, tuned_best)
    contenders = [f"policy=static policy.gamma={x}" for x in gammas] + [f"policy={p}" for p in policies]
    if "oracle" in cfg.sweep.adaptive:
        contenders.append("policy=oracle")  # the upper bound, timed in the same turns: headroom in paired numbers
    out = Path(cfg.runs_dir) / "head_to_head"
    threads = cfg.sweep.get("threads") or cfg.get("threads")
    cmd = (_script("compare.py") + [f"model={cfg.sweep.model}", "contenders=[" + ",".join(f'"{c}"' for c in contenders)
                                    + "]", f"rounds={cfg.head_to_head.rounds}", f"out_dir={out}",
                                    f"hydra.run.dir={out}"] + _checkpoints(cfg)
           + ([f"tuned_from={tuned}"] if tuned else []) + ([f"threads={threads}"] if threads else [])
           + [o for o in cfg.sweep.overrides if not o.startswith("evaluation.repeats")]
           + list(cfg.head_to_head.overrides))
    return Stage("head_to_head", f"head to head: static γ={gammas} vs {', '.join(policies)} (and the oracle), "
                 "timed in turns", cmd,
                 out / DONE, marker=out / DONE, run_dir=out)


def _force_level(force) -> set[str]:
    if force in (False, None, "false", "none"):
        return set()
    if force in (True, "true", "sweeps"):
        return {"tune", "sweeps"}  # both time this machine
    if force == "all":
        return {"oracle", "ldlp", "ldlp_survival", "acceptance", "tune", "sweeps"}
    raise ValueError(f"force must be false, true (redo sweeps) or all (also labels, LDLP and acceptance head), "
                     f"got {force!r}")


TRAIN_COMMANDS = {"target": "python scripts/train_lm.py lm=embedded_target",
                  "drafter": "python scripts/train_drafter.py",
                  "draft_lm": "python scripts/train_lm.py lm=embedded_draft_lm"}


def check_models(cfg) -> None:
    """Fail early, naming the command that makes them, when a sweep's models are missing."""
    from hydra import compose

    models = [cfg.sweep.model] + ([cfg.peer.model] if cfg.peer.enabled else [])
    missing = []
    for model in models:
        m = compose(config_name="evaluate", overrides=[f"model={model}"] + list(cfg.sweep.overrides)).model
        for key in ("target", "drafter"):
            if not (Path(m[key]) / "config.json").exists():
                name = Path(m[key]).name
                missing.append(f"model={model}: {m[key]}" + (f" ({TRAIN_COMMANDS[name]})" if name in TRAIN_COMMANDS else ""))
    if missing:
        raise ValueError("models missing: " + "; ".join(dict.fromkeys(missing)))


def _ar_impl(run_dir: Path | None) -> str | None:
    """The AR implementation the calibration in ``run_dir``'s runs found faster (None if none was timed)."""
    import json

    if run_dir is None or not run_dir.exists():
        return None
    for f in sorted(run_dir.rglob("results.json")):
        choice = json.loads(f.read_text()).get("ar_choice") or {}
        if choice.get("reason") == "faster in calibration":
            return choice["impl"]
    return None


def run(cfg) -> dict:
    """Run the stages that are not done yet, then summarize; returns the summary (see ldlp.summary)."""
    from ldlp.report.summary import summarize

    force = _force_level(cfg.force)
    check_models(cfg)
    stages = plan(cfg)
    t_start = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    ar_impl = None  # decided (timed) by the first sweep, then fixed: later processes skip the calibration
    fixed_ar = any(o.startswith("evaluation.ar_baseline=") for o in cfg.sweep.overrides)
    times_file = Path(cfg.out_dir) / "stage_seconds.json"  # the last run of each stage (skipped ones keep theirs)
    times = json.loads(times_file.read_text()) if times_file.is_file() else {}

    def record(name: str, seconds: float) -> None:
        times[name] = round(seconds, 1)
        times_file.parent.mkdir(parents=True, exist_ok=True)
        times_file.write_text(json.dumps(times, indent=2) + "\n")

    def execute(stage: Stage, signature: str) -> None:
        t0 = time.perf_counter()
        proc = subprocess.run(stage.cmd, cwd=REPO_ROOT, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"stage {stage.name!r} failed (exit {proc.returncode}); fix it and rerun the same "
                               f"command: finished stages are skipped")
        if stage.marker is not None:
            stage.marker.write_text(signature)
        record(stage.name, time.perf_counter() - t0)
        print(f"  {stage.name} finished in {time.perf_counter() - t0:.0f} s "
              f"(total {time.perf_counter() - t_start:.0f} s)", flush=True)

    for k, stage in enumerate(stages, 1):
        group = "sweeps" if stage.name.startswith("sweep:") else stage.name
        head = f"[{k}/{len(stages)}] {stage.title}"
        if stage.done() and group not in force:
            print(f"{head}: done already, skipped", flush=True)
            ar_impl = ar_impl or _ar_impl(stage.run_dir)
            continue
        signature = stage.signature
        if group == "sweeps" and ar_impl and not fixed_ar:
            stage.cmd = stage.cmd + [f"evaluation.ar_baseline={ar_impl}"]
        print(f"{head} ...\n  $ {' '.join(stage.cmd)}", flush=True)
        if stage.run_dir is not None and stage.run_dir.exists():
            shutil.rmtree(stage.run_dir)  # a half-finished sweep is redone whole: its rows must share a process
        if group == "oracle" and "oracle" in force:
            stage.cmd = stage.cmd + ["overwrite=true"]
        execute(stage, signature)
        if group == "sweeps":
            ar_impl = ar_impl or _ar_impl(stage.run_dir)
    sweep_dirs = [s.run_dir for s in stages if s.run_dir is not None]
    summary = summarize(sweep_dirs, cfg.out_dir)
    h2h = cfg.get("head_to_head")
    if h2h and h2h.get("enabled"):
        stage = head_to_head_stage(cfg, _model_name(cfg), summary)
        if stage is not None:
            head = f"[{len(stages) + 1}/{len(stages) + 1}] {stage.title}"
            if stage.done() and "sweeps" not in force:
                print(f"{head}: done already, skipped", flush=True)
            else:
                print(f"{head} ...\n  $ {' '.join(stage.cmd)}", flush=True)
                execute(stage, stage.signature)
            result = json.loads((stage.run_dir / "head_to_head.json").read_text())
            summary = summarize(sweep_dirs, cfg.out_dir, head_to_head=result)
    if cfg.get("update_readme"):
        from ldlp.report.pages import update_readme

        names = [s.name for s in stages] + (["head_to_head"] if h2h and h2h.get("enabled") else [])
        full = sum(times.get(n, 0.0) for n in names)
        note = (f"the stages' last runs took {full / 60:.1f} min in all on the machine below; "
                if all(n in times for n in names if n != "corpus") else "")
        if update_readme(repo_path("README.md"), summary["md"], summary["png"], "python scripts/pipeline.py", note):
            print("updated the results block of README.md", flush=True)
        else:
            print("README.md has no <!-- results:start --> ... <!-- results:end --> block: left as is", flush=True)
    summary["elapsed_s"] = time.perf_counter() - t_start
    return summary
