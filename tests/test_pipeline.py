"""The main command (ldlp.pipeline): stages as records, fingerprints that decide what reruns, outputs under
paths.results / paths.runs only, and the explicit publish step."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import compose_config, table_rows
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import eagle_backbone.paths  # noqa: F401  (registers ${repo:...})
from ldlp.pipeline import Stage, StageRunner, fingerprint, plan, script_keys, store_fingerprint
from ldlp.report.publish import publish

REPO = Path(__file__).resolve().parent.parent


# ---- fingerprints decide what reruns -----------------------------------------------------------------------


@pytest.fixture()
def writer(tmp_path):
    """A stand-in stage script: appends its `text=` override to out_dir/out.txt, so a test can count its runs."""
    script = tmp_path / "write.py"
    script.write_text(textwrap.dedent("""
        import sys
        from pathlib import Path
        args = dict(a.split("=", 1) for a in sys.argv[1:])
        out = Path(args["out_dir"]); out.mkdir(parents=True, exist_ok=True)
        with open(out / "out.txt", "a") as f:
            f.write(args["text"] + "\\n")
    """))
    return script


def _stages(script, tmp_path, up_text="a", reads=()):
    up = Stage("up", "upstream", str(script), [f"out_dir={tmp_path / 'up'}", f"text={up_text}"], tmp_path / "up",
               reads=tuple(reads))
    down = Stage("down", "downstream", str(script), [f"out_dir={tmp_path / 'down'}", "text=d"], tmp_path / "down",
                 after=("up",))
    return [up, down]


def _run_all(tmp_path, stages, force=False) -> list[str]:
    cfg = OmegaConf.create({"force": force, "paths": {"results": str(tmp_path / "results")}})
    runner = StageRunner(cfg, stages)
    for k, s in enumerate(stages, 1):
        runner(s, k, len(stages))
    return runner.ran


def test_unchanged_inputs_skip_and_a_changed_upstream_reruns_downstream(writer, tmp_path):
    assert _run_all(tmp_path, _stages(writer, tmp_path)) == ["up", "down"]
    assert _run_all(tmp_path, _stages(writer, tmp_path)) == []  # same inputs: both skipped
    # the upstream's overrides change: it reruns, its output changes, so the downstream reruns too
    assert _run_all(tmp_path, _stages(writer, tmp_path, up_text="b")) == ["up", "down"]
    assert (tmp_path / "down" / "out.txt").read_text() == "d\nd\n"
    # the upstream's output rewritten by hand (e.g. labels collected again outside the pipeline)
    (tmp_path / "up" / "out.txt").write_text("other labels\n")
    assert _run_all(tmp_path, _stages(writer, tmp_path, up_text="b")) == ["down"]
    assert _run_all(tmp_path, _stages(writer, tmp_path, up_text="b"), force="all") == []  # groups: up, down unforced
    # the same output written again (a deterministic rebuild, a fresh checkout): nothing downstream reruns
    text = (tmp_path / "up" / "out.txt").read_text()
    (tmp_path / "up" / "out.txt").write_text(text)
    os.utime(tmp_path / "up" / "out.txt", ns=(1, 1))
    assert _run_all(tmp_path, _stages(writer, tmp_path, up_text="b")) == []
    # a stage's product deleted by hand: it runs again, whatever its stage.json says
    stages = _stages(writer, tmp_path, up_text="b")
    stages[1].product = "out.txt"
    (tmp_path / "down" / "out.txt").unlink()
    assert _run_all(tmp_path, stages) == ["down"]


def test_changed_model_weights_rerun_the_stages_that_read_them(writer, tmp_path):
    weights = tmp_path / "model"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"one")
    assert _run_all(tmp_path, _stages(writer, tmp_path, reads=[weights])) == ["up", "down"]
    assert _run_all(tmp_path, _stages(writer, tmp_path, reads=[weights])) == []
    (weights / "model.safetensors").write_bytes(b"two")
    assert _run_all(tmp_path, _stages(writer, tmp_path, reads=[weights])) == ["up", "down"]


def test_an_interrupted_stage_runs_again_and_the_fingerprint_is_stored_next_to_its_output(writer, tmp_path):
    stages = _stages(writer, tmp_path)
    digest, inputs = fingerprint(stages[0], {s.name: s for s in stages})
    store_fingerprint(stages[0], digest, inputs, complete=False)  # as a killed run leaves it
    assert _run_all(tmp_path, stages) == ["up", "down"]
    stored = json.loads((tmp_path / "up" / "stage.json").read_text())
    assert stored["complete"] is True and stored["fingerprint"] == digest
    assert stored["inputs"]["args"] == ["out_dir=<up>", "text=a"]  # its own output folder by name, not location
    seconds = json.loads((tmp_path / "results" / "stage_seconds.json").read_text())
    assert set(seconds) == {"up", "down"}
    cpu = json.loads((tmp_path / "results" / "stage_cpu_seconds.json").read_text())  # what it would take idle
    assert set(cpu) == {"up", "down"} and all(v >= 0 for v in cpu.values())


def test_tuning_reruns_on_new_labels_and_everything_writes_outside_the_committed_results(tmp_path):
    """A fresh clone regenerates the labels, so the tuning (and the adaptive sweeps) must run on them,
    never on the committed results/<model>/tuning."""
    cfg = compose_config("pipeline", [f"paths.data_dir={tmp_path / 'data'}", f"paths.outputs={tmp_path / 'outputs'}"])
    stages = {s.name: s for s in plan(cfg)}
    committed = REPO / "results"
    for s in stages.values():
        if s.name != "corpus":  # the corpus goes next to the shipped models (paths.embedded, gitignored)
            assert committed not in s.out.parents and tmp_path in s.out.parents, s
    assert "oracle" in stages["tune"].after and "tune" in stages["sweep:adaptive:1"].after
    assert "tune" not in stages["sweep:static:1"].after  # static rows need no tuning
    assert "tuned_from=" + str(tmp_path / "outputs" / "results" / "embedded" / "tuning" / "tuning.json") in \
        stages["sweep:adaptive:1"].args
    oracle = stages["oracle"]
    oracle.out.mkdir(parents=True)
    (oracle.out / "manifest.json").write_text("{}")
    before, _ = fingerprint(stages["tune"], stages)
    (oracle.out / "manifest.json").write_text('{"new": "labels"}')
    os.utime(oracle.out / "manifest.json", ns=(1, 1))
    after, _ = fingerprint(stages["tune"], stages)
    assert before != after


def test_every_stage_gets_the_configured_threads(tmp_path):
    cfg = compose_config("pipeline", [f"paths.outputs={tmp_path}", "threads=1"])
    assert all("threads=1" in s.args for s in plan(cfg))


# ---- publish ----------------------------------------------------------------------------------------------


def test_publish_copies_the_run_and_writes_the_pages(tmp_path):
    results, published = tmp_path / "outputs" / "results" / "m", tmp_path / "results" / "m"
    (results / "tuning").mkdir(parents=True)
    (results / "results.md").write_text("## Static vs adaptive\n\n| a |\n|---|\n| 1 |\n")
    for f in ("results.csv", "tokens_per_s.png", "summary.json", "tuning/tuning.md", "tuning/tuning.json",
              "load_sweep/batch_bench.md", "load_sweep/batch_bench.png", "load_sweep/batch_bench_ratio.png"):
        (results / f).parent.mkdir(parents=True, exist_ok=True)
        (results / f).write_text(f)
    (results / "run_settings.json").write_text(json.dumps({"model.dtype": "float32", "cpu": "AMD EPYC",
                                                           "cpu_bf16": False, "overrides": []}))
    readme = tmp_path / "README.md"
    readme.write_text("# P\n<!-- results:start -->\nold\n<!-- results:end -->\nrest\n")
    rows = [{"contender": "static γ=6", "tau": 4.0, "tokens_per_s": 200.0},
            {"contender": "ldlp", "tau": 3.9, "tokens_per_s": 204.0, "vs_best_static": 1.02, "ci95": [0.99, 1.05]},
            {"contender": "AR", "tau": 1.0, "tokens_per_s": 100.0}]
    summary = {"headline": {"m": {"head_to_head": {"reference": "static γ=6", "n_prompts": 60, "rounds": 2,
                                                   "rows": rows}}},
               "stage_seconds": {"oracle": 120.0, "sweep:static:1": 60.0}}
    publish(results, published, readme, summary, "m", "python scripts/pipeline.py publish=true")
    assert (published / "tuning" / "tuning.json").read_text() == "tuning/tuning.json"
    # what the page states of its figures' dtype and machine is the run's settings, published beside it
    assert json.loads((published / "run_settings.json").read_text()) == json.loads(
        (results / "run_settings.json").read_text())
    page = (published / "README.md").read_text()  # the page's render check: its tables, plot, time and links
    assert "| 1 |" in page and "(tokens_per_s.png)" in page and "3.0 min" in page
    assert "(load_sweep/batch_bench.md)" in page and "(load_sweep/batch_bench.png)" in page  # the load sweep's
    text = readme.read_text()
    assert "old" not in text and text.endswith("<!-- results:end -->\nrest\n")
    assert table_rows(text) == ["static γ=6", "ldlp"]  # one row per head-to-head contender, the AR row left out
    assert "(results/m/README.md)" in text


# ---- the Python example's helper ----------------------------------------------------------------------


def test_embedded_model_config_resolves_from_any_working_directory(tmp_path):
    code = ("from eagle_backbone.paths import embedded_model_config; import json, pathlib; "
            "c = embedded_model_config(); print(json.dumps({k: str(c[k]) for k in ('target', 'drafter', 'tokenizer')}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    paths = json.loads(out.stdout)
    for p in paths.values():
        assert Path(p).is_absolute() and Path(p).is_relative_to(REPO) and (Path(p) / "config.json").is_file()


# ---- configs and scripts ----------------------------------------------------------------------------------


def test_research_recipes_reach_only_the_scripts_that_use_them():
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        ldlp = compose(config_name="train_ldlp", overrides=["+experiment=vicuna"])
        oracle = compose(config_name="collect_oracle", overrides=["+experiment=vicuna"])
        evaluate = compose(config_name="evaluate", overrides=["+experiment=vicuna"])
    assert "drafter_training" not in ldlp and "store_draft_states" not in ldlp
    assert ldlp.trainer.accelerator == "gpu" and ldlp.ldlp_training.lr == 5.0e-5
    assert oracle.generation.max_new_tokens == 512 and oracle.store_draft_states is False and oracle.data.limit is None
    assert "ldlp_training" not in evaluate and evaluate.data.limit == 20 and evaluate.model.name == "vicuna-7b-v1.3"
    # the artifact folders follow the model's name
    assert OmegaConf.select(ldlp, "ldlp_training.out_dir").endswith("data/ldlp/vicuna-7b-v1.3")


def _script(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=env or dict(os.environ))


def test_help_is_the_scripts_own_and_missing_vicuna_weights_say_what_to_set():
    out = _script("scripts/train_acceptance.py", "--help")
    assert out.returncode == 0 and out.stdout.startswith("scripts/train_acceptance.py: train the acceptance head")
    assert "Examples:" in out.stdout and "== Configuration groups ==" not in out.stdout
    out = _script("scripts/evaluate.py", "model=vicuna", env=dict(os.environ, VICUNA_PATH="/nonexistent/vicuna"))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == ("error: model.target: no model at /nonexistent/vicuna (no config.json): set "
                                  "VICUNA_PATH to the model folder or pass model.target=/path/to/it (nothing is "
                                  "downloaded)")


def test_comments_in_a_config_change_nothing_but_a_value_does(tmp_path, monkeypatch):
    import ldlp.pipeline.stage as pipeline

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "a.yaml").write_text("x: 1  # one\n")
    monkeypatch.setattr(pipeline, "CONF_DIR", conf)
    stage = Stage("s", "s", "s.py", [], tmp_path / "out", configs=("a.yaml",))
    first, first_inputs = fingerprint(stage, {})
    (conf / "a.yaml").write_text("# a comment\nx: 1  # still one\n")
    assert fingerprint(stage, {})[0] == first
    (conf / "a.yaml").write_text("x: 2\n")
    second, inputs = fingerprint(stage, {})
    assert second != first and pipeline.changed_inputs(first_inputs, inputs) == ["configs/a.yaml"]


# ---- model.dtype=auto ------------------------------------------------------------------------------------


def test_dtype_auto_is_bf16_only_where_the_hardware_multiplies_in_bf16(monkeypatch):
    import torch

    from eagle_backbone.runtime import resolve_dtype, resolve_model_dtype

    assert resolve_dtype("auto", "cpu", flags={"avx2", "avx512f"}) == "float32"  # e.g. AMD Zen 3: bf16 emulated
    assert resolve_dtype("auto", "cpu", flags={"avx512f", "avx512_bf16"}) == "bfloat16"
    assert resolve_dtype("auto", "cpu", flags={"amx_bf16"}) == "bfloat16"
    assert resolve_dtype("auto", "cpu", flags=set()) == "float32"  # no /proc/cpuinfo flags (e.g. macOS)
    assert resolve_dtype("float32", "cpu", flags={"avx512_bf16"}) == "float32"  # an explicit dtype wins
    assert resolve_dtype("bfloat16", "cpu", flags=set()) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda:0") == "float32"
    with pytest.raises(ValueError, match="model.dtype must be one of"):
        resolve_dtype("bf16")
    # the shipped model configs default to auto; a script's start() records the dtype it resolved to
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for name in ("embedded", "embedded_draft_lm"):
            assert compose(config_name="evaluate", overrides=[f"model={name}"]).model.dtype == "auto"
        cfg = compose(config_name="evaluate", overrides=[])
    assert resolve_model_dtype(cfg.model) == cfg.model.dtype == resolve_dtype("auto", "cpu")


# ---- the main command's overrides reach every stage ------------------------------------------------------


def _plan_lines(tmp_path, *overrides):
    """`python scripts/pipeline.py dry_run=true ...` on empty folders: its output and the stages' command lines."""
    out = _script("scripts/pipeline.py", "dry_run=true", f"paths.data_dir={tmp_path / 'data'}",
                  f"paths.outputs={tmp_path / 'outputs'}", *overrides)
    assert out.returncode == 0, out.stderr[-2000:]
    commands = {}
    lines = out.stdout.splitlines()
    for line, nxt in zip(lines, lines[1:] + [""]):
        if line.lstrip().startswith("[") and nxt.lstrip().startswith("$ "):
            commands[line.split("] ", 1)[1].split(":", 1)[0] if "sweep" not in line
                     else line.split("] ", 1)[1].rsplit(": ", 1)[0]] = nxt.strip()[2:]
    return out.stdout, commands


def test_dry_run_prints_the_plan_and_model_dtype_reaches_every_stage(tmp_path):
    text, commands = _plan_lines(tmp_path, "model.dtype=float32", "generation.max_new_tokens=16")
    assert text.startswith("plan (") and "model.dtype=float32" in text.splitlines()[0] and "expected" in text
    assert len(commands) >= 13 and "corpus" in commands and "bench_batch" in commands  # one sweep round
    assert "run (first run)" in text
    # the cost table and the head to head's contenders are stages of their own, before the stages that read them
    assert list(commands).index("cost") < list(commands).index("tune") and "missing_only=true" in commands["cost"]
    assert list(commands)[-2:] == ["contenders", "head_to_head"]
    assert "contenders_from=" + str(tmp_path / "outputs" / "pipeline" / "embedded" / "contenders" / "contenders.json") \
        in commands["head_to_head"].split()
    for name, command in commands.items():
        args = command.split()
        if name == "corpus":  # its config has no model or generation
            assert not any(a.startswith(("model", "generation")) for a in args), command
            continue
        assert args.count("model.dtype=float32") == 1, (name, command)
        gens = [a for a in args if a.startswith("generation.max_new_tokens=")]
        if "generation" in script_keys(Path(args[1]).name):  # replaces the stage's own 64 or 32
            assert gens == ["generation.max_new_tokens=16"], (name, command)
        else:  # train_ldlp, train_acceptance, tune_policies compose no generation
            assert gens == [], (name, command)
    assert not (tmp_path / "data").exists() and not (tmp_path / "outputs").exists()  # a dry run writes nothing


def test_overrides_enter_fingerprints_and_paths_reach_the_data_configs(tmp_path):
    base = [f"paths.data_dir={tmp_path / 'data'}", f"paths.outputs={tmp_path / 'outputs'}"]
    f32, b16 = base + ["model.dtype=float32"], base + ["model.dtype=bfloat16"]
    extra = ["model.drafter=/elsewhere/drafter", "data.limit=3", "threads=2"]
    cfg = compose_config("pipeline", f32 + extra)
    stages = {s.name: s for s in plan(cfg, "embedded", f32 + extra)}
    for s in stages.values():
        assert f"paths.data_dir={tmp_path / 'data'}" in s.args and s.args.count("threads=2") == 1, s.args
        if s.name != "corpus":  # data.*: every stage that reads prompts (not the contenders stage: it reads results)
            assert s.resolved == {"model.dtype": "float32"}, s
            assert ("data.limit=3" in s.args) == (s.name != "contenders"), s
    # the peer sweeps run the draft LM: the main pair's drafter override is not theirs
    assert "model.drafter=/elsewhere/drafter" in stages["sweep:static:1"].args
    assert not any(a.startswith("model.drafter") for a in stages["sweep:peer:1"].args)
    assert "data.limit=6" not in stages["sweep:static:1"].args  # the main command's data.limit replaced it
    assert "/elsewhere/drafter" in stages["oracle"].reads
    # the dtype is in every fingerprint but the corpus's
    other = {s.name: s for s in plan(compose_config("pipeline", b16), "embedded", b16)}
    same = {s.name: s for s in plan(compose_config("pipeline", f32), "embedded", f32)}
    for name, s in same.items():
        a, b = fingerprint(s, same)[0], fingerprint(other[name], other)[0]
        assert (a == b) == (name == "corpus"), name
    h2h = stages["head_to_head"]
    assert "model.dtype=float32" in h2h.args and h2h.resolved == {"model.dtype": "float32"}
    # paths.data_dir is where the stages' data configs read the corpus, not only where it is built
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for script in ("collect_oracle", "evaluate", "tune_policies", "bench_batch", "compare"):
            c = compose(config_name=script, overrides=base)
            assert Path(c.data.path).is_relative_to(tmp_path / "data" / "embedded" / "corpus"), script


# ---- faults: what the sweep makes itself, retrained heads, stuck resumes, signals, two main commands ---------


def test_a_cost_table_the_cost_stage_makes_is_not_a_reason_to_rerun_but_a_new_one_is(tmp_path):
    """The cost stage profiles a missing cost table into paths.cost (and keeps one that is there); the load sweep
    reads it: the next run must not redo the sweep for the table made for it, while a table profiled again by hand
    reruns it."""
    profile = tmp_path / "profile.py"
    profile.write_text(textwrap.dedent("""
        import sys
        from pathlib import Path
        cost = Path(dict(a.split("=", 1) for a in sys.argv[1:])["out_dir"])
        if not (cost / "table.json").exists():
            cost.mkdir(parents=True, exist_ok=True); (cost / "table.json").write_text("profiled")
    """))
    script = tmp_path / "bench.py"
    script.write_text(textwrap.dedent("""
        import sys
        from pathlib import Path
        args = dict(a.split("=", 1) for a in sys.argv[1:])
        assert (Path(args["cost"]) / "table.json").exists()
        out = Path(args["out_dir"]); out.mkdir(parents=True, exist_ok=True)
        with open(out / "runs.txt", "a") as f:
            f.write("run\\n")
    """))
    cost = tmp_path / "cost"

    def stages():
        return [Stage("cost", "cost", str(profile), [f"out_dir={cost}"], cost),
                Stage("bench_batch", "bench", str(script), [f"out_dir={tmp_path / 'out'}", f"cost={cost}"],
                      tmp_path / "out", after=("cost",))]

    assert _run_all(tmp_path, stages()) == ["cost", "bench_batch"]
    assert _run_all(tmp_path, stages()) == []  # the table made for it is its input, unchanged
    (cost / "table.json").write_text("profiled again")
    assert _run_all(tmp_path, stages()) == ["bench_batch"]


def test_retrained_draft_acceptance_heads_rerun_the_load_sweep_that_uses_them(tmp_path):
    over = [f"paths.data_dir={tmp_path / 'data'}", f"paths.outputs={tmp_path / 'outputs'}",
            'bench_batch.contenders=["policy=load_aware_head","policy=static policy.gamma=2"]']
    cfg = compose_config("pipeline", over)
    heads = Path(cfg.paths.draft_acceptance)
    (heads / "t0.0").mkdir(parents=True)
    (heads / "t0.0" / "model.safetensors").write_bytes(b"head")
    stages = {s.name: s for s in plan(cfg, "embedded", over)}
    bench = stages["bench_batch"]
    assert str(heads) in bench.reads and "cost" in bench.after and stages["cost"].out == Path(cfg.paths.cost)
    before = fingerprint(bench, stages)[0]
    (heads / "t0.0" / "model.safetensors").write_bytes(b"retrained head")
    assert fingerprint(bench, stages)[0] != before
    assert str(heads) not in stages["sweep:static:1"].reads  # a sweep that does not use them ignores them


@pytest.fixture()
def collector(tmp_path):
    """A stand-in label collector with the real one's folder contract: manifest.json names the settings; another
    collection there is refused unless overwrite=true (start over) or overwrite=changed (start over if other)."""
    script = tmp_path / "collect.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        from pathlib import Path
        args = dict(a.split("=", 1) for a in sys.argv[1:])
        out = Path(args["out_dir"]); out.mkdir(parents=True, exist_ok=True)
        manifest = out / "manifest.json"
        mode = args.get("overwrite", "false")
        old = json.loads(manifest.read_text()) if manifest.exists() else None
        if old is not None and (mode == "true" or (mode == "changed" and old["text"] != args["text"])):
            manifest.unlink(); old = None
        if old is not None and old["text"] != args["text"]:
            sys.exit("holds a collection made with other settings; pass overwrite=true")
        manifest.write_text(json.dumps({"text": args["text"]}))
        (out / "report.md").write_text(args["text"])
    """))
    return script


def _oracle(script, tmp_path, text):
    return [Stage("oracle", "collect", str(script), [f"out_dir={tmp_path / 'oracle'}", f"text={text}"],
                  tmp_path / "oracle", product="report.md", resumes=True)]


def test_a_resume_interrupted_between_the_decision_and_the_reset_does_not_get_stuck(collector, tmp_path, monkeypatch):
    assert _run_all(tmp_path, _oracle(collector, tmp_path, "a")) == ["oracle"]
    # new settings; the main command is killed before the collector starts (so before it reset the folder)
    monkeypatch.setattr(StageRunner, "run_command", lambda self, stage: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        _run_all(tmp_path, _oracle(collector, tmp_path, "b"))
    monkeypatch.undo()
    assert _run_all(tmp_path, _oracle(collector, tmp_path, "b")) == ["oracle"]  # the rerun the advice names works
    assert json.loads((tmp_path / "oracle" / "manifest.json").read_text()) == {"text": "b"}
    # the state an earlier main command left: the new fingerprint stored, the old collection still there
    stages = _oracle(collector, tmp_path, "c")
    digest, inputs = fingerprint(stages[0], {})
    store_fingerprint(stages[0], digest, inputs, complete=False)
    assert _run_all(tmp_path, stages) == ["oracle"]  # overwrite=changed: the collection disagrees, it starts over
    assert (tmp_path / "oracle" / "report.md").read_text() == "c"


def _stage_until_stopped(tmp_path, pids: str):
    """A stage script that starts a child, writes ``pids`` (an f-string over ``os`` and ``child``) to
    <out>/pids, then runs until stopped."""
    script = tmp_path / "stage.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys, time, os
        from pathlib import Path
        out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
        child = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(0.05)"])
        (out / "pids").write_text(f"PIDS")
        while True:
            time.sleep(0.05)
    """).replace("PIDS", pids))
    return script


def test_sigterm_reaches_the_running_stage_and_its_children(tmp_path):
    """SIGTERM to the main command stops the stage's whole process group (here a stage that started a child),
    and the main command exits with 128 + 15; nothing keeps writing."""
    stage_script = _stage_until_stopped(tmp_path, "{child.pid}")
    main = tmp_path / "main.py"
    main.write_text(textwrap.dedent(f"""
        from pathlib import Path
        from omegaconf import OmegaConf
        from ldlp.pipeline import Stage, StageRunner
        out = Path({str(tmp_path / 'out')!r})
        stage = Stage("s", "a stage that runs until stopped", {str(stage_script)!r}, [str(out)], out)
        StageRunner(OmegaConf.create({{"force": False, "paths": {{"results": str(out.parent / "results")}}}}),
                    [stage])(stage, 1, 1)
    """))
    proc = subprocess.Popen([sys.executable, str(main)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    pids = tmp_path / "out" / "pids"
    for _ in range(600):  # until the stage has started its child
        if pids.is_file() and pids.read_text():
            break
        time.sleep(0.1)
    child = int(pids.read_text())
    proc.send_signal(15)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "SIGTERM: stopped stage 's'" in err and "rerun the same command" in err
    for _ in range(600):  # the child is reaped by init once killed: wait until it is gone
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the stage's child survived the main command's SIGTERM")
    stored = json.loads((tmp_path / "out" / "stage.json").read_text())
    assert stored["complete"] is False  # the next run continues it


def test_two_main_commands_cannot_hold_the_same_folders(tmp_path):
    from ldlp.pipeline import FolderLock, lock_folders

    cfg = compose_config("pipeline", [f"paths.data_dir={tmp_path / 'data'}", f"paths.outputs={tmp_path / 'outputs'}"])
    folders = lock_folders(cfg, plan(cfg))
    assert folders == [tmp_path / "data", tmp_path / "outputs"]
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from ldlp.pipeline import FolderLock
        with FolderLock([{str(tmp_path / 'outputs')!r}]):
            print("locked", flush=True)
            sys.stdin.readline()
    """)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=f"{tmp_path / 'outputs'} is in use by another main command \\(pid "
                                             f"{holder.pid}.*paths.outputs="):
            with FolderLock(folders):
                pass
        assert not any(f.name == ".pipeline.lock" and f.stat().st_size == 0 for f in (tmp_path / "data").iterdir())
    finally:
        holder.communicate("\n", timeout=60)
    with FolderLock(folders):  # free again once the other one ended
        pass


# ---- sharded collection through the launcher (pip install -e ".[slurm]") -----------------------------------


# hydra-submitit-launcher's plumbing end to end (three processes start torch): marked slow to keep CI's
# clean-clone run within its 10 minutes; `pytest -m slow` runs it (tests/test_oracle.py checks in one process
# that two shards give the labels of one collector)
@pytest.mark.slow
def test_sharded_collection_through_the_submitit_launcher_gives_the_labels_of_one_collector(tmp_path):
    """conf/launcher/local.yaml: the collectors as processes of hydra-submitit-launcher's local executor, the code
    path of conf/launcher/slurm.yaml without a cluster. Two shards give the labels one collector gives."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from conftest import compose_config, pair_overrides, save_tiny_pair

    from ldlp.labels.collect import collect_oracle
    from ldlp.labels.store import load_oracle_rows

    save_tiny_pair(tmp_path / "models", 4096)
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"What does function f{i} do?"}]}
             for i in range(4)]
    (tmp_path / "train.json").write_text(json.dumps(convs))
    (tmp_path / "validation.json").write_text(json.dumps(convs[:1]))
    common = pair_overrides(tmp_path / "models", dtype="float32") + [
        f"data.path={tmp_path / 'train.json'}", f"data.validation_path={tmp_path / 'validation.json'}",
        "data.limit=null", "data.validation_limit=null", "generation.max_new_tokens=6", "k_max=3", "shard_size=2",
        "progress=false"]
    out = _script("scripts/collect_oracle.py", "-m", "+launcher=local", "shard_id=range(0,2)", "num_shards=2",
                  *common, f"out_dir={tmp_path / 'sharded'}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                  timeout=1200)  # three processes start torch: minutes on a loaded 2-core machine
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Submitit 'local' sweep" in out.stdout + out.stderr
    workers = {p.name.split(".")[0] for p in (tmp_path / "sharded" / "train").glob("*.json")}
    assert workers == {"000-of-002", "001-of-002"}
    collect_oracle(compose_config("collect_oracle", common + [f"out_dir={tmp_path / 'one'}"]))

    def labels(folder):
        rows = load_oracle_rows(folder).to_pandas()
        return rows.sort_values(["seq_id", "index"])[["seq_id", "split", "index", "label"]].values.tolist()

    assert labels(tmp_path / "sharded") == labels(tmp_path / "one") and len(labels(tmp_path / "one")) > 0
    # the SLURM config composes with the same plugin (submitting needs a cluster)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="collect_oracle", overrides=["+launcher=slurm"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher") and cfg.hydra.launcher.array_parallelism == 16


def test_a_collection_made_with_other_settings_starts_over_with_overwrite_changed(tmp_path):
    """What the main command passes to the collector: overwrite=changed continues a matching collection and starts
    a disagreeing one over, where overwrite=false refuses it."""
    from conftest import compose_config, pair_overrides, save_tiny_pair

    from ldlp.labels.collect import collect_oracle

    save_tiny_pair(tmp_path / "models", 4096)
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Explain f{i}."}]} for i in range(2)]
    (tmp_path / "train.json").write_text(json.dumps(convs))
    common = pair_overrides(tmp_path / "models", dtype="float32") + [
        f"data.path={tmp_path / 'train.json'}", "data.validation_path=null", "data.limit=null",
        "generation.max_new_tokens=4", "shard_size=2", "progress=false", f"out_dir={tmp_path / 'o'}"]
    collect_oracle(compose_config("collect_oracle", common + ["k_max=2"]))
    with pytest.raises(ValueError, match="other settings"):
        collect_oracle(compose_config("collect_oracle", common + ["k_max=3"]))
    report = collect_oracle(compose_config("collect_oracle", common + ["k_max=3", "overwrite=changed"]))
    assert report["k_max"] == 3 and json.loads((tmp_path / "o" / "manifest.json").read_text())["identity"]["k_max"] == 3
    with pytest.raises(ValueError, match="overwrite must be false"):
        collect_oracle(compose_config("collect_oracle", common + ["overwrite=sometimes"]))


def test_collectors_side_by_side_check_the_folder_first_and_report_last(tmp_path):
    """oracle.parallel=N: shard 0 checks (or resets) the folder alone, then N collectors run side by side without
    overwrite=, then shard 0 writes the report over every part."""
    script = tmp_path / "shards.py"
    script.write_text(textwrap.dedent("""
        import sys
        from pathlib import Path
        args = dict(a.split("=", 1) for a in sys.argv[1:])
        out = Path(args["out_dir"]); out.mkdir(parents=True, exist_ok=True)
        with open(out / "calls.txt", "a") as f:
            f.write(f"{args['shard_id']}/{args['num_shards']} parts={args.get('max_parts_this_run', 'all')} "
                    f"overwrite={args.get('overwrite', '-')}\\n")
        if args.get("max_parts_this_run") != "0":
            (out / f"part-{args['shard_id']}").write_text("labels")
        else:
            (out / "report.md").write_text(" ".join(sorted(p.name for p in out.glob("part-*"))))
    """))
    stage = Stage("oracle", "collect", str(script), [f"out_dir={tmp_path / 'o'}", "num_shards=3"], tmp_path / "o",
                  product="report.md", resumes=True, parallel=3)
    assert _run_all(tmp_path, [stage]) == ["oracle"]
    calls = (tmp_path / "o" / "calls.txt").read_text().splitlines()
    assert calls[0] == "0/3 parts=0 overwrite=changed" and calls[-1] == "0/3 parts=0 overwrite=-"
    assert sorted(calls[1:4]) == ["0/3 parts=all overwrite=-", "1/3 parts=all overwrite=-", "2/3 parts=all overwrite=-"]
    assert (tmp_path / "o" / "report.md").read_text() == "part-0 part-1 part-2"
    cfg = compose_config("pipeline", [f"paths.outputs={tmp_path}", "oracle.parallel=2"])
    oracle = next(s for s in plan(cfg) if s.name == "oracle")
    assert oracle.parallel == 2 and "num_shards=2" in oracle.args  # in the fingerprint: part files are per collector


# ---- processes meet: collectors side by side, a SIGKILLed main command, stale locks --------------------------


def _gone(pid: int, wait_s: float = 60.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie (killed, not yet reaped by init) is gone too
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_sigkill_of_the_main_command_leaves_no_stage_running(tmp_path):
    """kill -9 of the main command runs no handler: the stage (parent-death signal) and the child it started (the
    watchdog stops the stage's process group) still stop; the next main command takes the stale lock over."""
    stage_script = _stage_until_stopped(tmp_path, "{os.getpid()} {child.pid}")
    main = tmp_path / "main.py"
    main.write_text(textwrap.dedent(f"""
        from pathlib import Path
        from omegaconf import OmegaConf
        from ldlp.pipeline import FolderLock, Stage, StageRunner
        out = Path({str(tmp_path / 'out')!r})
        stage = Stage("s", "a stage that runs until stopped", {str(stage_script)!r}, [str(out)], out)
        with FolderLock([out.parent / "locked"]) as lock:
            runner = StageRunner(OmegaConf.create({{"force": False, "paths": {{"results": str(out.parent / "r")}}}}),
                                 [stage])
            runner.lock = lock
            runner(stage, 1, 1)
    """))
    proc = subprocess.Popen([sys.executable, str(main)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    pids = tmp_path / "out" / "pids"
    for _ in range(600):
        if pids.is_file() and pids.read_text():
            break
        time.sleep(0.1)
    stage_pid, child = (int(x) for x in pids.read_text().split())
    for _ in range(600):  # the main command records the stage in its lock once it started it
        lock = json.loads((tmp_path / "locked" / ".pipeline.lock").read_text() or "{}")
        if lock.get("stages"):
            break
        time.sleep(0.1)
    assert lock["pid"] == proc.pid and [s["pid"] for s in lock["stages"]] == [stage_pid]
    proc.kill()
    proc.communicate(timeout=60)
    assert _gone(stage_pid) and _gone(child), "a stage process survived the main command's SIGKILL"
    # the lock names a dead holder and no live stage: taken over, in one line
    from ldlp.pipeline import FolderLock

    probe = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from ldlp.pipeline import FolderLock
        with FolderLock([{str(tmp_path / 'locked')!r}]):
            pass
    """)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stderr.strip() == (f"the lock at {tmp_path / 'locked' / '.pipeline.lock'} was held by dead pid "
                                    f"{proc.pid} and is taken over")
    with FolderLock([tmp_path / "locked"]):  # released cleanly: no message, no refusal
        pass


def test_a_lock_whose_holder_or_stage_is_alive_refuses(tmp_path, capsys):
    """A lock file naming a live process (here: a stage a killed main command left running) refuses in one line;
    one naming only dead processes is taken over."""
    from ldlp.pipeline import LOCK, FolderLock, start_time

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        dead = int(dead.stdout)
        (tmp_path / LOCK).write_text(json.dumps({"pid": dead, "started": "earlier", "command": "pipeline.py",
                                                 "stages": [{"pid": sleeper.pid,
                                                             "start": start_time(sleeper.pid)}]}))
        with pytest.raises(ValueError, match=f"held by pid {dead} and its stage process {sleeper.pid} is still "
                                             "running.*kill"):
            with FolderLock([tmp_path]):
                pass
    finally:
        sleeper.kill()
        sleeper.wait()
    with FolderLock([tmp_path]):
        pass
    assert f"held by dead pid {dead} and is taken over" in capsys.readouterr().err


def test_collectors_side_by_side_keep_one_manifest_and_a_log_each(tmp_path):
    """Two collectors into one folder, many times: each writes the shared manifest through the atomic writer and
    clears killed writes' leftovers as the real collector does, and logs into the folder it is given. Every run
    finishes, the manifest is whole, and every collector's log is there."""
    script = tmp_path / "collector.py"
    script.write_text(textwrap.dedent("""
        import sys
        from pathlib import Path
        from eagle_backbone.io import atomic_write_json, remove_leftovers
        args = dict(a.split("=", 1) for a in sys.argv[1:])
        out = Path(args["out_dir"])
        logs = Path(args["hydra.run.dir"]); logs.mkdir(parents=True, exist_ok=True)
        (logs / "collect_oracle.log").write_text(f"collector {args['shard_id']}\\n")
        for i in range(40):
            remove_leftovers(out, "*")
            atomic_write_json(out / "manifest.json", {"num_shards": int(args["num_shards"]), "pad": "x" * 20000})
        if args.get("max_parts_this_run") != "0":
            (out / f"part-{args['shard_id']}").write_text("labels")
        else:
            (out / "report.md").write_text("done")
    """))
    for k in range(8):
        out = tmp_path / f"o{k}"
        stage = Stage("oracle", "collect", str(script), [f"out_dir={out}", "num_shards=2"], out,
                      product="report.md", resumes=True, parallel=2)
        assert _run_all(tmp_path, [stage]) == ["oracle"]
        assert json.loads((out / "manifest.json").read_text())["num_shards"] == 2
        logs = sorted(p.name.rsplit("-", 1)[1] for p in (out / "logs").iterdir())
        assert logs == ["check", "report", "shard0", "shard1"]
        assert not list(out.glob("*.tmp"))


def test_a_failed_stage_ends_the_main_command_in_one_line(writer, tmp_path):
    from ldlp.pipeline import StageFailed

    bad = Stage("up", "upstream", str(writer), [f"out_dir={tmp_path / 'up'}"], tmp_path / "up")  # no text=: fails
    with pytest.raises(StageFailed, match="stage 'up' failed \\(exit 1\\); its own error line above names the "
                                          "setting or input to fix"):
        _run_all(tmp_path, [bad])
    assert issubclass(StageFailed, ValueError)  # scripts/_setup.py prints it as one error: line


def test_where_outputs_go_is_not_an_input(tmp_path):
    """paths.outputs and paths.published say where results are written: changing them (and switching back) reruns
    no stage; an override that changes what a stage computes still does."""
    base = [f"paths.data_dir={tmp_path / 'data'}"]

    def digests(extra):
        overrides = base + extra
        stages = {s.name: s for s in plan(compose_config("pipeline", overrides), "embedded", overrides)}
        return {n: fingerprint(s, stages)[0] for n, s in stages.items()}

    a = digests([f"paths.outputs={tmp_path / 'out1'}"])
    b = digests([f"paths.outputs={tmp_path / 'out2'}", f"paths.published={tmp_path / 'pub'}"])
    assert a == b
    c = digests([f"paths.outputs={tmp_path / 'out1'}", "generation.max_new_tokens=16"])
    assert c["oracle"] != a["oracle"] and c["corpus"] == a["corpus"]


@pytest.mark.parametrize("override, key", [
    ("sweep.rounds=0", "sweep.rounds must be an integer >= 1, got 0"),
    ("oracle.parallel=0", "oracle.parallel must be an integer >= 1, got 0"),
    ("oracle.parallel=1.5", "oracle.parallel must be an integer >= 1, got 1.5"),
    ("head_to_head.rounds=0", "head_to_head.rounds must be an integer >= 1"),
    ("bench_batch.rounds=0", "bench_batch.rounds must be an integer >= 1"),
    ("bench_batch.concurrency=[]", "bench_batch.concurrency is empty"),
    ("bench_batch.concurrency=[0]", "bench_batch.concurrency holds 0"),
    ("bench_batch.temperatures=[-1.0]", "bench_batch.temperatures holds -1.0"),
    ('bench_batch.contenders=["policy=nonesuch"]', "bench_batch.contenders holds 'policy=nonesuch'"),
    ("bench_batch.contenders=[static]", "bench_batch.contenders holds 'static'"),
    ("sweep.adaptive=[ldlp,typo]", "sweep.adaptive holds 'typo'"),
    ("sweep.static_gammas=[0]", "sweep.static_gammas holds 0"),
])
def test_the_plan_refuses_a_bad_setting_in_one_line(tmp_path, override, key):
    from eagle_backbone.errors import ConfigError

    cfg = compose_config("pipeline", [f"paths.outputs={tmp_path}", override])
    with pytest.raises(ConfigError, match=key.replace("[", "\\[").replace("(", "\\(")):
        plan(cfg)


def test_a_dry_run_with_zero_rounds_ends_in_one_error_line(tmp_path):
    out = _script("scripts/pipeline.py", "dry_run=true", "sweep.rounds=0", f"paths.outputs={tmp_path}", timeout=300)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        "error: pipeline: sweep.rounds must be an integer >= 1, got 0 (conf/pipeline.yaml)"], out.stderr[-2000:]


def test_the_corpus_stage_logs_into_its_own_logs_folder_not_where_it_is_run(tmp_path):
    """The main command's first stage (scripts/build_corpus.py) left build_corpus.log in the folder it ran in (the
    repository root): its log goes to the corpus folder's logs/, which no fingerprint reads."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "build_corpus.py"), f"out_dir={tmp_path / 'corpus'}",
                          "max_modules=2"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not list(tmp_path.glob("*.log")) and (tmp_path / "corpus" / "logs" / "build_corpus.log").is_file()
    assert (tmp_path / "corpus" / "test.json").is_file()


def test_collectors_started_by_hand_side_by_side_log_into_their_own_folders():
    for script in ("collect_oracle", "collect_acceptance"):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            dirs = {compose(config_name=script, overrides=[f"shard_id={i}", "num_shards=2"],
                            return_hydra_config=True).hydra.run.dir for i in range(2)}
        assert len(dirs) == 2 and all(d.endswith(("-shard0", "-shard1")) for d in dirs), (script, dirs)
