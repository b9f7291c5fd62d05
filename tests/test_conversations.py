"""Conversation loaders (ShareGPT, MT-bench, prompt lists), their error messages, and prompt building: ids are
unique, and user text never becomes control tokens."""

import json

import pytest
from conftest import one_line

from eagle_backbone.data import conversations as conv
from eagle_backbone.data.conversations import (
    DataError,
    build_prompts,
    held_out,
    load_conversations,
)
from eagle_backbone.paths import REPO_ROOT

EMBEDDED = REPO_ROOT / "data" / "embedded"

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


# -- user text never becomes control tokens; ids are unique


def _conv(*turns):
    return {"id": "c0", "conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": t}
                                          for i, t in enumerate(turns)]}


@pytest.mark.parametrize("folder", ["tokenizer", "target"])
@pytest.mark.parametrize("template", [None, "vicuna_v1.1"])
def test_literal_special_markers_in_user_text_are_text(folder, template):
    from eagle_backbone.data.conversations import build_prompts, encode_chat, render, to_messages
    from eagle_backbone.loading import load_tokenizer

    tok = load_tokenizer(EMBEDDED / folder)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    user = "What do </s> and <s> mean in a tokenizer? And <pad>, <unk>?"
    conv = _conv("Hi.", "Hello! How can I help?", user, "They are markers.", user)
    prompts = build_prompts(tok, [conv], None, turns="all", chat_template=template)
    ids = prompts[-1][1]  # three user turns, two answers: the template's BOS once, its EOS after each answer
    assert ids.count(bos) == 1 and ids[0] == bos
    assert ids.count(eos) == 2
    assert tok.pad_token_id not in ids and tok.unk_token_id not in ids
    assert tok.decode(ids).count("</s>") == 2 + 2  # the template's two, the user's two, as text
    # nothing is lost: the ids decode to the rendering
    from eagle_backbone.data.conversations import NAMED_CHAT_TEMPLATES

    tmpl = NAMED_CHAT_TEMPLATES.get(template, template)
    assert tok.decode(ids) == render(tok, to_messages(conv["conversations"]), True, tmpl)
    # without any marker in the messages the ids are the plain rendering's, as before
    plain = _conv("Hi.", "Hello! How can I help?", "What is a tokenizer?")
    text = render(tok, to_messages(plain["conversations"]), True, tmpl)
    assert encode_chat(tok, to_messages(plain["conversations"]), True, tmpl) == \
        tok(text, add_special_tokens=False)["input_ids"]


def test_any_loaded_tokenizer_keeps_user_markers_as_text(tmp_path):
    """A ChatML-style tokenizer (other special strings, markers around every turn), saved and loaded back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from eagle_backbone.data.conversations import build_prompts
    from eagle_backbone.loading import load_tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    raw.train_from_iterator(["user assistant what is a marker", "hello there"] * 10,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    user = "what is <|im_end|> or <|im_start|>system or <|endoftext|>?"
    [(_, ids)] = build_prompts(tok, [_conv(user)], None)
    assert ids.count(start) == 2 and ids.count(end) == 1  # the template's: user turn, generation prompt
    assert tok.convert_tokens_to_ids("<|endoftext|>") not in ids
    assert tok.decode(ids) == f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def test_training_text_keeps_user_markers_as_text():
    from eagle_backbone.data.conversations import encode_chat, to_messages
    from eagle_backbone.loading import load_tokenizer
    from eagle_backbone.train.lm import packed_blocks

    tok = load_tokenizer(EMBEDDED / "tokenizer")
    conv = _conv("what is </s> or <s>?", "a marker.", "and </s>?", "text.")
    one = encode_chat(tok, to_messages(conv["conversations"]))
    blocks = packed_blocks(tok, [conv] * 4, block_size=len(one)).with_format(None)["input_ids"]
    assert blocks == [one] * 4
    assert one.count(tok.eos_token_id) == 2 and one.count(tok.bos_token_id) == 1  # the template's: 2 answers, 1 BOS
    assert tok.decode(one).count("</s>") == 2 + 2


def test_duplicate_question_ids_are_refused_at_load(tmp_path):
    q = tmp_path / "question.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                         for i, c, t in ((1, "math", "2+2?"), (2, "code", "Sort."), (1, "writing", "A poem."))))
    with pytest.raises(DataError) as e:
        load_conversations(q)
    assert f"{q}:3: duplicate id '1' (first at {q}:1)" in one_line(e)
    # skipping malformed records skips the repeat, counted, never a second prompt under the same id
    kept = load_conversations(q, on_error="skip")
    assert [c["id"] for c in kept] == ["1", "2"] and kept.skipped == 1
