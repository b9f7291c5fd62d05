"""scripts/evaluate.py and the summary on tiny random models saved to temporary folders."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config, pair_overrides
from hydra import compose, initialize_config_dir

from ldlp.bench.comparisons.evaluate import RESULT_KEYS, evaluate

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "question.jsonl"
    lines = [{"question_id": i, "category": "test", "turns": [q]} for i, q in
             enumerate(["Explain the function `os.path.join`.", "What does `json.dumps` return?",
                        "Write a function that reverses a list."])]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def overrides(models: Path, prompts: Path, draft_lm: bool = False) -> list[str]:
    return pair_overrides(models, draft_lm=draft_lm) + ["data=mt_bench", f"data.path={prompts}", "data.limit=2",
            "generation.max_new_tokens=12", "evaluation.repeats=2", "evaluation.progress=false", "threads=1"]


def evaluate_config(models: Path, prompts: Path, extra: list[str], draft_lm: bool = False):
    """scripts/evaluate.py's config on the first two prompts of ``prompts`` (:func:`overrides`), ``extra`` last."""
    return compose_config("evaluate", overrides(models, prompts, draft_lm) + extra)


def test_evaluate_writes_every_key_and_is_lossless(tiny_models, prompt_file, tmp_path):
    cfg = evaluate_config(tiny_models, prompt_file, ["policy=heuristic"])
    result = evaluate(cfg, policy_name="heuristic", out_dir=tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(RESULT_KEYS) <= set(saved)
    assert saved["lossless"] is True and saved["gamma"] is None and saved["n_prompts"] == 2
    assert saved["dataset"] == "mt_bench" and saved["temperature"] == 0.0
    assert saved["wasted_tokens"] == saved["drafted_tokens"] - (saved["new_tokens"] - saved["target_forwards"])
    assert len(saved["tokens_per_s_rounds"]) == 2 and saved["ar_impl"] in ("ours", "transformers")
    # counters are deterministic: a second run gives the same ones
    again = evaluate(cfg, policy_name="heuristic")
    for key in ("new_tokens", "tau", "target_forwards", "drafted_tokens", "wasted_tokens", "lossless"):
        assert again[key] == result[key]


def _other(token: int) -> int:
    return token - 1 if token > 0 else token + 1


@pytest.mark.parametrize("ar", ["ours", "transformers"])
def test_the_lossless_check_reads_the_targets_own_greedy_decoding(tiny_models, prompt_file, monkeypatch, ar):
    """The reference is independent of the engine: transformers' generate when it is the AR baseline, else
    TargetModel.reference_greedy (this project's AR is the engine with γ = 0). A reference that differs at one
    token makes the run lossy; the same run against the true reference is lossless."""
    from eagle_backbone.target import TargetModel

    cfg = evaluate_config(tiny_models, prompt_file, ["policy=static", "policy.gamma=3",
                                                      f"evaluation.ar_baseline={ar}"])
    assert evaluate(cfg, policy_name="static")["lossless"] is True
    if ar == "transformers":
        import ldlp.bench.harness.peer as peer

        true_generate = peer.hf_generate

        def off_by_one(*args, **kw):
            tokens, stats = true_generate(*args, **kw)
            return [_other(tokens[0])] + list(tokens[1:]), stats

        monkeypatch.setattr(peer, "hf_generate", off_by_one)
    else:
        import ldlp.bench.comparisons.evaluate as evaluate_module

        true_greedy, calls = TargetModel.reference_greedy, []

        def off_by_one(self, p, n):
            calls.append(1)
            return [_other(true_greedy(self, p, n)[0])] + true_greedy(self, p, n)[1:]

        monkeypatch.setattr(TargetModel, "reference_greedy", off_by_one)
        # the first run's reference is kept for the process (a sweep's jobs decode it once): the same run again
        # reads it, and the wrong reference is seen only by a process that has not decoded it yet
        again = evaluate(cfg, policy_name="static")
        assert again["lossless"] is True and not calls
        monkeypatch.setattr(evaluate_module, "_REFERENCE", {})
    result = evaluate(cfg, policy_name="static")
    assert result["ar_impl"] == ar and result["lossless"] is False


def test_sampling_skips_the_lossless_check_and_oracle_refuses_it(tiny_models, prompt_file):
    cfg = evaluate_config(tiny_models, prompt_file, ["policy=static", "policy.gamma=2",
                                                      "generation.temperature=0.8", "evaluation.repeats=1"])
    result = evaluate(cfg, policy_name="static")
    assert result["lossless"] is None and result["gamma"] == 2 and result["ar_impl"] == "ours"
    cfg = evaluate_config(tiny_models, prompt_file, ["policy=oracle", "generation.temperature=0.8"])
    with pytest.raises(ValueError, match="greedy"):
        evaluate(cfg, policy_name="oracle")


def test_transformers_peer_rows(tiny_models, prompt_file):
    """The transformers peers live in conf/peer/ (not policies of this engine) and run as peer=NAME; the old spelling
    policy=NAME is read as it (scripts/evaluate.py), and a sweep mixing peers and policies is refused in one line."""
    from eagle_backbone.errors import ConfigError
    from ldlp.bench.harness.contender import peer_alias

    assert not list((REPO / "conf" / "policy").glob("hf_*.yaml"))
    for name in ("hf_heuristic", "hf_confidence"):
        cfg = evaluate_config(tiny_models, prompt_file, [f"peer={name}", "evaluation.repeats=1"], draft_lm=True)
        result = evaluate(cfg, policy_name=name)
        assert result["engine"] == "transformers" and result["lossless"] is True
        assert result["target_forwards"] >= 2 and result["drafted_tokens"] > 0
        assert result["policy"] == name
        assert result["policy_config"]["_target_"] == "ldlp.bench.harness.peer.TransformersAssisted"
    assert peer_alias(["e.py", "-m", "policy=hf_heuristic,hf_confidence", "policy.num_assistant_tokens=3"]) == \
        ["e.py", "-m", "peer=hf_heuristic,hf_confidence", "peer.num_assistant_tokens=3"]
    assert peer_alias(["e.py", "policy=heuristic", "policy.max_gamma=4"]) == ["e.py", "policy=heuristic", "policy.max_gamma=4"]
    with pytest.raises(ConfigError, match=r"^policy=hf_heuristic,heuristic: hf_heuristic is a peer \(conf/peer/\)"):
        peer_alias(["e.py", "-m", "policy=hf_heuristic,heuristic"])
    cfg = evaluate_config(tiny_models, prompt_file, ["peer=hf_heuristic"])
    with pytest.raises(ValueError, match="draft LM"):
        evaluate(cfg, policy_name="hf_heuristic")


def test_the_old_spelling_of_a_peer_runs_the_peer(tiny_models, prompt_file, tmp_path):
    """scripts/evaluate.py -m policy=hf_heuristic,hf_confidence (a command of before the peers left conf/policy/)
    sweeps the peers as peer=...: its rows are named as before."""
    import subprocess
    import sys

    cmd = [sys.executable, "scripts/evaluate.py", "-m", "policy=hf_heuristic,hf_confidence", "evaluation.repeats=1",
           *overrides(tiny_models, prompt_file, draft_lm=True), f"hydra.sweep.dir={tmp_path}"]
    res = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(f.read_text()) for f in sorted(tmp_path.rglob("results.json"))]
    assert sorted(r["policy"] for r in rows) == ["hf_confidence", "hf_heuristic"]
    assert all(r["engine"] == "transformers" and r["lossless"] for r in rows)


def test_pipeline_runs_sweeps_summarizes_and_resumes(tiny_models, prompt_file, tmp_path):
    """The main command on tiny models (corpus, labels, LDLP and acceptance head given as done): Hydra
    multiruns of scripts/evaluate.py, the summary (md, csv, png) under paths.results, and a rerun that
    skips every stage whose inputs did not change."""
    from omegaconf import OmegaConf

    import eagle_backbone.paths  # noqa: F401
    from ldlp.models.acceptance import AcceptanceHead, AcceptanceHeadConfig
    from ldlp.pipeline import StageRunner, fingerprint, plan, run, store_fingerprint
    from ldlp.models.predictor import LDLP, LDLPConfig

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="pipeline", overrides=[
            f"paths.data_dir={tmp_path / 'data'}", f"paths.outputs={tmp_path / 'outputs'}",
            f"paths.embedded={tmp_path / 'embedded'}", "sweep.rounds=1", "sweep.static_gammas=[1,2]",
            "sweep.adaptive=[ldlp,oracle]", "peer.enabled=false", "tune.enabled=false", "head_to_head.rounds=1",
            "head_to_head.adaptive=1", "head_to_head.overrides=[]",
            "bench_batch.enabled=false"])  # the load sweep stage: tests/test_bench_load.py
        OmegaConf.update(cfg, "sweep.overrides", [o for o in overrides(tiny_models, prompt_file)
                                                 if not o.startswith(("evaluation.repeats", "threads"))]
                         + ["evaluation.repeats=1"])
        LDLP(LDLPConfig(input_dim=64, hidden_dim=8, k_max=8)).save_pretrained(cfg.paths.ldlp)
        AcceptanceHead(AcceptanceHeadConfig(hidden_size=32, k_max=8)).save_pretrained(cfg.paths.acceptance)
        stages = {s.name: s for s in plan(cfg)}
        for name, product in (("corpus", "test.json"), ("oracle", "report.md")):
            stages[name].out.mkdir(parents=True, exist_ok=True)
            (stages[name].out / product).write_text("given\n")
        for name in ("corpus", "oracle", "ldlp", "acceptance"):  # given as done for their current inputs
            store_fingerprint(stages[name], *fingerprint(stages[name], stages), complete=True)
        summary = run(cfg)
        results = tmp_path / "outputs" / "results" / "embedded"
        assert summary["md"] == results / "results.md" and summary["png"].is_file()
        rows = {(r["policy"], r["gamma"]) for r in summary["rows"]}
        assert rows == {("static", 1), ("static", 2), ("ldlp", None), ("oracle", None)}
        assert all(r["lossless"] is True for r in summary["rows"])
        head = summary["headline"]["tiny"]
        assert head["best_static"]["gamma"] in (1, 2) and head["best_adaptive"]["policy"] == "ldlp"
        assert head["all_greedy_lossless"] is True
        csv = summary["csv"].read_text().splitlines()
        assert csv[0].startswith("model,") and len(csv) == 5
        # the head to head: static γ around the best and the best adaptive policy, timed in turns
        h2h = head["head_to_head"]
        assert [r["contender"] for r in h2h["rows"]] == ["static γ=1", "static γ=2", "ldlp", "oracle", "AR"]
        assert h2h["lossless"] is True and h2h["best_adaptive"] == "ldlp" and len(h2h["seconds"]) == 5
        compared = [r for r in h2h["rows"] if "vs_best_static" in r]  # the other static γ, the LDLP, the oracle
        assert len(compared) == 3 and all(r["ci95"][0] <= r["vs_best_static"] <= r["ci95"][1] for r in compared)
        oracle = next(r for r in summary["rows"] if r["policy"] == "oracle")
        assert head["oracle"]["tokens_per_s"] == oracle["tokens_per_s"] and "headroom_captured" in head
        assert summary["md"].read_text().startswith("## ")  # results.md renders (its rows are the rows above)

        def written(folder):  # the modification time of every file under folder
            return {p: p.stat().st_mtime_ns for p in Path(folder).rglob("*") if p.is_file()}

        runs, static, adaptive = Path(cfg.paths.runs), stages["sweep:static:1"].out, stages["sweep:adaptive:1"].out
        before, md = written(runs), summary["md"].read_text()
        assert written(static) and written(adaptive) and written(runs / "head_to_head")
        run(cfg)  # nothing changed: every stage is skipped (no file rewritten), the same summary is rebuilt
        assert written(runs) == before and (results / "results.md").read_text() == md
        # a retrained LDLP: the adaptive sweep and the head to head would run again, the static sweep would not
        # (the runner's own decision; tests/test_pipeline.py runs a changed upstream's downstream stages)
        torch.manual_seed(1)  # other weights than the first LDLP's
        LDLP(LDLPConfig(input_dim=64, hidden_dim=8, k_max=8)).save_pretrained(cfg.paths.ldlp)
        replanned = plan(cfg)
        runner = StageRunner(cfg, replanned)
        reruns = {s.name: runner.decide(s) for s in replanned}
        assert {name for name, (again, *_) in reruns.items() if again} == {"sweep:adaptive:1", "head_to_head"}
        assert "ldlp" in reruns["sweep:adaptive:1"][1] and not reruns["sweep:static:1"][0]


def test_update_readme_replaces_only_the_marked_block(tmp_path):
    """The block between README's markers is replaced, nothing else is touched, a rerun changes nothing, and a
    README without markers is left alone; update_readme renders the results table and plot into that block."""
    from ldlp.report.pages import replace_readme_block, update_readme

    readme = tmp_path / "README.md"
    outside = ("before\n<!-- results:start -->\n", "\n<!-- results:end -->\nafter\n")
    readme.write_text(outside[0] + "old" + outside[1])
    assert replace_readme_block(readme, "results", "new\n")
    assert readme.read_text() == outside[0] + "new" + outside[1]
    assert replace_readme_block(readme, "results", "new") and readme.read_text() == outside[0] + "new" + outside[1]
    (tmp_path / "OTHER.md").write_text("no markers\n")
    assert not replace_readme_block(tmp_path / "OTHER.md", "results", "new")
    assert (tmp_path / "OTHER.md").read_text() == "no markers\n"
    (tmp_path / "results").mkdir()
    md, png = tmp_path / "results" / "results.md", tmp_path / "results" / "tokens_per_s.png"
    md.write_text("## Title\n\nrows\n")
    png.write_bytes(b"png")
    assert update_readme(readme, md, png, "cmd")
    text = readme.read_text()
    assert text.startswith(outside[0]) and text.endswith(outside[1]) and "results/tokens_per_s.png" in text


def test_tuned_settings_replace_the_policy_fields(tmp_path):
    from omegaconf import OmegaConf

    from ldlp.bench.harness.loaders import apply_tuned

    results = [{"policy": "ddd", "params": {"threshold": -2.0, "max_gamma": 6}, "tokens_per_s": 10.0},
               {"policy": "ddd", "params": {"threshold": -4.0, "max_gamma": 8}, "tokens_per_s": 12.0},
               {"policy": "static", "params": {"gamma": 3}, "tokens_per_s": 11.0}]
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"results": results}))
    base = OmegaConf.create({"_target_": "ldlp.policies.threshold.DDDPolicy", "threshold": -6.0, "max_gamma": 8})
    cfg, tuned = apply_tuned(base, str(path), "ddd")
    assert tuned == {"threshold": -4.0, "max_gamma": 8} and cfg.threshold == -4.0
    static = OmegaConf.create({"_target_": "eagle_backbone.policy.StaticPolicy", "gamma": 5})
    assert apply_tuned(static, str(path), "static") == (static, None)  # a swept γ is never replaced
    assert apply_tuned(base, None, "ddd") == (base, None)
    with pytest.raises(ValueError, match="no such file"):
        apply_tuned(base, str(tmp_path / "missing.json"), "ddd")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a tuning.json"):
        apply_tuned(base, str(tmp_path / "bad.json"), "ddd")


def test_a_tuned_file_for_another_model_is_refused_before_loading_or_taken_and_recorded(tiny_models, prompt_file,
                                                                                         tmp_path):
    """tuned_from= a tuning.json made for another model: refused in one line naming the file and both sides, before
    any weights load; under accept_mismatch=true the run uses it and its results.json records the message."""
    from conftest import one_line

    from eagle_backbone.errors import Mismatch, accept_mismatches
    from ldlp.bench.harness.loaders import run_setup

    path = tmp_path / "tuning.json"
    cfg = evaluate_config(tiny_models, prompt_file, ["policy=ddd", f"tuned_from={path}"])
    made_for = {**run_setup(cfg.model), "model": "vicuna"}
    path.write_text(json.dumps({"made_for": made_for, "results": [
        {"policy": "ddd", "params": {"threshold": -4.0}, "tokens_per_s": 12.0}]}))
    with pytest.raises(Mismatch, match=f"^tuned_from={path} was tuned for another setup than this run's \\(the "
                                       f"file's vs this run's: model: 'vicuna' vs '{cfg.model.name}'\\)") as e:
        evaluate(cfg, policy_name="ddd")
    one_line(e)
    accept_mismatches(True)
    try:
        evaluate(cfg, policy_name="ddd", out_dir=tmp_path / "run")
    finally:
        accept_mismatches(False)
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["policy_config"]["threshold"] == -4.0 and saved["tuned_from"] == str(path)
    assert saved["accepted_mismatches"] == [str(e.value).split("; accept_mismatch=true")[0]]
    # tuned with other drafter weights: refused once the pair is loaded
    path.write_text(json.dumps({"made_for": {**run_setup(cfg.model), "drafter_sha256": "0" * 64}, "results": [
        {"policy": "ddd", "params": {"threshold": -4.0}, "tokens_per_s": 12.0}]}))
    with pytest.raises(Mismatch, match=f"^tuned_from={path} .*: drafter_sha256: '{'0' * 12}' vs '[0-9a-f]{{12}}'\\)"):
        evaluate(cfg, policy_name="ddd")


def test_head_to_head_refuses_sampling_and_duplicates(tiny_models, prompt_file):
    from ldlp.bench.comparisons.headtohead import head_to_head

    cfg = evaluate_config(tiny_models, prompt_file, ["policy=static"])
    static = cfg.policy
    sampled = evaluate_config(tiny_models, prompt_file, ["generation.temperature=0.7"])
    with pytest.raises(ValueError, match="greedy"):
        head_to_head(sampled, [("static", static), ("heuristic", static)])
    with pytest.raises(ValueError, match="at least 2 contenders"):
        head_to_head(cfg, [("static", static)])
    with pytest.raises(ValueError, match="listed twice"):
        head_to_head(cfg, [("static", static), ("static", static)], rounds=1)


def test_head_to_head_tokens_per_s_counts_every_round(tiny_models, prompt_file):
    from ldlp.bench.comparisons.headtohead import head_to_head

    cfg = evaluate_config(tiny_models, prompt_file, ["policy=static", "evaluation.progress=false"])
    two = evaluate_config(tiny_models, prompt_file, ["policy=static", "policy.gamma=2"]).policy
    result = head_to_head(cfg, [("static", cfg.policy), ("static", two)], rounds=3, bootstrap=50)
    secs, tokens = np.array(result["seconds"]), np.array(result["tokens"])
    for i, row in enumerate(result["rows"]):
        # every round emits the same tokens: the total is rounds x tokens over all the seconds
        assert row["tokens_per_s"] == pytest.approx(3 * tokens[i].sum() / secs[i].sum())
        assert min(row["tokens_per_s_rounds"]) <= row["tokens_per_s"] <= max(row["tokens_per_s_rounds"])
    four, two, ar = result["rows"]  # static γ = 4 (the YAML's default), static γ = 2, AR
    assert ar["tau"] == 1.0 and ar["drafted_tokens"] == ar["wasted_tokens"] == 0
    # the random drafter is never accepted: every drafted token is wasted, and with no accepted tokens the
    # three costs (target pass, drafted token, accepted token) cannot be told apart, so none is fitted
    for row in (two, four):
        assert row["tau"] == 1.0 and row["wasted_tokens"] == row["drafted_tokens"] > 0
    assert four["drafted_tokens"] > two["drafted_tokens"]
    assert result["costs"] is None


def test_head_to_head_fits_the_costs_of_its_own_generations(tiny_models, prompt_file, monkeypatch):
    """With a draft LM the target accepts sometimes, target passes, drafted and accepted tokens vary apart
    over the timed generations, and the head to head fits a cost to each (the replay tuner's model). The
    generations' seconds are synthetic (known costs of their own counts), so the fit is checked exactly and
    no timing noise of a loaded machine enters the test."""
    import ldlp.bench.comparisons.headtohead as h2h
    from ldlp.bench.harness.runners import engine_runner

    step_s, draft_s, accepted_s = 2e-3, 5e-4, 1e-4

    def synthetic(name, decoder, sampling):
        runner = engine_runner(name, decoder, sampling)
        real = runner.run

        def run(prompt, n, seed):
            tokens, stats = real(prompt, n, seed)
            stats.wall_s = step_s * stats.target_forwards + draft_s * stats.drafted_tokens + accepted_s * stats.accepted_tokens
            return tokens, stats

        runner.run = run
        return runner

    monkeypatch.setattr(h2h, "engine_runner", synthetic)
    noisy = [o if not o.startswith("model.drafter=") else f"model.drafter={tiny_models / 'noisy_lm'}"
             for o in overrides(tiny_models, prompt_file, draft_lm=True)]
    cfg = compose_config("evaluate", noisy + ["policy=static", "policy.gamma=1"])
    four = compose_config("evaluate", noisy + ["policy=static"]).policy
    result = h2h.head_to_head(cfg, [("static", cfg.policy), ("static", four)], rounds=2, bootstrap=10)
    assert result["lossless"] is True and all(r["tau"] > 1.0 for r in result["rows"][:2])
    costs = result["costs"]
    assert set(costs) == {"step_ms", "draft_ms", "accepted_ms"}
    assert costs == pytest.approx({"step_ms": 1e3 * step_s, "draft_ms": 1e3 * draft_s, "accepted_ms": 1e3 * accepted_s},
                                  rel=1e-6)


def test_head_to_head_takes_the_replay_tuning_best_unless_told_otherwise():
    from omegaconf import OmegaConf

    from ldlp.bench.harness.replay import best_per_policy
    from ldlp.pipeline import adaptive_contenders

    tuned = best_per_policy([
        {"policy": "static", "params": {"gamma": 6}, "tokens_per_s": 300.0},
        {"policy": "oracle", "params": {"k_max": 8}, "tokens_per_s": 400.0},
        {"policy": "ddd", "params": {"threshold": -2}, "tokens_per_s": 180.0},
        {"policy": "ddd", "params": {"threshold": -4}, "tokens_per_s": 210.0},
        {"policy": "acceptance", "params": {"threshold": 0.3}, "tokens_per_s": 200.0},
        {"policy": "entropy", "params": {"threshold": 5}, "tokens_per_s": 250.0}])  # not swept
    summary = {"rows": [{"model": "m", "policy": "acceptance", "speedup": 1.9},
                        {"model": "m", "policy": "ddd", "speedup": 1.7},
                        {"model": "m", "policy": "heuristic", "speedup": 1.8}]}
    cfg = OmegaConf.create({"sweep": {"adaptive": ["ddd", "acceptance", "heuristic", "oracle"]},
                            "head_to_head": {"adaptive": 2, "choose_by": "tuning"}})
    assert adaptive_contenders(cfg, "m", summary, tuned) == ["ddd", "acceptance"]
    cfg.head_to_head.choose_by = "sweep"
    assert adaptive_contenders(cfg, "m", summary, tuned) == ["acceptance", "heuristic"]
    cfg.head_to_head.choose_by = "tuning"
    assert adaptive_contenders(cfg, "m", summary, {}) == ["acceptance", "heuristic"]  # no tuning: the sweep


def test_policy_config_composes_one_policy_with_the_checkpoint_folders(tmp_path):
    from omegaconf import OmegaConf

    import eagle_backbone.paths  # noqa: F401
    from ldlp.bench.harness.loaders import policy_config

    cfg = OmegaConf.create({"ldlp_path": str(tmp_path / "l"), "ldlp_survival_path": str(tmp_path / "s"),
                            "acceptance_path": str(tmp_path / "a")})
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        name, node = policy_config(cfg, ["policy=acceptance", "policy.threshold=0.2"])
        assert name == "acceptance" and node.path == str(tmp_path / "a") and node.threshold == 0.2
        merged = OmegaConf.merge(node, {"max_gamma": 9})  # what the tuner and apply_tuned do
        assert merged.path == str(tmp_path / "a") and merged.max_gamma == 9
        with pytest.raises(ValueError, match="exactly one policy"):
            policy_config(cfg, ["policy=ddd", "policy=static"])
        with pytest.raises(ValueError, match="no conf/policy/nope.yaml"):
            policy_config(cfg, ["policy=nope"])


def test_head_to_head_static_contenders_cover_the_sweep_and_the_tuning():
    from omegaconf import OmegaConf

    from ldlp.bench.harness.replay import best_per_policy
    from ldlp.pipeline import static_contenders

    cfg = OmegaConf.create({"sweep": {"static_gammas": [1, 2, 3, 4, 5, 6, 7, 8]}})
    tuned = best_per_policy([{"policy": "static", "params": {"gamma": g}, "tokens_per_s": t}
                             for g, t in ((5, 180.0), (6, 190.0), (8, 170.0))])
    assert static_contenders(cfg, 8, tuned) == [5, 6, 7, 8]  # the tuning's best and neighbours, and the sweep's
    assert static_contenders(cfg, 6, tuned) == [5, 6, 7]
    assert static_contenders(cfg, 8, {}) == [7, 8]  # no tuning: the sweep's best and its neighbours in the sweep


# -- a run names its prompt set (file, hash, subset) and counts the prompts it dropped; the summary never merges two sets


def _question_file(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question_id": i, "turns": [q]}) + "\n" for i, q in enumerate(questions)))
    return path


def _eval_cfg(models: Path, prompts: Path, extra=()):
    return compose_config("evaluate", pair_overrides(models, "float32") + [
        "data=mt_bench", f"data.path={prompts}", "generation.max_new_tokens=4", "evaluation.repeats=1", "evaluation.warmup=0",
        "evaluation.calibration_prompts=1", "evaluation.progress=false", "threads=1",
        *([] if any(x.startswith("policy=") for x in extra) else ["policy=static", "policy.gamma=2"]), *extra])


def test_results_json_identifies_the_prompt_file_and_counts_dropped_prompts(tiny_models, tmp_path):
    from ldlp.bench.harness.loaders import file_sha256

    prompts = _question_file(tmp_path / "q.jsonl", ["Hello there.", "word " * 400, "What is 2 + 2?", "Hi."])
    cfg = _eval_cfg(tiny_models, prompts, ["data.limit=3", "data.sample_seed=5", "data.max_prompt_tokens=64"])
    result = evaluate(cfg, policy_name="static", out_dir=tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["data_path"] == str(prompts) and saved["data_sha256"] == file_sha256(prompts)
    assert (saved["limit"], saved["sample_seed"], saved["turns"]) == (3, 5, "first")
    assert saved["n_prompts"] + saved["n_dropped"] == 3 and saved["n_dropped"] == 1
    assert "max_prompt_tokens=64" in saved["dropped_reason"]
    assert result["n_dropped"] == 1


@pytest.mark.parametrize("bad", ["data", "policy", "checkpoint"])
def test_bad_inputs_fail_before_the_models_load(tmp_path, monkeypatch, bad):
    import ldlp.bench.comparisons.evaluate as ev

    def no_weights(_):
        raise AssertionError("the models were loaded before the cheap inputs were checked")

    monkeypatch.setattr(ev, "load_pair_cached", no_weights)
    good = _question_file(tmp_path / "q.jsonl", ["Hello there."])
    models = tmp_path / "models"  # no weights anywhere: only the tokenizer, which has none
    extra = {"data": [], "policy": ["policy=static", "policy.gamma=-3"],
             "checkpoint": ["policy=ldlp", f"policy.path={tmp_path / 'no_ldlp'}"]}[bad]
    prompts = good
    if bad == "data":
        prompts = tmp_path / "bad.jsonl"
        prompts.write_text('{"question_id": 1, "turns": ["fine"]}\n{"question_id": 2, "turns": \n')
    cfg = _eval_cfg(models, prompts, extra)
    with pytest.raises(ValueError) as e:
        ev.evaluate(cfg, policy_name=None)
    msg = str(e.value)
    assert {"data": str(prompts), "policy": "gamma", "checkpoint": "no_ldlp"}[bad] in msg


def _result(**kw) -> dict:
    r = {"policy": "static", "gamma": 2, "model": "tiny", "drafter_kind": "eagle", "dataset": "prompts",
         "n_prompts": 10, "n_dropped": 0, "dropped_reason": None, "temperature": 0.0, "max_new_tokens": 8,
         "tokens_per_s": 100.0, "ar_tokens_per_s": 50.0, "speedup": 2.0, "tau": 2.0, "target_forwards": 5,
         "wasted_tokens": 1, "drafted_tokens": 4, "new_tokens": 8, "lossless": True, "repeats": 1,
         "data_path": "/d/humaneval.jsonl", "data_sha256": "a" * 64, "limit": None, "sample_seed": None,
         "turns": "first", "policy_config": {"gamma": 2}}
    r.update(kw)
    return r


def _write_runs(root: Path, results: list[dict]) -> Path:
    for k, r in enumerate(results):
        (root / f"run{k}").mkdir(parents=True)
        (root / f"run{k}" / "results.json").write_text(json.dumps(r))
    return root


@pytest.mark.parametrize("field,other", [("data_path", "/d/gsm8k.jsonl"), ("data_sha256", "b" * 64), ("limit", 5),
                                         ("sample_seed", 3), ("turns", "all")])
def test_runs_on_different_prompt_sets_never_share_a_row(tmp_path, field, other):
    from ldlp.report.summary import aggregate, find_results, summarize

    runs = _write_runs(tmp_path / "runs", [_result(tokens_per_s=100.0), _result(**{field: other}, tokens_per_s=10.0)])
    rows = aggregate(find_results(runs))
    assert len(rows) == 2 and sorted(r["tokens_per_s"] for r in rows) == [10.0, 100.0]
    out = summarize(runs, tmp_path / "out")  # a headline per prompt set, never one over both
    assert len({h["prompt_set_key"] for h in out["headline"].values()}) == 2


def test_old_results_without_the_prompt_file_hash_get_one_warning(tmp_path, caplog):
    from ldlp.report.summary import aggregate, find_results

    old = [{k: v for k, v in _result(tokens_per_s=t).items() if k not in ("data_sha256", "limit", "sample_seed")}
           for t in (1.0, 2.0, 3.0)]
    with caplog.at_level("WARNING", logger="ldlp.report.summary"):
        aggregate(find_results(_write_runs(tmp_path, old)))
    warnings = [r for r in caplog.records if "predate the prompt-file hash" in r.getMessage()]
    assert len(warnings) == 1 and "3 of 3" in warnings[0].getMessage()


def test_dropped_prompts_are_carried_into_the_rows_and_the_csv(tmp_path):
    """Each row carries its prompt set's dropped count and reason (the tables' header line states them through
    ``dropped_note``, tested below); results.csv has the column."""
    from ldlp.report.summary import summarize

    why = "longer than max_prompt_tokens=1536"
    out = summarize(_write_runs(tmp_path / "many", [_result(n_prompts=56, n_dropped=24, dropped_reason=why)]),
                    tmp_path / "o2")
    [row] = out["rows"]
    assert (row["n_prompts"], row["n_dropped"], row["dropped_reason"]) == (56, 24, why)
    assert "n_dropped" in (tmp_path / "o2" / "results.csv").read_text().splitlines()[0]


def test_records_skipped_under_on_error_skip_are_on_the_results_page_not_only_the_log(tmp_path):
    """data.on_error=skip: the count of malformed records skipped (the prompt set's ``n_skipped_records``) is on the
    page's prompt-set line and the README block, beside the dropped prompts; nothing when none were skipped."""
    from ldlp.report.publish import headline_block
    from ldlp.report.summary import summarize

    out = summarize(_write_runs(tmp_path / "runs", [_result(n_skipped_records=3)]), tmp_path / "o")
    assert out["rows"][0]["n_skipped_records"] == 3
    assert "**3 malformed records of the prompt file skipped** (data.on_error=skip" in (
        tmp_path / "o" / "results.md").read_text()
    summarize(_write_runs(tmp_path / "clean", [_result()]), tmp_path / "o2")
    assert "skipped" not in (tmp_path / "o2" / "results.md").read_text()
    h2h = {"reference": "static γ=6", "n_prompts": 56, "n_dropped": 0, "n_skipped_records": 1, "rounds": 2, "rows": []}
    block = headline_block({"headline": {"m": {"head_to_head": h2h}}}, "m", "cmd", "p.md")
    assert "56 prompts, none dropped, **1 malformed record of the prompt file skipped**" in block


def test_the_dropped_note_states_the_share_in_bold_over_5_percent():
    """The phrase every table's header line (the sweep's, the head to head's, README's block) puts after its
    prompt count."""
    from ldlp.report.notes import dropped_note

    result = {"n_prompts": 56, "n_dropped": 24, "dropped_reason": "longer than max_prompt_tokens=1536"}
    assert dropped_note(result) == " (**24 of 80 prompts (30%) dropped: longer than max_prompt_tokens=1536**)"
    assert dropped_note({**result, "n_prompts": 976}) == " (24 dropped: longer than max_prompt_tokens=1536)"


def test_one_policy_twice_is_named_by_the_setting_that_differs(tiny_models, prompt_file):
    from ldlp.bench.comparisons.headtohead import head_to_head

    cfg = evaluate_config(tiny_models, prompt_file, ["policy=heuristic", "evaluation.progress=false"])
    other = evaluate_config(tiny_models, prompt_file, ["policy=heuristic", "policy.initial_gamma=2"]).policy
    result = head_to_head(cfg, [("heuristic", cfg.policy), ("heuristic", other)], rounds=1, bootstrap=20)
    assert [r["contender"] for r in result["rows"]][:2] == ["heuristic", "heuristic (initial_gamma=2)"]


def test_head_to_head_scripted_twins_replay_each_adaptive_contenders_choices(tiny_models, prompt_file):
    """scripted_twins=true: an adaptive contender's γ choices, replayed by a scripted twin in the same turns, give
    the same steps (same drafts, same outputs), and the twin is neither the best static nor an adaptive contender."""
    from ldlp.bench.comparisons.headtohead import head_to_head
    from ldlp.report.headtohead import head_to_head_markdown

    base = overrides(tiny_models, prompt_file) + ["evaluation.progress=false", "+scripted_twins=true"]
    cfg = compose_config("evaluate", base + ["policy=static"])
    heuristic = compose_config("evaluate", base + ["policy=heuristic"]).policy
    result = head_to_head(cfg, [("static", cfg.policy), ("heuristic", heuristic)], rounds=2, bootstrap=20)
    static, adaptive, twin, ar = result["rows"]
    assert twin["contender"] == f"{adaptive['contender']}: its choices, scripted" and twin["adaptive"] is None
    assert twin["drafted_tokens"] == adaptive["drafted_tokens"] and twin["tau"] == adaptive["tau"]
    assert twin["twin"]["of"] == adaptive["contender"] and twin["twin"]["same_choices"] == 1.0
    assert result["reference"] == static["contender"] and result.get("best_adaptive") in (None, adaptive["contender"])
    assert result["lossless"]
    result["n_skipped_records"] = 2  # data.on_error=skip: the page says so, not only the log
    assert "2 malformed records of the prompt file skipped" in head_to_head_markdown(result)
