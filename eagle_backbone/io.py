"""Atomic file writes: a reader (or a resumed job) sees the old file or the new one, never half of one.

Every writer in the project goes through here: write a temporary sibling, fsync it, rename it over
the destination (``os.replace`` is atomic on POSIX and Windows within one file system). The temporary
name is unique per process and call (``name.<pid>-<random>.tmp``, in the destination's folder), so two
processes writing one file (side-by-side collectors and their shared manifest) never touch each other's
temporary file; a writer removes only the temporary file it created, and :func:`remove_leftovers` only
those of processes that are gone. Writers that
want a path rather than bytes (matplotlib, pandas, pyarrow, safetensors, ``datasets.save_to_disk``)
write to the path :func:`atomic_path` yields.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path

TMP_SUFFIX = ".tmp"  # the temporary sibling of ``name`` is ``name.<pid>-<hex>.tmp`` (``stem.<pid>-<hex>.tmp.suffix``
# with keep_suffix): the pid names the writer, so a leftover of a dead process can be told from a live write
_TMP_RE = re.compile(r"\.(\d+)-[0-9a-f]{8}\.tmp(\.[^./]+)?$")


def _fsync_tree(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    for f in files:
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())


def atomic_replace(tmp: str | Path, final: str | Path) -> None:
    """Flush ``tmp`` to disk, then rename it to ``final`` (a file, or a folder: an existing folder at
    ``final`` is removed first)."""
    tmp, final = Path(tmp), Path(final)
    _fsync_tree(tmp)
    if tmp.is_dir() and final.is_dir():
        shutil.rmtree(final)
    os.replace(tmp, final)


def tmp_path(path: str | Path, keep_suffix: bool = False) -> Path:
    """A fresh temporary sibling for writing ``path``: this process's pid and a random suffix, so no other
    writer (another process, or another call of this one) picks the same name."""
    path = Path(path)
    tag = f".{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}"
    if keep_suffix:  # e.g. matplotlib picks the format by the suffix
        return path.with_name(path.stem + tag + path.suffix)
    return path.with_name(path.name + tag)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tmp_owner(path: str | Path) -> int | None:
    """The pid in a temporary file's name (:func:`tmp_path`), None for a name without one."""
    m = _TMP_RE.search(Path(path).name)
    return int(m.group(1)) if m else None


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


@contextmanager
def atomic_path(path: str | Path, keep_suffix: bool = False):
    """Yield a temporary sibling of ``path`` to write (a file or a folder); when the block ends without
    an error it is flushed and renamed to ``path``, otherwise it is removed.

    >>> with atomic_path(out / "plot.png", keep_suffix=True) as tmp:
    ...     fig.savefig(tmp)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path, keep_suffix)  # unique: nothing to remove first, and nobody else's file to remove
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    atomic_replace(tmp, path)


def remove_leftovers(folder: str | Path, pattern: str = "*") -> list[Path]:
    """Delete the temporary files of killed writes matching ``pattern`` under ``folder``: those whose writer
    (the pid in the name) is gone; a live process's write in progress is left alone. Returns what it removed."""
    found = set(Path(folder).glob(pattern + TMP_SUFFIX)) | set(Path(folder).glob(pattern + TMP_SUFFIX + ".*"))
    stale = sorted(p for p in found if (pid := tmp_owner(p)) is not None and pid != os.getpid() and not pid_alive(pid))
    for p in stale:
        _remove(p)
    return stale


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj, newline: bool = True, **kwargs) -> Path:
    """``json.dumps(obj, indent=2, **kwargs)``, plus a final newline unless ``newline=False``."""
    kwargs.setdefault("indent", 2)
    return atomic_write_text(path, json.dumps(obj, **kwargs) + ("\n" if newline else ""))


def check_checkpoint(path: str | Path) -> None:
    """A Lightning checkpoint is a zip archive (torch.save): a torn or corrupt one fails its CRC check here, in
    one line naming the file and what to do, instead of ``PytorchStreamReader failed`` inside ``fit``."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
            problem = f"member {bad} is corrupt" if bad else None
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        problem = f"{type(e).__name__}: {e}"
    if problem:
        raise ValueError(f"{path}: torn or corrupt checkpoint ({problem}); delete it to train from the start, or "
                         "pass resume=false")


_FILE_SHA: dict[tuple, str] = {}  # (path, size, mtime_ns) -> sha256: a multi-GB file is read once per process


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes (read in 16 MiB blocks), kept for the process while its size and mtime hold."""
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILE_SHA:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        _FILE_SHA[key] = h.hexdigest()
    return _FILE_SHA[key]
