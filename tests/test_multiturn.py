"""Two-turn MT-bench with the model's own answers, the per-category breakdown and the answer files (issue 14),
on tiny random models saved to temporary folders and a small synthetic question.jsonl."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config, pair_overrides

REPO = Path(__file__).resolve().parent.parent

QUESTIONS = [  # MT-bench layout: two user turns, a category; the last is far too long for max_prompt_tokens
    {"question_id": 81, "category": "writing", "turns": ["Write a short poem about lists.", "Now make it rhyme."]},
    {"question_id": 82, "category": "writing", "turns": ["Explain `os.path.join`.", "Give an example with three parts."]},
    {"question_id": 101, "category": "coding", "turns": ["Write a function that reverses a list.",
                                                        "Make it work for strings too."]},
    {"question_id": 102, "category": "coding", "turns": ["What does `json.dumps` return? " * 60, "And json.loads?"]},
]


@pytest.fixture(scope="module")
def question_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "question.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def two_turn_config(models: Path, questions: Path, extra=()):
    """scripts/evaluate.py's config for both turns of ``questions`` (static γ = 3), ``extra`` overrides last."""
    return compose_config("evaluate", pair_overrides(models) + [
        "data=mt_bench", f"data.path={questions}", "data.limit=null", "data.turns=all", "data.max_prompt_tokens=200",
        "generation.max_new_tokens=10", "evaluation.repeats=2", "evaluation.progress=false", "threads=1",
        "policy=static", "policy.gamma=3", *extra])


@pytest.fixture(scope="module")
def two_turn_run(tiny_models, question_file, tmp_path_factory):
    from ldlp.bench.comparisons.evaluate import evaluate
    from ldlp.report.categories import write_categories

    out = tmp_path_factory.mktemp("run")
    result = evaluate(two_turn_config(tiny_models, question_file), policy_name="static", out_dir=out)
    write_categories(result, out)  # as scripts/evaluate.py does: the rows from bench, the page from report
    return result, out


def test_second_turn_is_prompted_with_the_models_own_first_answer_and_equals_ar(tiny_models, question_file):
    from eagle_backbone.data.conversations import encode_chat
    from eagle_backbone.decoder import SpeculativeDecoder
    from eagle_backbone.policy import StaticPolicy
    from eagle_backbone.sampling import SamplingConfig
    from ldlp.bench.comparisons.conversation import Dialogue, load_questions
    from ldlp.bench.harness.loaders import load_pair_cached
    from ldlp.bench.harness.runners import ar_runner, engine_runner

    cfg = two_turn_config(tiny_models, question_file)
    pair = load_pair_cached(cfg.model)
    questions = load_questions(cfg.data, pair.tokenizer)
    assert questions.mode == "own_answers" and [q.id for q in questions] == ["81", "82", "101"]
    assert questions.info["n_dropped"] == 2 and questions.dropped_by_category == {"coding": 2}
    greedy = SamplingConfig()
    spec = engine_runner("static", SpeculativeDecoder(pair.target, pair.candidates, StaticPolicy(3)), greedy)
    ar = ar_runner("ours", pair.target, greedy)
    dialogue = Dialogue(pair.tokenizer, questions.chat_template, 200, pair.target.max_length,
                        set(pair.target.eos_token_ids))
    for q, raw in zip(questions, QUESTIONS):
        s_turns, a_turns = dialogue.run(spec, q, 10, 0), dialogue.run(ar, q, 10, 0)
        assert [t.prompt_id for t in s_turns] == [q.id, f"{q.id}@turn1"]
        assert [t.tokens for t in s_turns] == [t.tokens for t in a_turns]  # both turns lossless
        answer = s_turns[0].text
        assert answer  # the model's own first answer, decoded
        history = [{"role": "user", "content": raw["turns"][0]}, {"role": "assistant", "content": answer},
                   {"role": "user", "content": raw["turns"][1]}]
        assert s_turns[1].prompt_ids == encode_chat(pair.tokenizer, history, add_generation_prompt=True)
        assert a_turns[1].prompt_ids == s_turns[1].prompt_ids  # AR decoded its own turn 1: the same answer
        assert s_turns[1].prompt_ids[: len(s_turns[0].prompt_ids)] == s_turns[0].prompt_ids
        assert answer in pair.tokenizer.decode(s_turns[1].prompt_ids)


def test_two_turn_evaluation_is_lossless_and_counts_the_dropped(two_turn_run):
    result, out = two_turn_run
    assert result["turn_mode"] == "own_answers" and result["lossless"] is True
    assert result["n_questions"] == 3 and result["n_prompts"] == 6 and result["n_dropped"] == 2
    assert set(result["lossless_mismatches"]) == set()
    saved = json.loads((out / "results.json").read_text())
    assert saved["by_category"]["coding"]["n_dropped"] == 2 and saved["by_category"]["writing"]["n_dropped"] == 0
    assert result["categories_md"] == str(out / "categories.md") and (out / "categories.md").is_file()


def test_category_breakdown_sums_to_the_totals(two_turn_run):
    result, _ = two_turn_run
    by, overall = result["by_category"], result["all_categories"]
    assert list(by) == ["writing", "coding"]
    for key in ("n_questions", "n_prompts", "n_dropped", "new_tokens", "ar_new_tokens", "target_forwards"):
        assert sum(f[key] for f in by.values()) == overall[key], key
    for key in ("wall_s", "ar_wall_s"):
        assert sum(f[key] for f in by.values()) == pytest.approx(overall[key])
    assert overall["new_tokens"] == result["new_tokens"] and overall["target_forwards"] == result["target_forwards"]
    assert overall["ar_new_tokens"] == result["ar_new_tokens"] and overall["n_dropped"] == result["n_dropped"]
    assert overall["n_prompts"] == result["n_prompts"] and overall["tau"] == pytest.approx(result["tau"])
    for f in [*by.values(), overall]:
        assert f["tokens_per_s"] == pytest.approx(f["new_tokens"] / f["wall_s"])
        assert f["speedup"] == pytest.approx(f["tokens_per_s"] / f["ar_tokens_per_s"])
        assert f["lossless"] is True


def specbench_speed(answers: Path, baseline: Path, task: str | None = None) -> dict:
    """Spec-Bench's evaluation/speed.py as documented: per question tokens/s = sum(new_tokens) / sum(wall_time),
    averaged over questions (of ``task``'s category, or all), for the method and the baseline; speedup = the
    ratio of the means; mean accepted tokens = the mean of every accept length. (speed.py recounts the
    baseline's tokens from its text with the tokenizer; here both use new_tokens.)"""
    def load(path):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return [r for r in rows if task in (None, "overall") or r["category"] == task]

    def speeds(rows):
        return [sum(r["choices"][0]["new_tokens"]) / sum(r["choices"][0]["wall_time"]) for r in rows]

    spec, base = load(answers), load(baseline)
    accept = [a for r in spec for a in r["choices"][0]["accept_lengths"]]
    return {"tokens_per_s": np.mean(speeds(spec)), "baseline_tokens_per_s": np.mean(speeds(base)),
            "speedup": np.mean(speeds(spec)) / np.mean(speeds(base)), "mean_accepted_tokens": np.mean(accept)}


def test_answer_files_have_the_format_and_match_the_summary(two_turn_run):
    result, out = two_turn_run
    spec_file, ar_file = Path(result["answers"]["speculative"]), Path(result["answers"]["ar"])
    assert spec_file == out / "answers" / f"{result['model_id']}.jsonl" and result["model_id"] == "tiny-static-g3"
    assert ar_file.name == "tiny-ar.jsonl"
    for path, mid in ((spec_file, result["model_id"]), (ar_file, result["ar_model_id"])):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert [x["question_id"] for x in lines] == [81, 82, 101]  # the file's own integer ids
        for x in lines:
            assert {"question_id", "model_id", "choices", "tstamp"} <= set(x) and x["model_id"] == mid
            assert isinstance(x["tstamp"], float) and len(x["choices"]) == 1
            c = x["choices"][0]
            assert c["index"] == 0 and len(c["turns"]) == len(c["new_tokens"]) == len(c["wall_time"]) == 2
            assert all(isinstance(t, str) for t in c["turns"]) and all(isinstance(n, int) for n in c["new_tokens"])
            assert all(isinstance(w, float) and w > 0 for w in c["wall_time"])
            assert all(isinstance(a, int) and a >= 1 for a in c["accept_lengths"])
    spec = [json.loads(line) for line in spec_file.read_text().splitlines()]
    ar = [json.loads(line) for line in ar_file.read_text().splitlines()]
    assert sum(sum(x["choices"][0]["new_tokens"]) for x in spec) == result["new_tokens"]
    assert sum(sum(x["choices"][0]["new_tokens"]) for x in ar) == result["ar_new_tokens"]
    assert sum(sum(x["choices"][0]["wall_time"]) for x in spec) == pytest.approx(result["all_categories"]["wall_s"])
    assert sum(sum(x["choices"][0]["wall_time"]) for x in ar) == pytest.approx(result["all_categories"]["ar_wall_s"])
    assert [x["choices"][0]["turns"] for x in spec] == [x["choices"][0]["turns"] for x in ar]  # greedy: same text
    # Spec-Bench's speed computation on our files gives our summary's figures, per category and overall
    for task, ours in [("overall", result["all_categories"]), *result["by_category"].items()]:
        if not ours["n_questions"]:
            continue
        theirs = specbench_speed(spec_file, ar_file, task)
        assert theirs["tokens_per_s"] == pytest.approx(ours["mean_tokens_per_s"])
        assert theirs["baseline_tokens_per_s"] == pytest.approx(ours["ar_mean_tokens_per_s"])
        assert theirs["speedup"] == pytest.approx(ours["specbench_speedup"])
        assert theirs["mean_accepted_tokens"] == pytest.approx(ours["mean_accepted_tokens"])


def test_summary_rows_carry_the_categories(two_turn_run, tmp_path):
    """The summary's row keeps the run's per-category figures (its Spec-Bench table is written from them)."""
    from ldlp.report.summary import summarize

    result, out = two_turn_run
    summary = summarize([out], tmp_path / "summary")
    [row] = summary["rows"]
    assert (row["policy"], row["gamma"]) == ("static", 3) and list(row["by_category"]) == ["writing", "coding"]
    assert row["by_category"]["writing"]["new_tokens"] == result["by_category"]["writing"]["new_tokens"]
    assert row["all_categories"]["n_prompts"] == result["all_categories"]["n_prompts"]


def test_sampling_keeps_one_stream_per_conversation(tiny_models, question_file):
    from eagle_backbone.decoder import autoregressive_generate
    from ldlp.bench.comparisons.evaluate import evaluate
    from ldlp.bench.harness.loaders import load_pair_cached

    cfg = two_turn_config(tiny_models, question_file, ["generation.temperature=0.9", "evaluation.repeats=1"])
    first = evaluate(cfg, policy_name="static")
    again = evaluate(cfg, policy_name="static")
    assert first["lossless"] is None and first["n_prompts"] == 6
    for key in ("new_tokens", "target_forwards", "drafted_tokens", "ar_new_tokens"):
        assert first[key] == again[key]  # the same seeded stream per conversation in every run
    # a generator passed to the engine continues its stream: the second call differs from a reseeded one
    target = load_pair_cached(cfg.model).target
    from eagle_backbone.sampling import SamplingConfig

    hot = SamplingConfig(temperature=5.0)
    g = torch.Generator().manual_seed(7)
    a = autoregressive_generate(target, [1, 5, 6], 12, sampling=hot, seed=g).tokens
    b = autoregressive_generate(target, [1, 5, 6], 12, sampling=hot, seed=g).tokens
    fresh = torch.Generator().manual_seed(7)
    assert a == autoregressive_generate(target, [1, 5, 6], 12, sampling=hot, seed=fresh).tokens and a != b


def test_head_to_head_rows_carry_seconds_and_tokens_per_category(tiny_models, question_file):
    from ldlp.bench.comparisons.headtohead import head_to_head
    from ldlp.report.headtohead import head_to_head_markdown

    cfg = two_turn_config(tiny_models, question_file, ["data.turns=first"])
    two = two_turn_config(tiny_models, question_file, ["policy.gamma=2"]).policy
    result = head_to_head(cfg, [("static", cfg.policy), ("static", two)], rounds=2, bootstrap=20)
    assert result["categories"] == ["writing", "writing", "coding"]  # the too-long coding question dropped
    secs, tokens = np.array(result["seconds"]), np.array(result["tokens"])
    for i, row in enumerate(result["rows"]):
        by = row["by_category"]
        assert list(by) == ["writing", "coding"] and by["coding"]["n_prompts"] == 1
        assert sum(f["new_tokens"] for f in by.values()) == tokens[i].sum()
        assert sum(f["seconds"] for f in by.values()) == pytest.approx(secs[i].sum() / 2)
    assert all(f["speedup"] == pytest.approx(1.0) for f in result["rows"][-1]["by_category"].values())  # AR
    assert head_to_head_markdown(result).startswith("### Head to head (")  # renders, from the rows above


def test_spec_bench_tasks_pool_mt_bench_categories():
    from ldlp.bench.comparisons.categories import category_rows, specbench_tasks
    from ldlp.report.categories import category_markdown

    def row(qid, cat, tokens, secs):
        return {"question_id": qid, "category": cat, "n_turns": len(tokens), "turns": ["x"] * len(tokens),
                "new_tokens": tokens, "wall_time": secs, "target_forwards": [t // 2 for t in tokens],
                "accept_lengths": [2] * sum(t // 2 for t in tokens), "ar_new_tokens": tokens,
                "ar_wall_time": [2 * s for s in secs], "n_dropped": 0, "lossless": True}

    rows = [row("1", "writing", [10, 8], [1.0, 1.0]), row("2", "coding", [6, 6], [1.0, 0.5]),
            row("3", "translation", [12], [2.0]), row("4", "summarization", [4], [1.0])]
    tasks = specbench_tasks(rows, {"summarization": 3})
    assert list(tasks) == ["mt_bench", "translation", "summarization"]
    assert tasks["mt_bench"]["n_questions"] == 2 and tasks["summarization"]["n_dropped"] == 3
    assert tasks["mt_bench"]["mean_tokens_per_s"] == pytest.approx((18 / 2 + 12 / 1.5) / 2)
    assert tasks["mt_bench"]["specbench_speedup"] == pytest.approx(2.0)
    by, overall = category_rows(rows, {"summarization": 3})
    assert sum(f["n_dropped"] for f in by.values()) == overall["n_dropped"] == 3
    assert {k: by["summarization"][k] for k in ("n_questions", "n_prompts", "n_dropped")} == {
        "n_questions": 1, "n_prompts": 1, "n_dropped": 3}
    assert category_markdown([("p", by, overall, tasks)]).startswith("#### Per category")  # renders, from these
    assert specbench_tasks(rows[:2]) == {}  # MT-bench alone: its categories are the tasks
