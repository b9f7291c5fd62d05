"""Results that cannot lie (issue 45): one run per results folder, no page from a run that decoded nothing, no
NaN page published, settings and learned files checked against what they drive, in one line each."""

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

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


# ---- no page from nothing ----------------------------------------------------------------------------------


def _script(script, *args, tmp_path):
    return subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / script), *args,
                           f"model.target={tmp_path / 'absent'}", f"model.drafter={tmp_path / 'absent'}",
                           f"model.tokenizer={tmp_path / 'absent'}"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)


def test_a_head_to_head_of_no_tokens_is_one_line_and_no_page(tmp_path):
    out = _script("compare.py", "generation.max_new_tokens=0", f"out_dir={tmp_path / 'h2h'}", tmp_path=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == "error: generation.max_new_tokens must be an integer >= 1, got 0"
    assert not list((tmp_path / "h2h").glob("*.md")) and not list((tmp_path / "h2h").glob("*.json"))


def test_the_drafters_bench_of_no_tokens_is_refused_before_anything_loads(tmp_path):
    from omegaconf import OmegaConf

    from ldlp.bench.peers.drafters import bench_drafters

    cfg = OmegaConf.create({"drafters": {"a": {}, "b": {}}, "gammas": [1], "tau_gamma": 1,
                            "generation": {"max_new_tokens": 0}, "data": {"path": str(tmp_path / "absent")}})
    with pytest.raises(ValueError, match="^generation.max_new_tokens must be an integer >= 1, got 0$"):
        bench_drafters(cfg)


def test_the_main_command_refuses_a_run_of_no_tokens_and_a_bad_contender_in_its_plan(tmp_path):
    from eagle_backbone.errors import ConfigError
    from ldlp.pipeline import plan
    from conftest import compose_config

    for override, why in [
        ("generation.max_new_tokens=0", "generation.max_new_tokens must be an integer >= 1, got 0"),
        ("head_to_head.overrides=['generation.max_new_tokens=0']",
         "head_to_head.overrides holds 'generation.max_new_tokens=0': generation.max_new_tokens must be"),
        ('bench_batch.contenders=["policy=static policy.gamma=-1"]',
         "bench_batch.contenders holds 'policy=static policy.gamma=-1': static policy: gamma must be an integer "
         ">= 0, got -1"),
        # a policy key in a stage's overrides replaced the stage's own choice (a static sweep of γ=3 alone: Hydra
        # keeps an override's last value) or failed minutes later (-1)
        ("sweep.overrides=['policy.gamma=3']", "sweep.overrides holds 'policy.gamma=3': the stages choose their "
                                               "policies"),
        ("head_to_head.overrides=['policy.gamma=-1']", "head_to_head.overrides holds 'policy.gamma=-1': the stages"),
        ("bench_batch.overrides=['policy=static']", "bench_batch.overrides holds 'policy=static': the stages"),
    ]:
        with pytest.raises(ConfigError) as e:
            plan(compose_config("pipeline", [f"paths.outputs={tmp_path}", override]))
        assert why in str(e.value) and "\n" not in str(e.value), override


def test_publishing_a_page_with_a_nan_cell_is_refused_naming_the_file(tmp_path):
    from eagle_backbone.errors import ConfigError
    from ldlp.report.publish import check_publishable, nan_cell
    from conftest import a_run

    run = a_run(tmp_path / "run")
    assert check_publishable(run, "m")
    (run / "results.md").write_text("| policy | tokens/s | speedup |\n|---|---:|---:|\n| static γ=2 | nan | nanx |\n")
    with pytest.raises(ConfigError, match=f"^{run / 'results.md'}: a NaN cell \\(line 3: "):
        check_publishable(run, "m")
    (run / "results.md").write_text("| policy | note |\n|---|---|\n| static | nanoseconds |\n")
    assert nan_cell(run / "results.md") is None
    (run / "results.csv").write_text("model,policy,tokens_per_s\nm,static,NaN\n")
    with pytest.raises(ConfigError, match="results.csv: a NaN cell"):
        check_publishable(run, "m")


# ---- settings do what their label says ---------------------------------------------------------------------


def test_settings_that_would_run_as_something_else_are_refused_in_one_line(tmp_path):
    from eagle_backbone.data.conversations import build_prompts
    from ldlp.policies.pricing import StepPricing
    from ldlp.policies.threshold import HeuristicPolicy

    with pytest.raises(ValueError, match="^load_aware policy: online_costs must be true or false, got 'maybe'$"):
        StepPricing("load_aware", str(tmp_path), "tiny", online="maybe")
    with pytest.raises(ValueError, match="^heuristic policy: initial_gamma=10 is above max_gamma=2"):
        HeuristicPolicy(initial_gamma=10, max_gamma=2)
    assert HeuristicPolicy(initial_gamma=2, max_gamma=2).initial_gamma == 2
    with pytest.raises(ValueError, match="^data.min_prompt_tokens must be an integer >= 0, got -5$"):
        build_prompts(None, [], None, min_prompt_tokens=-5)


def test_the_dry_run_builds_a_contender_as_the_load_sweep_would(tmp_path):
    from eagle_backbone.errors import ConfigError
    from ldlp.pipeline import plan
    from conftest import compose_config

    cfg = compose_config("pipeline", [f"paths.outputs={tmp_path}",
                             'bench_batch.contenders=["policy=load_aware policy.online_costs=maybe"]'])
    with pytest.raises(ConfigError, match="online_costs must be true or false, got 'maybe'"):
        plan(cfg)


# ---- a step-cost model file: its values checked ------------------------------------------------------------


def test_a_cost_model_file_with_bad_values_is_refused_naming_the_file_and_key(tmp_path):
    from eagle_backbone.step_cost import FEATURES, OnlineCostModel
    from ldlp.policies.pricing import StepPricing

    good = OnlineCostModel().to_dict() | {"theta": [1.0] * len(FEATURES)}
    path = tmp_path / "step_costs.json"
    bad = {
        "a list": ([good], "a step cost model is a JSON object"),
        "a NaN cost": (good | {"theta": [float("nan")] + [1.0] * (len(FEATURES) - 1)},
                       "theta\\[0\\] \\(fixed\\) must be a finite number >= 0, got nan"),
        "a negative cost": (good | {"theta": [1.0, -2.0] + [1.0] * (len(FEATURES) - 2)},
                            "theta\\[1\\] \\(per_row\\) must be a finite number >= 0, got -2.0"),
        "a negative stretch": (good | {"stretch": -1.0}, "stretch must be a finite number > 0, got -1.0"),
        "a string cost": (good | {"theta": ["1"] * len(FEATURES)}, "theta\\[0\\] \\(fixed\\)"),
    }
    for case, (raw, why) in bad.items():
        path.write_text(json.dumps(raw))
        with pytest.raises(ValueError, match=f"^load_aware policy: cost_model={path}: {why}") as e:
            StepPricing("load_aware", str(tmp_path), "tiny", cost_model=str(path))
        assert "\n" not in str(e.value), case
    path.write_text(json.dumps(good))
    StepPricing("load_aware", str(tmp_path), "tiny", cost_model=str(path))
    assert OnlineCostModel.load(path).stretch == pytest.approx(1.0)


def test_the_costs_measured_in_hindsight_record_the_setup_where_no_contender_read_a_cost_table(t32, eagle32, tmp_path):
    """A load sweep of static contenders reads no cost table; its step_costs.json still records the setup it was
    measured on (a file without a key is taken as it is, on any setup: a bfloat16 fit priced a float32 run)."""
    import torch

    from eagle_backbone.kinds.eagle import EagleCandidateGenerator
    from eagle_backbone.policy import StaticPolicy
    from eagle_backbone.step_cost import OnlineCostModel, key_mismatch
    from ldlp.bench.comparisons.load_sweep import Contender, sweep
    from ldlp.bench.harness.loaders import engine_cost_key

    torch.set_num_threads(1)
    cand = EagleCandidateGenerator(eagle32, t32)
    key = engine_cost_key("tiny", t32, cand, "eager")
    assert (key["model"], key["dtype"], key["drafter_kind"], key["attn"]) == ("tiny", "float32", "eagle", "eager")
    assert key["drafter_sha256"] and key["threads"] == 1 and engine_cost_key("tiny", t32, None) is None
    static = [Contender("ar", "ar", 0, None), Contender("static γ=2", "static", 2, lambda: StaticPolicy(2))]
    result = sweep(t32, cand, [[5, 9, 11, 7], [4, 8, 6]], static, [1], 6, rounds=1, log=lambda *_: None,
                   bootstrap=10, cost_key=key)
    path = tmp_path / "step_costs.json"
    path.write_text(json.dumps(result["hindsight"]))
    fitted = OnlineCostModel.load(path)
    assert fitted.seen > 0 and fitted.key == key
    assert key_mismatch(fitted.key, {**key, "dtype": "bfloat16"}) == ["dtype: 'float32' vs 'bfloat16'"]


# ---- a tuned policy file: made for one setup; accept_mismatch ----------------------------------------------


@pytest.fixture
def accepting():
    """``accept_mismatches`` as a script's ``start`` sets it; back to refusing (and nothing recorded) after."""
    from eagle_backbone.errors import accept_mismatches

    yield accept_mismatches
    accept_mismatches(False)


def _tuning(path, made_for=None):
    results = [{"policy": "ddd", "params": {"threshold": -4.0}, "tokens_per_s": 12.0},
               {"policy": "static", "params": {"gamma": 3}, "tokens_per_s": 11.0}]
    path.write_text(json.dumps({"results": results} | ({"made_for": made_for} if made_for else {})))
    return str(path)


def test_a_tuned_file_for_another_setup_is_refused_naming_the_file_and_both_sides(tmp_path, accepting):
    from omegaconf import OmegaConf

    from eagle_backbone.errors import Mismatch, accepted_mismatches
    from ldlp.bench.harness.loaders import apply_tuned, run_setup

    run = run_setup(OmegaConf.create({"name": "embedded", "dtype": "float32", "device": "cpu",
                                      "drafter_kind": "eagle"}))
    assert run == {"model": "embedded", "dtype": "float32", "drafter_kind": "eagle"}
    base = OmegaConf.create({"_target_": "ldlp.policies.threshold.DDDPolicy", "threshold": -6.0})
    same = {**run, "drafter_sha256": "ab" * 32, "cost_key": {"model": "embedded"}}
    for field, theirs in (("model", "vicuna"), ("dtype", "bfloat16"), ("drafter_kind", "eagle3")):
        path = _tuning(tmp_path / f"{field}.json", {**same, field: theirs})
        with pytest.raises(Mismatch) as e:
            apply_tuned(base, path, "ddd", run)
        assert str(e.value) == (f"tuned_from={path} was tuned for another setup than this run's (the file's vs this "
                                f"run's: {field}: {theirs!r} vs {run[field]!r}); tune for this one (python "
                                "scripts/tune_policies.py); accept_mismatch=true runs it anyway, recorded in the "
                                "results")
    # the drafter's weights, where the run knows them (its pair loaded)
    path = _tuning(tmp_path / "weights.json", same)
    with pytest.raises(Mismatch, match=f"^tuned_from={path} .*drafter_sha256: '{'ab' * 6}' vs '{'cd' * 6}'\)"):
        apply_tuned(base, path, "ddd", {**run, "drafter_sha256": "cd" * 32})
    assert apply_tuned(base, path, "ddd", {**run, "drafter_sha256": "ab" * 32})[1] == {"threshold": -4.0}
    # a file not applied (a static γ is never tuned) is not refused; nor one without a run to check against
    other = _tuning(tmp_path / "other.json", {**same, "model": "vicuna"})
    static = OmegaConf.create({"_target_": "eagle_backbone.policy.StaticPolicy", "gamma": 5})
    assert apply_tuned(static, other, "static", run) == (static, None)
    assert apply_tuned(base, other, "ddd")[1] == {"threshold": -4.0}
    # a file of before the record is taken as it is
    old = _tuning(tmp_path / "old.json")
    cfg, tuned = apply_tuned(base, old, "ddd", run)
    assert tuned == {"threshold": -4.0} and cfg.threshold == -4.0
    # accept_mismatch=true: taken, with the message recorded once for the run's results
    accepting(True)
    assert apply_tuned(base, other, "ddd", run)[1] == {"threshold": -4.0}
    apply_tuned(base, other, "ddd", run)
    assert accepted_mismatches() == [f"tuned_from={other} was tuned for another setup than this run's (the file's "
                                     "vs this run's: model: 'vicuna' vs 'embedded'); tune for this one (python "
                                     "scripts/tune_policies.py)"]
    accepting(False)  # the next run starts with nothing accepted
    assert accepted_mismatches() == []
    with pytest.raises(ValueError, match="^accept_mismatch must be true or false, got 'maybe'$"):
        accepting("maybe")


def test_the_contenders_stage_refuses_a_tuning_for_another_setup(tmp_path):
    """The main command's contenders stage chooses from the tuning as compare.py applies it: the same check."""
    from omegaconf import OmegaConf

    from eagle_backbone.errors import ConfigError, Mismatch
    from ldlp.pipeline.contenders import tuned_best

    model = OmegaConf.create({"name": "embedded", "dtype": "float32", "device": "cpu", "drafter_kind": "eagle"})
    other = Path(_tuning(tmp_path / "other.json", {"model": "vicuna"}))
    with pytest.raises(Mismatch, match=f"^tuned_from={other} was tuned for another setup .*model: 'vicuna' vs "
                                       "'embedded'"):
        tuned_best(other, model)
    same = Path(_tuning(tmp_path / "same.json", {"model": "embedded", "dtype": "float32"}))
    assert tuned_best(same, model)["ddd"]["params"] == {"threshold": -4.0}
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=f"^tuned_from={bad}: not a tuning.json of scripts/tune_policies.py"):
        tuned_best(bad, model)


def test_the_head_to_head_refuses_a_tuned_file_for_another_model_before_anything_loads(tmp_path):
    path = _tuning(tmp_path / "tuning.json", {"model": "vicuna"})
    out = _script("compare.py", f"tuned_from={path}", 'contenders=["policy=static policy.gamma=2","policy=ddd"]',
                  f"out_dir={tmp_path / 'h2h'}", tmp_path=tmp_path)  # the models are absent: nothing loads before
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: tuned_from={path} was tuned for another setup than this run's (the file's vs this run's: model: "
        "'vicuna' vs 'embedded'); tune for this one (python scripts/tune_policies.py); accept_mismatch=true runs it "
        "anyway, recorded in the results")


def test_a_tuned_file_records_the_drafter_weights_it_was_tuned_with():
    from types import SimpleNamespace

    import torch
    from omegaconf import OmegaConf

    from eagle_backbone.cost import weights_sha256
    from ldlp.bench.harness.loaders import run_setup

    drafter = torch.nn.Linear(3, 2)
    pair = SimpleNamespace(candidates=SimpleNamespace(drafter=drafter))
    model = OmegaConf.create({"name": "tiny", "dtype": "float32", "drafter_kind": "eagle"})
    assert run_setup(model, pair)["drafter_sha256"] == weights_sha256(drafter) is not None
    assert run_setup(model, SimpleNamespace(candidates=None))["drafter_sha256"] is None


def test_an_accepted_mismatch_is_stated_below_the_pages_title():
    from ldlp.report.notes import with_mismatch_lines

    md = "### Head to head (tiny)\n\nsome text\n\n| table |\n"
    assert with_mismatch_lines(md, {"accepted_mismatches": []}) == md
    result = {"accepted_mismatches": ["tuned_from=t.json was tuned for another setup"]}
    page = with_mismatch_lines(md, result)
    assert page == ("### Head to head (tiny)\n\n**Accepted mismatch** (accept_mismatch=true): tuned_from=t.json was "
                    "tuned for another setup\n\nsome text\n\n| table |\n")
    assert with_mismatch_lines(page, result) == page  # a page that states it already


def test_skipped_records_are_stated_on_the_load_sweep_and_drafters_pages(tmp_path):
    """data.on_error=skip: the malformed records skipped are on the load sweep's page (and its JSON) and the drafters
    page beside the prompt count, as on the results and head-to-head pages, not only in the log."""
    from ldlp.report.drafters import drafters_markdown
    from ldlp.bench.comparisons.load_aggregate import read_result
    from ldlp.bench.comparisons.load_sweep import prompts_meta
    from ldlp.bench.harness.loaders import PromptSet, prompt_set_info
    from ldlp.report.load_sweep import write

    prompts = PromptSet((f"c{i}", [1, 2, 3]) for i in range(4))
    prompts.info = prompt_set_info({"path": str(tmp_path / "absent.json")}, n_skipped=3)
    meta = prompts_meta(prompts, [1], 1)
    assert meta["n_skipped_records"] == 3
    write({"rows": [], "runs": [], "skipped": []}, tmp_path / "out", meta)
    assert read_result(tmp_path / "out")[1]["n_skipped_records"] == 3
    page = (tmp_path / "out" / "batch_bench.md").read_text()
    assert "**3 malformed records of the prompt file skipped** (data.on_error=skip" in page
    prompts.info = prompt_set_info({"path": str(tmp_path / "absent.json")})
    assert "n_skipped_records" not in prompts_meta(prompts, [1], 1)  # none skipped: the header as before
    info = {"n_dropped": 1, "dropped_reason": "longer than max_prompt_tokens=64", "n_skipped_records": 2}
    result = {"reference": "eagle1", "drafters": {"eagle1": {"drafter_kind": "eagle"}}, "model": "m", "dtype": "float32",
              "max_new_tokens": 8, "tau_gamma": 6, "summary": [], "skipped": {},
              "sets": {"sharegpt": {"dataset": "sharegpt", "n_prompts": 40, "prompt_set": info, "by_temperature": {}}}}
    page = drafters_markdown(result)  # each prompt set states its own, in the list of sets and in its section
    assert page.count("40 prompts of sharegpt (1 dropped: longer than max_prompt_tokens=64") == 2
    assert page.count("**2 malformed records of the prompt file skipped**") == 2


# ---- the remaining raw errors ------------------------------------------------------------------------------


def test_files_and_keys_that_raised_raw_errors_are_named_in_one_line(tmp_path):
    from eagle_backbone.data.conversations import DataError, load_conversations
    from ldlp.bench.peers.vllm_schedule import load_schedule
    from ldlp.policies.trees import StaticTreePolicy

    latin = tmp_path / "prompts.txt"
    latin.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(DataError, match=f"^{latin}: not UTF-8 \\(byte 3"):
        load_conversations(latin)
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text("num_speculative_tokens: four\nnum_speculative_tokens_per_batch_size: [[1, 4, 3]]\n")
    with pytest.raises(ValueError, match=f"^schedule {schedule}: num_speculative_tokens must be an integer >= 1, "
                                         "got 'four'$"):
        load_schedule(schedule)
    with pytest.raises(ValueError, match="^static_tree policy: paths is empty; give a shape"):
        StaticTreePolicy(paths=[])


def test_an_eagle3_head_for_another_verifier_is_refused_before_anything_loads(tmp_path, accepting):
    """speculators' config names the target the head was trained for (verifier.name_or_path, what vLLM serves it
    on): another model is refused in one line naming both, from the config files alone; the same model elsewhere,
    or a hub id named like the target's folder, is taken; accept_mismatch=true takes the rest, recorded."""
    from eagle_backbone.errors import Mismatch, accepted_mismatches
    from eagle_backbone.loading import check_drafter_fits

    shipped = json.loads((REPO_ROOT / "data" / "embedded" / "eagle3" / "config.json").read_text())
    target = tmp_path / "Llama-Tiny"
    target.mkdir()
    (target / "config.json").write_text((REPO_ROOT / "data" / "embedded" / "target" / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(json.loads((target / "config.json").read_text())
                                                  | {"num_hidden_layers": 3}))
    head = tmp_path / "head"
    head.mkdir()

    def verifier(name):
        cfg = json.loads(json.dumps(shipped))
        if name is None:
            del cfg["speculators_config"]["verifier"]
        else:
            cfg["speculators_config"]["verifier"]["name_or_path"] = name
        (head / "config.json").write_text(json.dumps(cfg))

    # taken: the target itself, the same model in another folder (the shipped name, relative to the repository),
    # a hub id named like the target's folder, no record
    for name in (str(target), "data/embedded/target", "org/llama-tiny", None):
        verifier(name)
        check_drafter_fits("eagle3", head, target)
    for name, why in ((str(other), f"the folder {other}, whose config.json differs: num_hidden_layers 3 vs 8"),
                      ("org/another-model", "no folder here, and not named 'Llama-Tiny'")):
        verifier(name)
        with pytest.raises(Mismatch) as e:
            check_drafter_fits("eagle3", head, target)
        assert str(e.value).startswith(f"{head / 'config.json'}: speculators_config.verifier.name_or_path is "
                                       f"{name!r} ({why}), but this run's target is {target}; ") and "\n" not in str(e.value)
    accepting(True)
    check_drafter_fits("eagle3", head, target)
    assert accepted_mismatches() and "org/another-model" in accepted_mismatches()[0]


# ---- learned files: LDLP checkpoints, the shipped predictor, acceptance heads, vLLM schedules -------------------


def _learned(folder, made_for=None, meta=None):
    """A learned folder's config.json as the trainers write it (only ``meta`` is read before anything loads)."""
    folder.mkdir(parents=True)
    record = {"made_for": made_for} if made_for else {}
    (folder / "config.json").write_text(json.dumps({"kind": "acceptance_head", "meta": {**(meta or {}), **record}}))
    return folder


def _drafter(folder, payload=b"weights"):
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(payload)
    (folder / "config.json").write_text("{}")  # not a weight file: not in the digest
    return folder


def test_a_learned_file_made_for_another_setup_is_refused_before_anything_loads(tmp_path, accepting):
    """An LDLP checkpoint, acceptance head or folder of draft-acceptance heads records what it was made for; the
    policy's folder is checked against the run's model (its name, drafter kind and drafter weight files) before
    any weights load: another is refused in one line naming the file and both sides, the dtype only recorded."""
    from omegaconf import OmegaConf

    from eagle_backbone.errors import Mismatch, accepted_mismatches
    from eagle_backbone.made_for import run_made_for
    from ldlp.bench.harness.loaders import check_learned_files

    model = OmegaConf.create({"name": "embedded", "dtype": "float32", "device": "cpu", "drafter_kind": "eagle",
                              "drafter": str(_drafter(tmp_path / "drafter"))})
    run = run_made_for(model)
    assert run["drafter_weights"] and run["dtype"] == "float32" and "cpu_caps" not in run
    assert run_made_for(OmegaConf.merge(model, {"drafter": str(_drafter(tmp_path / "d2"))}))["drafter_weights"] == \
        run["drafter_weights"]  # the same weight bytes elsewhere: the same drafter
    same = _learned(tmp_path / "same", {**run, "dtype": "bfloat16"})  # labels of another dtype: taken
    old = _learned(tmp_path / "old")  # no record: taken as it is
    for folder in (same, old, tmp_path / "absent"):
        check_learned_files(OmegaConf.create({"path": str(folder)}), model)
    other = _learned(tmp_path / "other", {**run, "drafter_weights": "ab" * 32})
    with pytest.raises(Mismatch) as e:
        check_learned_files(OmegaConf.create({"path": str(other)}), model)
    assert str(e.value).startswith(f"policy.path={other} was made for another setup than this run's (the file's vs "
                                   f"this run's: drafter_weights: {'ab' * 6!r} vs {run['drafter_weights'][:12]!r}); ")
    assert "\n" not in str(e.value)
    # a folder of draft-acceptance heads (t<T>/): each head is checked
    heads = tmp_path / "heads"
    _learned(heads / "t0", run)
    _learned(heads / "t1", {**run, "model": "vicuna", "drafter_kind": "eagle3"})
    with pytest.raises(Mismatch, match=f"^policy.estimator={heads / 't1'} was made for .*model: 'vicuna' vs "
                                       "'embedded'; drafter_kind: 'eagle3' vs 'eagle'\\)"):
        check_learned_files(OmegaConf.create({"estimator": str(heads)}), model)
    check_learned_files(OmegaConf.create({"estimator": "confidence"}), model)
    accepting(True)
    check_learned_files(OmegaConf.create({"path": str(other)}), model)
    assert len(accepted_mismatches()) == 1 and accepted_mismatches()[0].startswith(f"policy.path={other} ")


def test_the_shipped_predictor_is_checked_by_its_labels_identity(tmp_path):
    """The shipped predictor records its labels' identity (dtype, drafter kind, drafter files): taken on the pair
    it was trained for, refused on the EAGLE-3 head's, through a script, before any weights load."""
    from omegaconf import OmegaConf

    from eagle_backbone.made_for import made_for_of
    from ldlp.bench.harness.loaders import check_learned_files

    shipped = REPO_ROOT / "data" / "embedded" / "predictor"
    made_for = made_for_of(json.loads((shipped / "config.json").read_text())["meta"])
    assert made_for["drafter_kind"] == "eagle" and made_for["drafter_weights"]
    eagle1 = OmegaConf.create({"name": "embedded", "dtype": "float32", "device": "cpu", "drafter_kind": "eagle",
                               "drafter": str(REPO_ROOT / "data" / "embedded" / "drafter")})
    check_learned_files(OmegaConf.create({"path": str(shipped)}), eagle1)
    out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "evaluate.py"), "model=embedded_eagle3",
                          "policy=learned", "data.limit=1", "generation.max_new_tokens=2",
                          f"hydra.run.dir={tmp_path / 'eval'}"], capture_output=True, text=True, timeout=300,
                         cwd=REPO_ROOT)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: policy.path={shipped} was made for another setup than this run's (the file's vs "
                           "this run's: drafter_kind: 'eagle' vs 'eagle3'; drafter_weights: "), last
    assert not (tmp_path / "eval" / "results.json").exists()


def test_a_vllm_schedule_says_what_it_was_tuned_for_and_is_checked(tmp_path, accepting):
    """The tuner's schedule.json records the model, vLLM's dtype, the drafter and the CPU's capabilities (a
    schedule prices steps); a contender running it on another setup is refused naming the file and both sides.
    schedule.yaml stays a config vLLM reads as it is; a file without the record is taken."""
    import yaml
    from omegaconf import OmegaConf

    from eagle_backbone.errors import Mismatch
    from eagle_backbone.made_for import run_made_for
    from ldlp.bench.peers.vllm_schedule import check_schedule_made_for, load_schedule
    from ldlp.bench.peers.vllm_tune import write_schedule

    model = OmegaConf.create({"name": "embedded", "dtype": "float32", "device": "cpu", "drafter_kind": "eagle",
                              "drafter": str(_drafter(tmp_path / "drafter"))})
    tuned = {**run_made_for(model, costs=True), "dtype": "float32"}
    write_schedule({"schedule": [[1, 4, 3], [5, 32, 1]], "k_max": 3, "made_for": tuned}, tmp_path / "s")
    assert "made_for" not in yaml.safe_load((tmp_path / "s" / "schedule.yaml").read_text())
    sch = load_schedule(tmp_path / "s" / "schedule.json", 3)
    assert sch["made_for"] == json.loads(json.dumps(tuned)) and sch["ranges"] == [(1, 4, 3), (5, 32, 1)]
    check_schedule_made_for(sch, model, "float32")
    with pytest.raises(Mismatch, match=f"^spec.schedule={tmp_path / 's' / 'schedule.json'} was made for another "
                                       "setup .*dtype: 'float32' vs 'bfloat16'\\); tune one for this setup"):
        check_schedule_made_for(sch, model, "bfloat16")
    other_cpu = {**sch, "made_for": {**tuned, "cpu_caps": {**tuned["cpu_caps"], "avx512": "other"}}}
    with pytest.raises(Mismatch, match="cpu_caps: "):
        check_schedule_made_for(other_cpu, model, "float32")
    check_schedule_made_for(load_schedule(tmp_path / "s" / "schedule.yaml", 3), model, "bfloat16")  # no record


def test_a_serving_runs_learned_schedules_carry_its_setup(tmp_path):
    from ldlp.report.serving import write_learned_schedules

    learners = {"load_aware_step": {"schedule": {"1": 4, "2": 3, "4": 2}}}
    made_for = {"model": "embedded", "dtype": "bfloat16", "drafter_kind": "eagle", "cpu_caps": {"bf16": True}}
    (tmp_path / "serving.json").write_text(json.dumps({"meta": {"made_for": made_for}, "learners": learners}))
    (written,) = write_learned_schedules(tmp_path, made_for)
    assert written.name == "learned_schedule_load_aware_step.json"
    record = json.loads(written.read_text())
    assert record["made_for"] == made_for and record["speculative_config"]["num_speculative_tokens"] == 4


def test_a_learned_file_with_a_nan_weight_is_refused_naming_the_file_and_key(tmp_path):
    import torch

    from ldlp.models.acceptance import AcceptanceHead, AcceptanceHeadConfig
    from ldlp.models.predictor import LDLP, LDLPConfig

    for model, folder in ((LDLP(LDLPConfig(input_dim=8, hidden_dim=4, k_max=3)), tmp_path / "ldlp"),
                          (AcceptanceHead(AcceptanceHeadConfig(hidden_size=4, k_max=3)), tmp_path / "head")):
        with torch.no_grad():
            next(p for n, p in model.named_parameters() if n.endswith("weight")).fill_(float("nan"))
        model.save_pretrained(folder)
        with pytest.raises(ValueError, match=f"^{folder / 'model.safetensors'}: keys \\[.*weight.*\\] hold a NaN or an "
                                             "infinity; train it again$"):
            type(model).from_pretrained(folder)


def test_no_script_leaves_a_log_file_in_the_folder_it_runs_in():
    """A script whose Hydra run directory is the working directory (``hydra.run.dir: .``) logs to the console:
    Hydra's default file handler would leave ``<script>.log`` at the repository root (as build_corpus.log was)."""
    import yaml

    for path in sorted((REPO_ROOT / "conf").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        if str(((raw.get("hydra") or {}).get("run") or {}).get("dir")) != ".":
            continue
        defaults = [d for d in raw.get("defaults") or [] if isinstance(d, dict)]
        assert {"override hydra/job_logging": "stdout"} in defaults, path.name


# ---- memory that stays flat ----------------------------------------------------------------------------------


def test_the_memory_summary_compares_rounds_peak_with_peak_and_floor_with_floor():
    """A run's resident memory swings with what it runs: growth compares the last complete round with the first,
    peak with peak and floor with floor, never a C = 32 moment with a between-runs one. (That a finished engine is
    freed at once: tests/test_batched.py.)"""
    from ldlp.bench.harness.memory import RssSampler
    from ldlp.report.memory import memory_line

    gb = 2 ** 30
    rss = RssSampler(every_s=10)
    rss.samples = [(0, 2.7 * gb), (100, 1.1 * gb), (150, 2.8 * gb), (200, 1.1 * gb), (250, 2.9 * gb),
                   (300, 1.2 * gb), (320, 1.0 * gb)]
    rss.marks = [(90, "round 1"), (190, "round 2"), (310, "after the rounds")]
    out = rss.summary()
    assert [g["label"] for g in out["segments"]] == ["warm-up", "round 1", "round 2", "after the rounds"]
    assert out["compared"] == ["round 1", "round 2"]
    assert out["growth"] == pytest.approx(2.9 / 2.8 - 1) and out["floor_growth"] == pytest.approx(0.0)
    assert "round 2 against round 1: peak +3.6%, floor +0.0%" in memory_line(out)
    one = RssSampler(every_s=10)
    one.samples, one.marks = [(0, gb), (50, 2 * gb)], [(10, "round 1")]
    assert "growth" not in one.summary()  # one round, still running: nothing to compare


def test_a_bad_memory_sampling_interval_is_one_line_before_anything_loads(tmp_path):
    out = _script("bench_batch.py", "rss_every_s=0", f"out_dir={tmp_path / 'lb'}", tmp_path=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == ("error: rss_every_s must be a number of seconds > 0, got 0 "
                                                   "(conf/bench_batch.yaml)")


@pytest.mark.parametrize("script", ["train_step_ldlp.py", "study_predictors.py"])
def test_the_predictor_scripts_refuse_an_incomplete_collection_before_any_model_loads(script, tmp_path):
    """A collection still being labelled (its manifest plans more sequences than its complete parts hold) is refused
    in one line naming what is missing and how to complete it, before the (here absent) models load;
    allow_partial=true reads it anyway, recorded in what the trainer exports."""
    from oracle_helpers import partial_collection

    oracle = partial_collection(tmp_path, planned=13, num_shards=1)
    out = _script(script, f"oracle_dir=[{oracle}]", f"out_dir={tmp_path / 'out'}", tmp_path=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {oracle}: incomplete oracle collection: 5 of 13 sequences are missing"), last
    assert f"python scripts/collect_oracle.py out_dir={oracle}" in last and "allow_partial=true" in last
    assert not (tmp_path / "out" / "config.json").exists()
    out = _script(script, f"oracle_dir=[{oracle}]", "allow_partial=true", f"out_dir={tmp_path / 'out'}",
                  tmp_path=tmp_path)  # past the check: now the absent models are what is refused
    assert out.returncode == 1 and "incomplete" not in out.stderr.strip().splitlines()[-1]
    assert str(tmp_path / "absent") in out.stderr.strip().splitlines()[-1]
