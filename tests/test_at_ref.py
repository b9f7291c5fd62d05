"""The decoding core at another commit, read from git beside today's (ldlp/bench/measurements/at_ref.py,
scripts/bench_engine_ref.py): it runs on the same prompts and agrees, and a commit from before the batched
engine is refused in one line. No test skips where history is missing: the first reads this checkout's own
HEAD, the second a tiny core committed to a repository of its own."""

import os
import subprocess
import sys
from types import SimpleNamespace

from conftest import prompts_of

from eagle_backbone.paths import REPO_ROOT


def test_the_engine_at_a_commit_loads_from_git_and_agrees(t32, eagle32):
    """The core at HEAD (any checkout has it, a shallow clone included) runs beside the working tree's on the same
    prompts, and their greedy outputs agree; git failing to read it fails the test, with git's message."""
    from ldlp.bench.measurements.at_ref import compare

    rows = compare(SimpleNamespace(target=t32, drafter=eagle32), {"tiny": prompts_of((5, 9, 3))}, "HEAD",
                   concurrency=(2,), gammas=(0, 2), rounds=2, max_new_tokens=6, bootstrap=50, log=lambda *_: None)
    assert [(r["concurrency"], r["gamma"]) for r in rows] == [(2, 0), (2, 2)]
    assert all(r["outputs_agree"] and r["ratio"] > 0 for r in rows)


# A core from before the batched engine, as small as the check needs: a policy module with StaticPolicy and an engine
# module with the batch-1 loop only (the import of eagle_backbone is what load_core_at renames).
OLD_CORE = {
    "eagle_backbone/__init__.py": "",
    "eagle_backbone/policy.py": "class StaticPolicy:\n    def __init__(self, gamma):\n        self.gamma = gamma\n",
    "eagle_backbone/engine.py": "from eagle_backbone.policy import StaticPolicy\n\n\nclass SpeculativeDecoder:\n"
                                "    policy_class = StaticPolicy\n",
}


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com",
                           "-c", "commit.gpgsign=false", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_an_engine_ref_without_the_batched_engine_is_one_line_and_leaves_no_temporary_folder(tmp_path):
    """bench_engine_ref.py against a commit whose core has no batched engine: one line naming ref=, and the
    temporary copy of that commit's core is gone when the process ends."""
    repo = tmp_path / "old"
    for path, text in OLD_CORE.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "the batch-1 loop")
    ref = _git(repo, "rev-parse", "--short", "HEAD")
    (tmp_path / "tmp").mkdir()
    code = ("from pathlib import Path\nimport ldlp.bench.measurements.at_ref as at_ref\nat_ref.REPO_ROOT = Path(%r)\n"
            "try:\n    at_ref.load_core_at(%r)\nexcept ValueError as e:\n    print(e)\n" % (str(repo), ref))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TMPDIR=str(tmp_path / "tmp")))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"ref={ref}: ") and "engine.BatchedSpeculativeEngine" in out.stdout
    assert "choose" in out.stdout
    assert list((tmp_path / "tmp").iterdir()) == []  # the temporary core copy is removed at exit
