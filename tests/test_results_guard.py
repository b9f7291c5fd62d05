"""Results that cannot lie (issue 45): one run per results folder, no page from a run that decoded nothing, no
NaN page published, settings and learned files checked against what they drive, in one line each."""

import json
import socket
import subprocess
import sys
import textwrap

import pytest

from eagle_backbone.paths import REPO_ROOT


# ---- one run per results folder ----------------------------------------------------------------------------


def _holder(folder):
    """A process holding ``folder``'s run lock until its stdin closes."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from ldlp.pipeline.processes import out_dir_lock
        with out_dir_lock({str(folder)!r}):
            print("locked", flush=True)
            sys.stdin.readline()
    """)], cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_into_one_out_dir_is_refused_in_one_line_naming_the_folder_and_holder(tmp_path):
    from ldlp.pipeline.processes import out_dir_lock

    out = tmp_path / "sweep"
    holder = _holder(out)
    try:
        record = json.loads((out / ".run.lock").read_text())
        assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
        assert record["start"] and record["started"] and record["command"]
        with pytest.raises(ValueError, match=f"{out} is in use by another run \\(pid {holder.pid} on "
                                             f"{socket.gethostname()}, started .*another out_dir="):
            with out_dir_lock(out):
                pass
        # the script says so in one line, before anything is written (render_only: nothing loads)
        run = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "bench_batch.py"), "render_only=true",
                              f"out_dir={out}"], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
        assert run.stderr.strip().splitlines()[-1].startswith(f"error: {out} is in use by another run (pid {holder.pid}")
    finally:
        holder.communicate("\n", timeout=60)
    with out_dir_lock(out):  # free once the holder ended
        pass


def test_a_stale_run_lock_is_taken_over_and_another_hosts_is_named(tmp_path, capsys):
    from ldlp.pipeline.processes import out_dir_lock

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    (tmp_path / ".run.lock").write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "started": "earlier",
                                                    "command": "bench_batch.py"}))
    with out_dir_lock(tmp_path):
        pass
    assert f"held by dead pid {dead} and is taken over" in capsys.readouterr().err
    (tmp_path / ".run.lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "earlier",
                                                    "command": "bench_batch.py"}))
    with pytest.raises(ValueError, match="held by pid 1 on elsewhere.*if that run is gone, remove"):
        with out_dir_lock(tmp_path):
            pass


def test_the_run_lock_is_no_stage_output():
    from ldlp.pipeline.stage import RUN_LOCK, SKIP_IN_OUTPUTS

    assert RUN_LOCK in SKIP_IN_OUTPUTS  # a rerun's lock record does not make the stages downstream run again
