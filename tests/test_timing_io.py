"""The shared helpers: the interleaved runner and its orders, median timing, atomic writes."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle_backbone.io import atomic_path, atomic_write_json, remove_leftovers
from eagle_backbone.io import tmp_path as tmp_sibling
from eagle_backbone.timing import interleaved, median_seconds, turn_order


def test_orders():
    assert [turn_order(3, "fixed", r, k, 4) for r, k in ((0, 0), (1, 3))] == [[0, 1, 2], [0, 1, 2]]
    assert [turn_order(2, "alternate", r, k, 5) for r, k in ((0, 0), (0, 1), (1, 0), (1, 1))] == \
        [[0, 1], [1, 0], [1, 0], [0, 1]]
    # rotate: the shift grows by one per (round, item), so every runner takes every place
    firsts = [turn_order(3, "rotate", r, k, 2)[0] for r in range(3) for k in range(2)]
    assert firsts == [0, 1, 2, 0, 1, 2]
    assert turn_order(3, "rotate", 0, 1, 2) == [1, 2, 0]
    # an offset: a caller running one round (or cell) at a time goes on where it stopped
    assert turn_order(3, "rotate", 0, 1, 2, offset=4) == [2, 0, 1] and turn_order(2, "alternate", 0, 0, 1, 1) == [1, 0]
    with pytest.raises(ValueError, match="order"):
        turn_order(2, "random", 0, 0, 1)


def test_interleaved_runs_every_runner_on_every_item_in_turn():
    calls = []

    def call(runner, item, k, r):
        calls.append((r, k, runner))
        return f"{runner}:{item}:{r}"

    done = []
    res = interleaved(["a", "b"], ["x", "y", "z"], 2, call, order="alternate", after_item=lambda: done.append(1))
    assert res[0][1][2] == "a:z:1" and res[1][0][0] == "b:x:0"
    assert len(done) == 6 and len(calls) == 12
    # round by round, item by item, the pair's order alternating
    assert calls[:6] == [(0, 0, "a"), (0, 0, "b"), (0, 1, "b"), (0, 1, "a"), (0, 2, "a"), (0, 2, "b")]
    with pytest.raises(ValueError, match="rounds"):
        interleaved(["a"], ["x"], 0, call)


def test_median_seconds_warms_up_then_times():
    n = []
    ticks = iter(range(100))
    assert median_seconds(lambda: n.append(1), reps=3, warmup=2, clock=lambda: float(next(ticks))) == 1.0
    assert len(n) == 5


def test_atomic_path_replaces_or_leaves_the_old_file(tmp_path):
    out = tmp_path / "sub" / "plot.png"
    with atomic_path(out, keep_suffix=True) as tmp:
        assert re.fullmatch(rf"plot\.{os.getpid()}-[0-9a-f]{{8}}\.tmp\.png", tmp.name) and not out.exists()
        tmp.write_text("new")
    assert out.read_text() == "new" and not tmp.exists()
    with pytest.raises(RuntimeError):
        with atomic_path(out) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert out.read_text() == "new" and not tmp.exists()  # the old file, and no leftover


def test_atomic_path_replaces_a_folder(tmp_path):
    out = tmp_path / "cache"
    (out / "old").mkdir(parents=True)
    with atomic_path(out) as tmp:
        (tmp / "examples").mkdir(parents=True)
        (tmp / "examples" / "data.arrow").write_bytes(b"x")
    assert sorted(p.name for p in out.iterdir()) == ["examples"]


def test_json_and_leftovers(tmp_path):
    atomic_write_json(tmp_path / "a.json", {"b": 1, "a": 2}, newline=False, sort_keys=True)
    assert (tmp_path / "a.json").read_text() == json.dumps({"a": 2, "b": 1}, indent=2)
    part = tmp_path / "train" / "part.rows.arrow"
    part.parent.mkdir()
    part.write_bytes(b"whole")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = part.with_name(f"{part.name}.{int(dead.stdout)}-0123abcd.tmp")  # a killed write's leftover
    leftover.write_bytes(b"junk")
    live = tmp_sibling(part)  # this (live) process's write in progress: another writer must not delete it
    live.write_bytes(b"in progress")
    assert remove_leftovers(tmp_path, "*/*") == [leftover]
    assert sorted(p.name for p in part.parent.iterdir()) == sorted(["part.rows.arrow", live.name])
    assert tmp_sibling(part) != tmp_sibling(part)  # a fresh name per call


def test_two_processes_writing_one_file_never_collide(tmp_path):
    """Side-by-side collectors write the same manifest.json and clear killed writes' leftovers when they start: with
    a temporary name per process and call, neither ever loses its temporary file to the other."""
    target = tmp_path / "manifest.json"
    code = textwrap.dedent(f"""
        import sys
        from eagle_backbone.io import atomic_write_json, remove_leftovers
        for i in range(300):
            atomic_write_json({str(target)!r}, {{"writer": sys.argv[1], "i": i, "pad": "x" * 4000}})
            remove_leftovers({str(tmp_path)!r})
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(w)], env=env, stderr=subprocess.PIPE, text=True)
             for w in range(2)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    assert json.loads(target.read_text())["i"] == 299
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temporary file left behind
