"""Running the plan's stages: each a subprocess of its script, in its own process group, skipped when its fingerprint
matches the one stored next to its output (``stage.json``), resumed where it says it did not finish. Signals to the
main command are forwarded to the running stage; the lock and the watchdog (:mod:`ldlp.pipeline.processes`) keep a
killed main command from leaving a stage running or a second one from writing the same folders."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from eagle_backbone.io import atomic_write_json
from eagle_backbone.paths import REPO_ROOT
from ldlp.pipeline.processes import FolderLock, die_with_parent, start_watchdog, stop_watchdog
from ldlp.pipeline.stage import (FINGERPRINT, Stage, changed_inputs, fingerprint, stored_fingerprint,
                                 store_fingerprint)

# expected seconds per stage (by stage name, sweeps by kind; "start": a process that loads the models and exits) where this machine has no stage_seconds.json yet,
# on an idle 2-core CPU, per the dtype model.dtype resolves to (docs/pipeline.md#how-long-it-takes).
# bfloat16: a CPU with bf16 matmuls, the committed run's stage_seconds.json (the oracle as one collector; the cost
# stage as profiling, which that run skipped, its table there). float32: the main command measured in float32 on a 2-core AMD EPYC with torch's
# kernels held to AVX2 (ATEN_CPU_CAPABILITY=avx2, as on a CPU without AVX-512 or bf16 matmuls; a fresh clone,
# docs/pipeline.md#how-long-it-takes); the oracle as one collector (two side by side took 109 s). cost: the
# profiling of slot counts 1-16, which the load sweep's first run did before; contenders loads no model.
EXPECTED_S = {
    "bfloat16": {"start": 6, "corpus": 20, "oracle": 146, "ldlp": 33, "acceptance": 13, "cost": 20, "tune": 23,
                 "sweep:static": 61, "sweep:adaptive": 60, "sweep:peer_static": 22, "sweep:peer": 26, "sweep:peer_hf": 26,
                 "bench_batch": 93, "contenders": 5, "head_to_head": 224},
    "float32": {"start": 8, "corpus": 8, "oracle": 186, "ldlp": 31, "acceptance": 13, "cost": 25, "tune": 27,
                "sweep:static": 64, "sweep:adaptive": 62, "sweep:peer_static": 20, "sweep:peer": 24, "sweep:peer_hf": 24,
                "bench_batch": 97, "contenders": 8, "head_to_head": 256},
}


def force_level(force) -> set[str]:
    if force in (False, None, "false", "none"):
        return set()
    if force in (True, "true", "sweeps"):
        return {"tune", "sweeps", "bench"}  # all time this machine
    if force == "all":
        return {"corpus", "oracle", "ldlp", "ldlp_survival", "acceptance", "cost", "tune", "sweeps", "bench"}
    raise ValueError(f"force must be false, true (redo tuning, sweeps and the load sweep) or all (also the labels, "
                     f"LDLP and acceptance head), got {force!r}")


class StageRunner:
    """Runs stages in order: a stage whose stored fingerprint equals its inputs' is skipped."""

    def __init__(self, cfg, stages: list[Stage]):
        self.force = force_level(cfg.force)
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
            return None if one is None else one * stage.scale
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
                                  preexec_fn=die_with_parent(os.getpid())) for c in commands]
        # the stages' process groups die with the main command even when it is SIGKILLed (no handler runs then)
        watchdog = start_watchdog([p.pid for p in procs])
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
            stop_watchdog(watchdog)
            if self.lock is not None:
                self.lock.record_stages([])
        code = next((c for c in codes if c != 0), 0)
        if got:
            name = signal.Signals(got[0]).name
            print(f"{name}: stopped stage {stage.name!r} (exit {code}); rerun the same command to continue",
                  file=sys.stderr, flush=True)
            raise SystemExit(128 + got[0])
        return code

    def preview(self, stages: list[Stage]) -> tuple[list[str], float]:
        """One line per stage: would it run and why, its expected time, its command; and the expected seconds of
        those that run. A stage downstream of one that runs is shown as running when its upstream's output
        changes (a deterministic rebuild, or the same contenders chosen again, leaves it as is)."""
        lines, total, runs = [], 0.0, set()
        n = len(stages)
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

