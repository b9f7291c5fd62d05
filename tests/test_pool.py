"""Pooling head-to-head runs: paired ratios per run, pooled over runs, and a two-level interval."""

import json

import numpy as np
import pytest
from conftest import one_line

from ldlp.bench.comparisons.pool import pool, pool_folders
from ldlp.report.headtohead import pooled_markdown, write_pooled
from ldlp.report.pages import publish_pooled


def _run(seconds: dict[str, np.ndarray], lossless: bool = True) -> dict:
    """A head_to_head.json-like result: contenders (label -> (rounds, prompts) seconds) and the AR row."""
    rows, secs = [], []
    for label, s in seconds.items():
        adaptive = not label.startswith("static")
        rows.append({"contender": label, "policy": label.split()[0], "adaptive": adaptive,
                     "setting": {"threshold": 0.3, "path": "/somewhere"} if adaptive else {"gamma": 6},
                     "tokens_per_s": 100.0 / s.sum(), "speedup": 2.0})
        secs.append(s.tolist())
    rows.append({"contender": "AR", "policy": "ar", "adaptive": None, "setting": None, "tokens_per_s": 1.0,
                 "speedup": 1.0})
    secs.append(np.ones_like(next(iter(seconds.values()))).tolist())
    return {"rows": rows, "seconds": secs, "lossless": lossless, "costs": None}


def _runs(gain: float, n_runs: int = 3, prompts: int = 40, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_runs):
        base = rng.uniform(0.5, 1.5, size=(1, prompts))
        out.append(_run({"static γ=6": base, "static γ=7": base * 1.05,
                         "acceptance": base / (gain * rng.uniform(0.98, 1.02, size=base.shape))}))
    return out


def test_pooled_ratio_is_the_ratio_of_total_seconds_and_per_run_ratios_are_paired():
    runs = _runs(1.04)
    p = pool(runs, bootstrap=500)
    assert p["reference"] == "static γ=6"  # the fastest static contender over all runs
    row = next(r for r in p["rows"] if r["contender"].startswith("acceptance"))
    ref = sum(np.sum(r["seconds"][0]) for r in runs)
    mine = sum(np.sum(r["seconds"][2]) for r in runs)
    assert row["pooled"] == pytest.approx(ref / mine)
    for run, ratio in zip(runs, row["per_run"]):
        assert ratio == pytest.approx(np.sum(run["seconds"][0]) / np.sum(run["seconds"][2]))
    assert row["ci95"][0] <= row["pooled"] <= row["ci95"][1]
    assert row["runs_faster"] == 3 and p["adaptive_beats_static"] and p["adaptive_gain"] == pytest.approx(0.04, abs=0.01)
    static7 = next(r for r in p["rows"] if r["contender"] == "static γ=7")
    assert static7["pooled"] == pytest.approx(1 / 1.05) and not static7["adaptive"]


def test_the_interval_widens_when_runs_disagree():
    agree = _runs(1.02, n_runs=4)
    disagree = _runs(1.02, n_runs=4)
    for run, scale in zip(disagree, (0.94, 1.10, 0.95, 1.09)):  # the adaptive contender's luck moves run to run
        run["seconds"][2] = (np.asarray(run["seconds"][2]) * scale).tolist()
    width = lambda p: np.diff(next(r for r in p["rows"] if r["contender"].startswith("acceptance"))["ci95"])[0]  # noqa: E731
    assert width(pool(disagree, bootstrap=500)) > 2 * width(pool(agree, bootstrap=500))


def test_pool_refuses_lossy_runs_and_runs_without_a_common_static_contender():
    runs = _runs(1.0)
    runs[1]["lossless"] = False
    with pytest.raises(ValueError, match="run 2: its greedy outputs differ"):
        pool(runs)
    only_adaptive = [_run({"acceptance": np.ones((1, 3)), "ldlp": np.ones((1, 3))})]
    with pytest.raises(ValueError, match="no static contender"):
        pool(only_adaptive)
    with pytest.raises(ValueError, match="no head-to-head runs"):
        pool([])


def test_contenders_with_other_settings_are_kept_apart_and_pooled_over_their_own_runs():
    a, b = _runs(1.03, n_runs=2)
    b["rows"][2]["setting"]["threshold"] = 0.35  # another acceptance setting in the second run
    p = pool([a, b], bootstrap=100)
    rows = {r["contender"]: r for r in p["rows"]}
    assert list(rows) == ["static γ=6", "static γ=7", "acceptance (threshold=0.3)", "acceptance (threshold=0.35)"]
    first, second = rows["acceptance (threshold=0.3)"], rows["acceptance (threshold=0.35)"]
    assert first["per_run"][1] is None and second["per_run"][0] is None
    assert first["pooled"] == pytest.approx(np.sum(a["seconds"][0]) / np.sum(a["seconds"][2]))
    assert second["pooled"] == pytest.approx(np.sum(b["seconds"][0]) / np.sum(b["seconds"][2]))
    assert "ci95" in first and "ci95" in second and first["runs_faster"] == second["runs_faster"] == 1


def test_an_oracle_in_some_runs_gives_the_headroom_captured():
    runs = _runs(1.04, n_runs=3)
    base = np.asarray(runs[2]["seconds"][0])
    extra = _run({"static γ=6": base, "oracle": base / 1.4})
    runs[2]["rows"].insert(3, {**extra["rows"][1], "policy": "oracle"})
    runs[2]["seconds"].insert(3, extra["seconds"][1])
    p = pool(runs, bootstrap=100)
    oracle = next(r for r in p["rows"] if r["policy"] == "oracle")
    assert oracle["per_run"][:2] == [None, None] and oracle["pooled"] == pytest.approx(1.4)
    assert p["best_adaptive"] == "acceptance (threshold=0.3)"  # the oracle is not an adaptive contender
    assert p["headroom_captured"] == pytest.approx(p["adaptive_gain"] / 0.4)
    without = pool(runs[:2], bootstrap=100)  # no run with the oracle: no headroom to capture
    assert "headroom_captured" not in without and without["adaptive_gain"] > 0


def test_pool_folders_writes_the_table_and_the_readme_block(tmp_path):
    for i, run in enumerate(_runs(1.03), 1):
        (tmp_path / f"run-{i}").mkdir()
        (tmp_path / f"run-{i}" / "head_to_head.json").write_text(json.dumps(run))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- head_to_head_long:start -->\nold\n<!-- head_to_head_long:end -->\nrest\n")
    p = pool_folders([str(tmp_path / "run-*")], tmp_path / "out", bootstrap=100)
    assert write_pooled(tmp_path / "out", p) == tmp_path / "out" / "pooled.md"
    assert p["runs"] == ["run-1", "run-2", "run-3"]
    assert publish_pooled(readme, p, tmp_path / "out", "cmd")
    md = (tmp_path / "out" / "pooled.md").read_text()
    assert md == pooled_markdown(p, [f"../run-{i}/head_to_head.md" for i in (1, 2, 3)])
    text = readme.read_text()
    assert "\nold\n" not in text and text.startswith("intro\n") and text.endswith("rest\n")
    assert "\n".join(md.splitlines()[2:]) in text  # the pooled table itself, between the markers
    saved = json.loads((tmp_path / "out" / "pooled.json").read_text())
    assert saved["reference"] == "static γ=6" and saved["runs"] == p["runs"]
    assert [r["pooled"] for r in saved["rows"]] == pytest.approx([r["pooled"] for r in p["rows"]])
    with pytest.raises(ValueError, match="no head_to_head.json"):
        pool_folders([str(tmp_path / "nothing-*")], tmp_path / "out")
    (tmp_path / "run-2" / "head_to_head.json").write_text("{broken")
    with pytest.raises(ValueError, match="run-2/head_to_head.json: not valid JSON"):
        pool_folders([str(tmp_path / "run-*")], tmp_path / "out")


def test_pooling_refuses_runs_of_different_prompt_sets():
    runs = _runs(1.02, n_runs=2)
    for r, sha in zip(runs, ("a" * 64, "b" * 64)):
        r.update(model="m", dataset="prompts", data_path="/d/q.jsonl", data_sha256=sha, n_prompts=40)
    with pytest.raises(ValueError) as e:
        pool(runs, bootstrap=10)
    assert "data_sha256" in one_line(e) and "run 2 and run 1" in str(e.value)
    runs[1]["data_sha256"] = "a" * 64
    assert pool(runs, bootstrap=10)["reference"]


def test_load_sweep_folders_pool_into_paired_ratios_over_a_reference(tmp_path):
    """scripts/pool_paired_ratios.py's library: one pair per (folder, round, block) where both ran; a folder
    without runs is named in one line."""
    from ldlp.bench.comparisons.pool import pooled_batch_ratios
    from ldlp.report.headtohead import pooled_batch_markdown

    def run(contender, rnd, tokens_per_cpu_s, C=16):
        return {"contender": contender, "concurrency": C, "round": rnd, "block": 0, "new_tokens": 100,
                "cpu_s": 100 / tokens_per_cpu_s, "wall_s": 200 / tokens_per_cpu_s}

    for name, runs in {"a": [run("ar", 0, 10), run("x", 0, 12), run("x", 1, 99)],
                       "b": [run("ar", 0, 20), run("x", 0, 18)]}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "batch_bench_runs.json").write_text(json.dumps({"runs": runs}))
    rows = pooled_batch_ratios([tmp_path / "a", tmp_path / "b"], "ar")
    assert rows == {(16, "x"): [(pytest.approx(1.2), pytest.approx(1.2)), (pytest.approx(0.9), pytest.approx(0.9))]}
    assert "| 16 | x | 1.050 | 1.039 | 1/2 | 1.050 |" in pooled_batch_markdown(rows, "ar")
    with pytest.raises(ValueError, match="no batch_bench_runs.json in"):
        pooled_batch_ratios([tmp_path / "missing"], "ar")
