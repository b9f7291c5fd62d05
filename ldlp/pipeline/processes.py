"""What keeps a main command's processes in hand: the stages die with it (a parent-death signal, and a watchdog that
outlives a SIGKILLed main command just long enough to stop their process groups), and one main command at a time
holds its folders (:class:`FolderLock`, a flock plus a record of the holder and its running stage)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ldlp.pipeline.stage import RUN_LOCK, Stage

LOCK = ".pipeline.lock"  # in paths.data_dir and paths.outputs: one main command at a time on those folders

_libc = None


def die_with_parent(parent: int):
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


def start_watchdog(groups: list[int]) -> subprocess.Popen | None:
    """A small process that outlives a killed main command just long enough to stop the stage's process groups
    (``groups``: the stages and whatever they started): when its parent, the main command, is gone, it sends them
    SIGTERM, then SIGKILL. In its own session, so a Ctrl-C at the terminal leaves it to the main command."""
    try:
        return subprocess.Popen([sys.executable, "-I", "-c", _WATCHDOG, str(os.getpid())] + [str(g) for g in groups],
                                start_new_session=True, stdin=subprocess.DEVNULL)
    except OSError:
        return None


def stop_watchdog(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    with contextlib.suppress(OSError):
        proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def start_time(pid: int) -> str | None:
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
    now = start_time(pid)
    return start is None or now is None or now == start


class FolderLock:
    """An exclusive lock per folder (``LOCK`` inside it): flock, plus a record of the holder (pid, its start time,
    command) and of the stage processes it runs. A record whose holder and stages are gone is stale: it is taken
    over with one line saying so; a live holder (or a stage a killed holder left running) refuses."""

    def __init__(self, folders, name: str = LOCK, who: str = "main command",
                 instead: str = "give this one other folders (paths.data_dir=..., paths.outputs=...)"):
        self.folders = [Path(f) for f in dict.fromkeys(str(f) for f in folders)]
        self.name, self.who, self.instead = name, who, instead  # the lock file; who holds it; what else to do
        self.files: list = []
        self.record = {"pid": os.getpid(), "host": socket.gethostname(), "start": start_time(os.getpid()),
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
        host = f" on {held['host']}" if held.get("host") else ""
        return f"pid {held.get('pid')}{host}, started {held.get('started')}: {held.get('command')}"

    def __enter__(self):
        for folder in self.folders:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / self.name
            f = open(path, "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = self._holder(self._read(f))
                f.close()
                self.__exit__()
                raise ValueError(f"{folder} is in use by another {self.who} ({holder}); wait for it to finish, "
                                 f"or {self.instead}") from None
            held = self._read(f)
            if held and held.get("host") not in (None, self.record["host"]):  # its pid means nothing here
                f.close()
                self.__exit__()
                raise ValueError(f"the lock at {path} is held by {self._holder(held)}; if that run is gone, "
                                 f"remove {path}, or {self.instead}")
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
        self.record["stages"] = [{"pid": p, "start": start_time(p)} for p in pids]
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


def out_dir_lock(out_dir) -> FolderLock:
    """The lock of a benchmark's results folder (``RUN_LOCK`` in it), for the whole run: a second run into the
    same folder is refused in one line naming the folder and the holder, so the folder and the page a run prints
    are its own; a lock left by a run that died is taken over, saying so."""
    return FolderLock([out_dir], name=RUN_LOCK, who="run", instead="give this one another out_dir=...")

