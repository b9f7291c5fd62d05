"""Conversation loaders (ShareGPT, MT-bench, prompt lists), their error messages, and prompt building."""

import json

import pytest

from eagle_backbone.data import conversations as conv
from eagle_backbone.data.conversations import (
    DataError,
    build_prompts,
    held_out,
    load_conversations,
)

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "What is x?"}, {"from": "gpt", "value": "x is 1."},
                                  {"from": "human", "value": "And y?"}, {"from": "gpt", "value": "y is 2."}]},
    {"id": "b", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                  {"from": "gpt", "value": "Hello"}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "I start."}, {"from": "human", "value": "Then me."}]},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from eagle_backbone.data.tokenizer import train_bpe_tokenizer

    texts = [t["value"] for c in SHAREGPT for t in c["conversations"]] * 5 + ["USER: ASSISTANT: A chat"] * 5
    return train_bpe_tokenizer(texts, 300, tmp_path_factory.mktemp("tok"))


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_sharegpt_json_and_jsonl_agree(tmp_path):
    a = load_conversations(write(tmp_path / "d.json", json.dumps(SHAREGPT, indent=1)))
    b = load_conversations(write(tmp_path / "d.jsonl", "\n".join(json.dumps(r) for r in SHAREGPT) + "\n\n"))
    assert a == b
    assert [c["id"] for c in a] == ["a", "b", "c"]
    assert a[1]["conversations"][0] == {"from": "system", "value": "Be brief."}


def test_mt_bench_and_prompt_lists(tmp_path):
    mt = write(tmp_path / "question.jsonl", "\n".join(json.dumps(
        {"question_id": 81 + i, "category": "writing", "turns": [f"Q{i}", f"Follow-up {i}"]}) for i in range(3)))
    convs = load_conversations(mt)
    assert [c["id"] for c in convs] == ["81", "82", "83"]
    assert convs[0]["conversations"] == [{"from": "human", "value": "Q0"}, {"from": "human", "value": "Follow-up 0"}]
    txt = load_conversations(write(tmp_path / "p.txt", "first prompt\n\n second \n"))
    assert [c["conversations"][0]["value"] for c in txt] == ["first prompt", " second "]
    assert [c["id"] for c in txt] == ["p:1", "p:3"]  # named by line
    lst = load_conversations(write(tmp_path / "p.json", json.dumps(["one", "two"])))
    assert [c["conversations"][0]["value"] for c in lst] == ["one", "two"]
    objs = load_conversations(write(tmp_path / "q.jsonl", '{"prompt": "one", "id": 7}\n"two"\n'), fmt="prompts")
    assert [(c["id"], c["conversations"][0]["value"]) for c in objs] == [("7", "one"), ("q:2", "two")]


BAD_LINES = [
    ('{"id": 1, "conversations": [{"from": "human", "value": "ok"}]}', None),
    ('{"id": 2, "conversations": [', "invalid JSON"),
    ('{"id": 3}', "cannot tell the format"),
    ('{"id": 4, "conversations": []}', "empty conversation"),
    ('{"id": 5, "conversations": [{"from": "robot", "value": "x"}]}', "unknown role"),
    ('{"id": 6, "conversations": [{"from": "human"}]}', "'from' and 'value'"),
    ('{"id": 7, "conversations": [{"from": "gpt", "value": "only me"}]}', "no human turn"),
    ('{"id": 8, "turns": []}', "non-empty list"),
    ('{"id": 9, "conversations": [{"from": "human", "value": "fine"}]}', None),
]


@pytest.mark.parametrize("line_no", [i for i, (_, err) in enumerate(BAD_LINES) if err])
def test_malformed_jsonl_names_file_and_line(tmp_path, line_no):
    lines = [BAD_LINES[0][0], BAD_LINES[line_no][0]]
    path = write(tmp_path / "bad.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        load_conversations(path)
    assert f"{path}:2" in str(e.value) and BAD_LINES[line_no][1] in str(e.value)


def test_skip_mode_counts_and_keeps_the_good_records(tmp_path, caplog):
    path = write(tmp_path / "bad.jsonl", "\n".join(line for line, _ in BAD_LINES) + "\n")
    with caplog.at_level("WARNING"):
        convs = load_conversations(path, on_error="skip")
        skipped = convs.skipped
    assert [c["id"] for c in convs] == ["1", "9"]
    assert skipped == 7
    assert "skipped 7 malformed record(s)" in caplog.text and str(path) in caplog.text


def test_json_array_errors_name_record_and_line(tmp_path):
    recs = SHAREGPT[:2] + [{"id": "z", "conversations": []}]
    path = write(tmp_path / "arr.json", json.dumps(recs, indent=2))
    with pytest.raises(DataError) as e:
        load_conversations(path)
    starts = [i + 1 for i, text in enumerate(json.dumps(recs, indent=2).splitlines()) if text == "  {"]
    line = starts[2]  # where record 2 starts
    assert f"{path}:{line} (record 2): empty conversation" in str(e.value)
    assert len(load_conversations(path, on_error="skip")) == 2
    broken = write(tmp_path / "broken.json", '[{"id": "a", "conversations": [}]')
    with pytest.raises(DataError, match=r"broken.json:1:\d+: invalid JSON in record 0"):
        load_conversations(broken, on_error="skip")  # cannot be skipped past
    with pytest.raises(DataError, match="not closed"):
        load_conversations(write(tmp_path / "trunc.json", json.dumps(SHAREGPT)[:-1].rstrip("}, ") + "}"))
    with pytest.raises(DataError, match="expected a JSON array"):
        load_conversations(write(tmp_path / "obj.json", json.dumps(SHAREGPT[0])))


@pytest.mark.parametrize("name, text", [("e.jsonl", ""), ("e.json", "  \n"), ("e.txt", "\n\n")])
def test_empty_file(tmp_path, name, text):
    path = write(tmp_path / name, text)
    for mode in ("raise", "skip"):
        with pytest.raises(DataError, match="empty|no valid conversations"):
            load_conversations(path, on_error=mode)


def test_all_records_bad_is_an_error_even_when_skipping(tmp_path):
    path = write(tmp_path / "allbad.jsonl", '{"x": 1}\nnot json\n')
    with pytest.raises(DataError, match=r"no valid conversations \(2 malformed records skipped\)"):
        load_conversations(path, on_error="skip")


def test_bad_arguments(tmp_path):
    path = write(tmp_path / "d.json", json.dumps(SHAREGPT))
    with pytest.raises(ValueError, match="data.format"):
        load_conversations(path, fmt="csv")
    with pytest.raises(ValueError, match="data.on_error"):
        load_conversations(path, on_error="ignore")
    with pytest.raises(ValueError, match="data.limit"):
        load_conversations(path, limit=0)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_conversations(tmp_path / "nope.json")


def test_limit_and_seeded_sample(tmp_path):
    recs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(20)]
    path = write(tmp_path / "d.json", json.dumps(recs))
    assert [c["id"] for c in load_conversations(path, limit=3)] == ["0", "1", "2"]
    a = [c["id"] for c in load_conversations(path, limit=5, sample_seed=0)]
    assert a == [c["id"] for c in load_conversations(path, limit=5, sample_seed=0)]
    assert a == sorted(a, key=int) and a != ["0", "1", "2", "3", "4"]


def test_held_out_is_stable():
    ids = [f"conv{i}" for i in range(2000)]
    chosen = [i for i in ids if held_out(i, 2)]
    assert chosen == [i for i in ids if held_out(i, 2)]
    assert 10 < len(chosen) < 80


def test_build_prompts_first_and_all_turns(tmp_path, tokenizer):
    convs = load_conversations(write(tmp_path / "d.json", json.dumps(SHAREGPT)))
    first = build_prompts(tokenizer, convs, max_prompt_tokens=None, turns="first")
    assert [cid for cid, _ in first] == ["a", "b", "c"]
    text = tokenizer.decode(first[0][1])
    assert text.startswith("<s>") and text.endswith("USER: What is x? ASSISTANT:")
    assert "Be brief. USER: Hi ASSISTANT:" in tokenizer.decode(first[1][1])
    assert "I start" not in tokenizer.decode(first[2][1])  # a leading assistant turn is dropped
    every = build_prompts(tokenizer, convs, max_prompt_tokens=None, turns="all")
    assert [cid for cid, _ in every] == ["a", "a@turn1", "b", "c"]
    assert tokenizer.decode(every[1][1]).endswith("USER: What is x? ASSISTANT: x is 1.</s>USER: And y? ASSISTANT:")
    # MT-bench: the second user turn has no answer before it in the file, so it gives no prompt
    mt = [{"id": "81", "conversations": [{"from": "human", "value": "Q"}, {"from": "human", "value": "Q2"}]}]
    assert [cid for cid, _ in build_prompts(tokenizer, mt, None, turns="all")] == ["81"]


def test_long_prompts_are_dropped_and_counted(tmp_path, tokenizer, caplog):
    convs = load_conversations(write(tmp_path / "d.json", json.dumps(SHAREGPT)))
    lengths = {cid: len(ids) for cid, ids in build_prompts(tokenizer, convs, None, turns="all")}
    cap = lengths["a@turn1"] - 1
    with caplog.at_level("WARNING"):
        prompts = build_prompts(tokenizer, convs, cap, turns="all")
        dropped = prompts.too_long
    assert "a@turn1" not in [cid for cid, _ in prompts] and all(len(ids) <= cap for _, ids in prompts)
    assert dropped == sum(1 for v in lengths.values() if v > cap) and "dropped" in caplog.text
    with pytest.raises(ValueError, match="data.turns"):
        build_prompts(tokenizer, convs, None, turns="some")


def test_named_vicuna_template(tokenizer):
    msgs = [{"from": "human", "value": "Hi"}]
    ids = build_prompts(tokenizer, [{"id": "x", "conversations": msgs}], None, chat_template="vicuna_v1.1")[0][1]
    text = tokenizer.decode(ids)
    assert text == "<s>" + conv.VICUNA_SYSTEM + " USER: Hi ASSISTANT:"


def test_missing_template_is_a_clear_error(tokenizer):
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="data.chat_template"):
        build_prompts(NoTemplate(), [{"id": "x", "conversations": [{"from": "human", "value": "Hi"}]}], None)


def test_embedded_corpus_is_built_when_missing(tmp_path, monkeypatch):
    import eagle_backbone.data.corpus as corpus
    import eagle_backbone.paths as paths

    monkeypatch.setattr(paths, "EMBEDDED_DIR", tmp_path)
    real = corpus.write_corpus
    monkeypatch.setattr(corpus, "write_corpus", lambda d: real(d, corpus.CorpusConfig(max_modules=4)))
    with pytest.raises(FileNotFoundError, match="scripts/build_corpus.py"):  # reading alone never builds it
        load_conversations(tmp_path / "corpus" / "train.json")
    convs = load_conversations(tmp_path / "corpus" / "train.json", build_if_missing=True)
    assert convs and (tmp_path / "corpus" / "validation.json").exists()
    with pytest.raises(FileNotFoundError):  # other folders are never built
        load_conversations(tmp_path / "elsewhere" / "train.json")


def test_min_prompt_tokens_leaves_short_prompts_out_and_counts_them(tokenizer):
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": "word " * n}]} for i, n in enumerate((2, 40, 5, 80))]
    every = build_prompts(tokenizer, convs, None)
    cut = sorted(len(ids) for _, ids in every)[1] + 1
    kept = build_prompts(tokenizer, convs, None, min_prompt_tokens=cut)
    assert [cid for cid, _ in kept] == [cid for cid, ids in every if len(ids) >= cut] and len(kept) == 2
    assert kept.too_short == 2 and kept.too_long == 0
