"""scripts/evaluate.py and the summary on tiny random models saved to temporary folders."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_llama_config
from hydra import compose, initialize_config_dir
from transformers import LlamaForCausalLM

from eagle_backbone.drafter import EagleDrafter
from ldlp.bench.evaluate import RESULT_KEYS, evaluate

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "data" / "embedded" / "tokenizer"  # committed; its vocabulary (4096) sizes the tiny models
VOCAB = 4096


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny Llama target, an EAGLE drafter and a standalone draft LM, saved like the embedded ones."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama_config(vocab=VOCAB, d=32, layers=2, max_pos=512, eos=2))
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    target.save_pretrained(root / "target")
    drafter = EagleDrafter.from_target_config(target.config)
    drafter.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    drafter.save_pretrained(root / "drafter")
    torch.manual_seed(2)
    LlamaForCausalLM(tiny_llama_config(vocab=VOCAB, d=32, layers=1, max_pos=512, eos=2)).save_pretrained(root / "draft_lm")
    return root


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "question.jsonl"
    lines = [{"question_id": i, "category": "test", "turns": [q]} for i, q in
             enumerate(["Explain the function `os.path.join`.", "What does `json.dumps` return?",
                        "Write a function that reverses a list."])]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def overrides(models: Path, prompts: Path, draft_lm: bool = False) -> list[str]:
    return [f"model.target={models / 'target'}", f"model.tokenizer={TOKENIZER}",
            f"model.drafter={models / ('draft_lm' if draft_lm else 'drafter')}",
            f"model.drafter_kind={'draft_lm' if draft_lm else 'eagle'}", f"model.name={'tiny_lm' if draft_lm else 'tiny'}",
            "model.dtype=float64", "data=mt_bench", f"data.path={prompts}", "data.limit=2",
            "generation.max_new_tokens=12", "evaluation.repeats=2", "evaluation.progress=false", "threads=1"]


def compose_eval(extra: list[str]):
    import eagle_backbone.paths  # noqa: F401

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="evaluate", overrides=extra)


def test_evaluate_writes_every_key_and_is_lossless(tiny_models, prompt_file, tmp_path):
    cfg = compose_eval(overrides(tiny_models, prompt_file) + ["policy=heuristic"])
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


def test_sampling_skips_the_lossless_check_and_oracle_refuses_it(tiny_models, prompt_file):
    cfg = compose_eval(overrides(tiny_models, prompt_file) + ["policy=static", "policy.gamma=2",
                                                              "generation.temperature=0.8", "evaluation.repeats=1"])
    result = evaluate(cfg, policy_name="static")
    assert result["lossless"] is None and result["gamma"] == 2 and result["ar_impl"] == "ours"
    cfg = compose_eval(overrides(tiny_models, prompt_file) + ["policy=oracle", "generation.temperature=0.8"])
    with pytest.raises(ValueError, match="greedy"):
        evaluate(cfg, policy_name="oracle")


def test_transformers_peer_rows(tiny_models, prompt_file):
    for name in ("hf_heuristic", "hf_confidence"):
        cfg = compose_eval(overrides(tiny_models, prompt_file, draft_lm=True) + [f"policy={name}", "evaluation.repeats=1"])
        result = evaluate(cfg, policy_name=name)
        assert result["engine"] == "transformers" and result["lossless"] is True
        assert result["target_forwards"] >= 2 and result["drafted_tokens"] > 0
    cfg = compose_eval(overrides(tiny_models, prompt_file) + ["policy=hf_heuristic"])
    with pytest.raises(ValueError, match="draft LM"):
        evaluate(cfg, policy_name="hf_heuristic")


def test_pipeline_runs_sweeps_summarizes_and_resumes(tiny_models, prompt_file, tmp_path, capsys):
    """The main command on tiny models (labels, LDLP and acceptance head given as done): Hydra multiruns of
    scripts/evaluate.py, the summary (md, csv, png), and a rerun that skips every finished stage."""
    from omegaconf import OmegaConf

    import eagle_backbone.paths  # noqa: F401
    from ldlp.pipeline import run
    from ldlp.predictor import LDLP, LDLPConfig

    oracle_dir, ldlp_dir = tmp_path / "oracle", tmp_path / "ldlp"
    oracle_dir.mkdir()
    (oracle_dir / "report.md").write_text("labels\n")  # the oracle stage counts as done
    LDLP(LDLPConfig(input_dim=64, hidden_dim=8, k_max=8)).save_pretrained(ldlp_dir)
    from ldlp.acceptance import AcceptanceHead, AcceptanceHeadConfig

    acceptance_dir = AcceptanceHead(AcceptanceHeadConfig(hidden_size=32, k_max=8)).save_pretrained(tmp_path / "acc")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="pipeline", overrides=[
            f"out_dir={tmp_path / 'results'}", f"runs_dir={tmp_path / 'runs'}", f"oracle.out_dir={oracle_dir}",
            f"ldlp.out_dir={ldlp_dir}", f"acceptance.out_dir={acceptance_dir}", "sweep.rounds=1", "sweep.static_gammas=[1,2]", "sweep.adaptive=[ldlp,oracle]",
            "peer.enabled=false", "ldlp.survival_out_dir=null", "tune.enabled=false", "head_to_head.rounds=1",
            "head_to_head.adaptive=1", "head_to_head.overrides=[]"])
        OmegaConf.update(cfg, "sweep.overrides", [o for o in overrides(tiny_models, prompt_file)
                                                 if not o.startswith("evaluation.repeats")] + ["evaluation.repeats=1"])
        summary = run(cfg)
        assert (tmp_path / "results" / "results.md").is_file() and summary["png"].is_file()
        rows = {(r["policy"], r["gamma"]) for r in summary["rows"]}
        assert rows == {("static", 1), ("static", 2), ("ldlp", None), ("oracle", None)}
        assert all(r["lossless"] is True for r in summary["rows"])
        md = summary["md"].read_text()
        assert "| static | 2 |" in md and "| oracle |" in md and "headroom captured" in md and "Machine:" in md
        head = summary["headline"]["tiny"]
        assert head["best_static"]["gamma"] in (1, 2) and head["best_adaptive"]["policy"] == "ldlp"
        assert head["all_greedy_lossless"] is True
        csv = summary["csv"].read_text().splitlines()
        assert csv[0].startswith("model,") and len(csv) == 5
        # the head to head: static γ around the best and the best adaptive policy, timed in turns
        h2h = head["head_to_head"]
        assert [r["contender"] for r in h2h["rows"]] == ["static γ=1", "static γ=2", "ldlp", "oracle", "AR"]
        assert h2h["lossless"] is True and "### Head to head (tiny)" in md and "95% interval" in md
        assert sum("vs_best_static" in r for r in h2h["rows"]) == 3  # the other static γ, the LDLP, the oracle
        assert h2h["best_adaptive"] == "ldlp" and len(h2h["seconds"]) == 5  # raw seconds kept for reanalysis
        capsys.readouterr()
        run(cfg)  # everything is done: every stage is skipped, the summary is rebuilt
        assert capsys.readouterr().out.count("skipped") == 7  # corpus, oracle, ldlp, acceptance, 2 sweeps, h2h


def test_update_readme_replaces_only_the_marked_block(tmp_path):
    from ldlp.report.pages import update_readme

    (tmp_path / "results").mkdir()
    md, png = tmp_path / "results" / "results.md", tmp_path / "results" / "tokens_per_s.png"
    md.write_text("## Title\n\n| a |\n|---|\n| 1 |\n")
    png.write_bytes(b"png")
    readme = tmp_path / "README.md"
    readme.write_text("# Project\nbefore\n<!-- results:start -->\nold numbers\n<!-- results:end -->\nafter\n")
    assert update_readme(readme, md, png, "python scripts/pipeline.py")
    text = readme.read_text()
    assert "old numbers" not in text and "| 1 |" in text and "(results/tokens_per_s.png)" in text
    assert text.startswith("# Project\nbefore\n") and text.endswith("<!-- results:end -->\nafter\n")
    assert update_readme(readme, md, png, "cmd") and readme.read_text().count("| 1 |") == 1  # idempotent
    (tmp_path / "OTHER.md").write_text("no markers\n")
    assert not update_readme(tmp_path / "OTHER.md", md, png, "cmd")


def test_tuned_settings_replace_the_policy_fields(tmp_path):
    from omegaconf import OmegaConf

    from ldlp.bench.loaders import apply_tuned

    results = [{"policy": "ddd", "params": {"threshold": -2.0, "max_gamma": 6}, "tokens_per_s": 10.0},
               {"policy": "ddd", "params": {"threshold": -4.0, "max_gamma": 8}, "tokens_per_s": 12.0},
               {"policy": "static", "params": {"gamma": 3}, "tokens_per_s": 11.0}]
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"results": results}))
    base = OmegaConf.create({"_target_": "ldlp.policies.DDDPolicy", "threshold": -6.0, "max_gamma": 8})
    cfg, tuned = apply_tuned(base, str(path), "ddd")
    assert tuned == {"threshold": -4.0, "max_gamma": 8} and cfg.threshold == -4.0
    static = OmegaConf.create({"_target_": "ldlp.policies.StaticPolicy", "gamma": 5})
    assert apply_tuned(static, str(path), "static") == (static, None)  # a swept γ is never replaced
    assert apply_tuned(base, None, "ddd") == (base, None)
    with pytest.raises(ValueError, match="no such file"):
        apply_tuned(base, str(tmp_path / "missing.json"), "ddd")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a tuning.json"):
        apply_tuned(base, str(tmp_path / "bad.json"), "ddd")


def test_head_to_head_refuses_sampling_and_duplicates(tiny_models, prompt_file):
    from ldlp.bench.headtohead import head_to_head

    cfg = compose_eval(overrides(tiny_models, prompt_file) + ["policy=static"])
    static = cfg.policy
    sampled = compose_eval(overrides(tiny_models, prompt_file) + ["generation.temperature=0.7"])
    with pytest.raises(ValueError, match="greedy"):
        head_to_head(sampled, [("static", static), ("heuristic", static)])
    with pytest.raises(ValueError, match="at least 2 contenders"):
        head_to_head(cfg, [("static", static)])
    with pytest.raises(ValueError, match="listed twice"):
        head_to_head(cfg, [("static", static), ("static", static)], rounds=1)


def test_head_to_head_tokens_per_s_counts_every_round(tiny_models, prompt_file):
    from ldlp.bench.headtohead import head_to_head

    cfg = compose_eval(overrides(tiny_models, prompt_file) + ["policy=static", "evaluation.progress=false"])
    two = compose_eval(overrides(tiny_models, prompt_file) + ["policy=static", "policy.gamma=2"]).policy
    result = head_to_head(cfg, [("static", cfg.policy), ("static", two)], rounds=3, bootstrap=50)
    secs, tokens = np.array(result["seconds"]), np.array(result["tokens"])
    for i, row in enumerate(result["rows"]):
        # every round emits the same tokens: the total is rounds x tokens over all the seconds
        assert row["tokens_per_s"] == pytest.approx(3 * tokens[i].sum() / secs[i].sum())
        assert min(row["tokens_per_s_rounds"]) <= row["tokens_per_s"] <= max(row["tokens_per_s_rounds"])
    four, two, ar = result["rows"]  # static γ = 4 (the YAML's default), static γ = 2, AR
    assert ar["tau"] == 1.0 and ar["drafted_tokens"] == ar["wasted_tokens"] == 0
    assert 1.0 <= two["tau"] <= 3.0 and 1.0 <= four["tau"] <= 5.0
    for row in (two, four):
        assert 0 <= row["wasted_tokens"] <= row["drafted_tokens"]
    assert set(result["costs"] or {}) <= {"step_ms", "draft_ms", "accepted_ms"}


def test_head_to_head_fits_the_costs_of_its_own_generations():
    from eagle_backbone.metrics import GenerationStats
    from ldlp.bench.headtohead import _costs

    def timed(f, d, a):  # 12 ms a target pass, 1.5 ms a drafted token, 0.25 ms an accepted one
        return GenerationStats(target_forwards=f, drafted_tokens=d, accepted_tokens=a,
                               wall_s=0.012 * f + 0.0015 * d + 0.00025 * a)

    costs = _costs([timed(30, 0, 0), timed(20, 40, 25), timed(15, 60, 30), timed(12, 96, 35)])
    assert costs["step_ms"] == pytest.approx(12.0) and costs["draft_ms"] == pytest.approx(1.5)
    assert costs["accepted_ms"] == pytest.approx(0.25)
    assert _costs([timed(30, 0, 0), timed(20, 40, 25)]) is None  # two runs cannot separate three costs


def test_head_to_head_takes_the_replay_tuning_best_unless_told_otherwise(tmp_path):
    from omegaconf import OmegaConf

    from ldlp.pipeline import _tuned_best, adaptive_contenders

    tuned = tmp_path / "tuning.json"
    tuned.write_text(json.dumps({"results": [
        {"policy": "static", "params": {"gamma": 6}, "tokens_per_s": 300.0},
        {"policy": "oracle", "params": {"k_max": 8}, "tokens_per_s": 400.0},
        {"policy": "ddd", "params": {"threshold": -2}, "tokens_per_s": 180.0},
        {"policy": "ddd", "params": {"threshold": -4}, "tokens_per_s": 210.0},
        {"policy": "acceptance", "params": {"threshold": 0.3}, "tokens_per_s": 200.0},
        {"policy": "entropy", "params": {"threshold": 5}, "tokens_per_s": 250.0}]}))  # not swept
    summary = {"rows": [{"model": "m", "policy": "acceptance", "speedup": 1.9},
                        {"model": "m", "policy": "ddd", "speedup": 1.7},
                        {"model": "m", "policy": "heuristic", "speedup": 1.8}]}
    cfg = OmegaConf.create({"sweep": {"adaptive": ["ddd", "acceptance", "heuristic", "oracle"]},
                            "head_to_head": {"adaptive": 2, "choose_by": "tuning"}})
    assert adaptive_contenders(cfg, "m", summary, _tuned_best(tuned)) == ["ddd", "acceptance"]
    cfg.head_to_head.choose_by = "sweep"
    assert adaptive_contenders(cfg, "m", summary, _tuned_best(tuned)) == ["acceptance", "heuristic"]
    cfg.head_to_head.choose_by = "tuning"
    assert adaptive_contenders(cfg, "m", summary, _tuned_best(None)) == ["acceptance", "heuristic"]  # no tuning: the sweep


def test_policy_config_composes_one_policy_with_the_checkpoint_folders(tmp_path):
    from omegaconf import OmegaConf

    import eagle_backbone.paths  # noqa: F401
    from ldlp.bench.loaders import policy_config

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


def test_head_to_head_static_contenders_cover_the_sweep_and_the_tuning(tmp_path):
    from omegaconf import OmegaConf

    from ldlp.pipeline import _static_gammas, _tuned_best

    cfg = OmegaConf.create({"sweep": {"static_gammas": [1, 2, 3, 4, 5, 6, 7, 8]}})
    tuned = tmp_path / "tuning.json"
    tuned.write_text(json.dumps({"results": [{"policy": "static", "params": {"gamma": g}, "tokens_per_s": t}
                                             for g, t in ((5, 180.0), (6, 190.0), (8, 170.0))]}))
    assert _static_gammas(cfg, 8, _tuned_best(tuned)) == [5, 6, 7, 8]  # the tuning's best and neighbours, and the sweep's
    assert _static_gammas(cfg, 6, _tuned_best(tuned)) == [5, 6, 7]
    assert _static_gammas(cfg, 8, _tuned_best(None)) == [7, 8]  # no tuning: the sweep's best and its neighbours in the sweep
