"""Issue 13: silent wrong results and errors that were tracebacks. Each test fails on the code before its fix."""

import json
from pathlib import Path

import pytest
import torch
from conftest import compose_config, make_target, pair_overrides, save_tiny_pair, tiny_llama_config
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from eagle_backbone.paths import REPO_ROOT
from eagle_backbone.policy import DraftLengthPolicy

EMBEDDED = REPO_ROOT / "data" / "embedded"


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


# -- 2. every loader fails on missing or unexpected keys ----------------------------------------------


def test_eagle_drafter_folder_loaded_as_draft_lm_fails_in_one_line():
    from eagle_backbone.loading import load_drafter

    with pytest.raises(ValueError) as e:
        load_drafter("draft_lm", EMBEDDED / "drafter")
    msg = _one_line(e)
    assert str(EMBEDDED / "drafter") in msg
    assert "lm_head.weight" in msg and "model.norm.weight" in msg and "fc.weight" in msg
    assert "drafter_kind=eagle" in msg


def _save_llama(path: Path, tie: bool = False, drop: str | None = None, add: str | None = None) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tied_config() if tie else tiny_llama_config())
    model.save_pretrained(path)
    if drop or add:
        state = load_file(str(path / "model.safetensors"))
        if drop:
            del state[drop]
        if add:
            state[add] = torch.zeros(3)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _tied_config():
    cfg = tiny_llama_config()
    cfg.tie_word_embeddings = True
    return cfg


def test_target_with_missing_or_unexpected_weights_is_refused(tmp_path):
    from eagle_backbone.target import TargetModel

    with pytest.raises(ValueError) as e:
        TargetModel.from_pretrained(_save_llama(tmp_path / "missing", drop="model.norm.weight"))
    assert "model.norm.weight" in _one_line(e) and "missing" in str(e.value)
    with pytest.raises(ValueError) as e:
        TargetModel.from_pretrained(_save_llama(tmp_path / "extra", add="extra.weight"))
    assert "extra.weight" in _one_line(e) and "unexpected" in str(e.value)
    path = _save_llama(tmp_path / "shape")
    state = load_file(str(path / "model.safetensors"))
    state["model.norm.weight"] = torch.ones(5)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        TargetModel.from_pretrained(path)
    assert "model.norm.weight (5,) (config implies (32,))" in _one_line(e) and str(path) in str(e.value)
    # a tied output head is not missing: it is the embedding
    tied = TargetModel.from_pretrained(_save_llama(tmp_path / "tied", tie=True))
    assert tied.lm_head.weight.data_ptr() == tied.embed_tokens.weight.data_ptr()


def test_drafter_without_embedding_is_the_one_documented_exception(tmp_path, target, drafter):
    from eagle_backbone.drafter import EagleDrafter
    from eagle_backbone.loading import tie_drafter_embedding

    drafter.save_pretrained(tmp_path / "d")
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    del state["embed_tokens.weight"]
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    loaded = EagleDrafter.from_pretrained(tmp_path / "d", dtype=torch.float64)
    assert loaded.has_own_embedding is False
    assert tie_drafter_embedding(loaded, target)
    assert torch.equal(loaded.embed_tokens.weight, target.embed_tokens.weight)
    del state["fc.weight"]  # any other key missing is refused
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        EagleDrafter.from_pretrained(tmp_path / "d")


def test_heads_with_missing_or_unexpected_keys_are_refused(tmp_path):
    from ldlp.models.acceptance import AcceptanceHead, AcceptanceHeadConfig
    from ldlp.models.predictor import LDLP, LDLPConfig

    LDLP(LDLPConfig(input_dim=8)).save_pretrained(tmp_path / "ldlp")
    AcceptanceHead(AcceptanceHeadConfig(hidden_size=4, k_max=8)).save_pretrained(tmp_path / "acc")
    for folder, cls in ((tmp_path / "ldlp", LDLP), (tmp_path / "acc", AcceptanceHead)):
        state = load_file(str(folder / "model.safetensors"))
        state["stray.weight"] = torch.zeros(2)
        state.pop(sorted(state)[0])
        save_file(state, str(folder / "model.safetensors"))
        with pytest.raises(ValueError) as e:
            cls.from_pretrained(folder)
        msg = _one_line(e)
        assert str(folder / "model.safetensors") in msg and "stray.weight" in msg and "missing keys" in msg


# -- 7. truncated or corrupt weight files: one line naming the file ------------------------------------


def _truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("kind", ["target", "drafter", "draft_lm", "ldlp", "acceptance"])
def test_truncated_weights_name_the_file(tmp_path, kind, drafter):
    from eagle_backbone.drafter import EagleDrafter
    from eagle_backbone.loading import load_drafter
    from eagle_backbone.target import TargetModel
    from ldlp.models.acceptance import AcceptanceHead, AcceptanceHeadConfig
    from ldlp.models.predictor import LDLP, LDLPConfig

    folder = tmp_path / kind
    if kind in ("target", "draft_lm"):
        _save_llama(folder)
        load = (lambda: TargetModel.from_pretrained(folder)) if kind == "target" else (
            lambda: load_drafter("draft_lm", folder))
    elif kind == "drafter":
        drafter.save_pretrained(folder)
        load = lambda: EagleDrafter.from_pretrained(folder)  # noqa: E731
    elif kind == "ldlp":
        LDLP(LDLPConfig(input_dim=8)).save_pretrained(folder)
        load = lambda: LDLP.from_pretrained(folder)  # noqa: E731
    else:
        AcceptanceHead(AcceptanceHeadConfig(hidden_size=4, k_max=8)).save_pretrained(folder)
        load = lambda: AcceptanceHead.from_pretrained(folder)  # noqa: E731
    _truncate(folder / "model.safetensors")
    with pytest.raises(ValueError) as e:
        load()
    msg = _one_line(e)
    assert str(folder / "model.safetensors") in msg and "truncated or corrupt" in msg


# -- 1. runs on different prompt sets never share a row; 6. dropped prompts are carried and stated ---------


REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    save_tiny_pair(root, 4096, layers=1, head_scale=None)
    return root


def _eval_cfg(models: Path, prompts: Path, extra=()):
    return compose_config("evaluate", pair_overrides(models, "float32") + [
        "data=mt_bench", f"data.path={prompts}", "generation.max_new_tokens=4", "evaluation.repeats=1", "evaluation.warmup=0",
        "evaluation.calibration_prompts=1", "evaluation.progress=false", "threads=1",
        *([] if any(x.startswith("policy=") for x in extra) else ["policy=static", "policy.gamma=2"]), *extra])


def _question_file(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question_id": i, "turns": [q]}) + "\n" for i, q in enumerate(questions)))
    return path


def test_results_json_identifies_the_prompt_file_and_counts_dropped_prompts(tiny_pair, tmp_path):
    from ldlp.bench.evaluate import evaluate
    from ldlp.bench.loaders import file_sha256

    prompts = _question_file(tmp_path / "q.jsonl", ["Hello there.", "word " * 400, "What is 2 + 2?", "Hi."])
    cfg = _eval_cfg(tiny_pair, prompts, ["data.limit=3", "data.sample_seed=5", "data.max_prompt_tokens=64"])
    result = evaluate(cfg, policy_name="static", out_dir=tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["data_path"] == str(prompts) and saved["data_sha256"] == file_sha256(prompts)
    assert (saved["limit"], saved["sample_seed"], saved["turns"]) == (3, 5, "first")
    assert saved["n_prompts"] + saved["n_dropped"] == 3 and saved["n_dropped"] == 1
    assert "max_prompt_tokens=64" in saved["dropped_reason"]
    assert result["n_dropped"] == 1


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
    out = summarize(runs, tmp_path / "out")
    assert "never merged" in out["markdown"] and len(out["headline"]) == 2


def test_old_results_without_the_prompt_file_hash_get_one_warning(tmp_path, caplog):
    from ldlp.report.summary import aggregate, find_results

    old = [{k: v for k, v in _result(tokens_per_s=t).items() if k not in ("data_sha256", "limit", "sample_seed")}
           for t in (1.0, 2.0, 3.0)]
    with caplog.at_level("WARNING", logger="ldlp.report.summary"):
        aggregate(find_results(_write_runs(tmp_path, old)))
    warnings = [r for r in caplog.records if "predate the prompt-file hash" in r.getMessage()]
    assert len(warnings) == 1 and "3 of 3" in warnings[0].getMessage()


def test_dropped_prompts_are_in_the_table_and_stated_over_5_percent(tmp_path):
    from ldlp.report.summary import summarize

    few = summarize(_write_runs(tmp_path / "few", [_result(n_prompts=99, n_dropped=1, dropped_reason="longer than "
                                                           "max_prompt_tokens=1536")]), tmp_path / "o1")
    header = next(line for line in few["markdown"].splitlines() if line.startswith("Prompt set"))
    assert "1 dropped: longer than max_prompt_tokens=1536" in header and "**1 of" not in header
    many = summarize(_write_runs(tmp_path / "many", [_result(n_prompts=56, n_dropped=24, dropped_reason="longer than "
                                                             "max_prompt_tokens=1536")]), tmp_path / "o2")
    header = next(line for line in many["markdown"].splitlines() if line.startswith("Prompt set"))
    assert "**24 of 80 prompts (30%) dropped: longer than max_prompt_tokens=1536**" in header
    assert "n_dropped" in (tmp_path / "o2" / "results.csv").read_text().splitlines()[0]


def test_head_to_head_table_states_dropped_prompts():
    from ldlp.bench.headtohead import dropped_note  # the head to head's header line carries it

    result = {"n_prompts": 56, "n_dropped": 24, "dropped_reason": "longer than max_prompt_tokens=1536"}
    assert dropped_note(result) == " (**24 of 80 prompts (30%) dropped: longer than max_prompt_tokens=1536**)"
    assert dropped_note({**result, "n_prompts": 976}) == " (24 dropped: longer than max_prompt_tokens=1536)"


# -- 3. training refuses an incomplete oracle collection unless allow_partial=true --------------------


def _partial_collection(root: Path, planned: int, num_shards: int = 2) -> Path:
    """An oracle folder (drafter states stored) whose manifest plans ``planned`` sequences; 8 are on disk."""
    from test_acceptance import mimic_pair, prompts, write_collection

    target, drafter = mimic_pair()
    oracle = write_collection(root / "oracle", target, drafter, prompts(6, seed=1), prompts(2, seed=2))
    for meta, n in ((oracle / "train" / "000-of-001.00000.json", 6), (oracle / "validation" / "000-of-001.00000.json", 2)):
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "sequences": n}))
    manifest = json.loads((oracle / "manifest.json").read_text())
    manifest.update(num_prompts=planned, config={"num_shards": num_shards})
    (oracle / "manifest.json").write_text(json.dumps(manifest))
    return oracle


def test_acceptance_training_refuses_an_incomplete_collection(tmp_path):
    from omegaconf import OmegaConf

    from ldlp.training.acceptance import train_acceptance_head

    oracle = _partial_collection(tmp_path, planned=13)
    cfg = OmegaConf.create({"oracle_dir": str(oracle), "out_dir": str(tmp_path / "head"), "C": 0.5, "seed": 0,
                            "val_fraction": 0.1, "max_examples": None, "allow_partial": False})
    with pytest.raises(ValueError) as e:
        train_acceptance_head(cfg)
    msg = _one_line(e)
    assert "5 of 13 sequences are missing" in msg and f"python scripts/collect_oracle.py out_dir={oracle}" in msg
    assert "num_shards=2" in msg and "allow_partial=true" in msg
    assert not (tmp_path / "head").exists()
    cfg.allow_partial = True
    train_acceptance_head(cfg)
    meta = json.loads((tmp_path / "head" / "config.json").read_text())["meta"]
    assert meta["allow_partial"] is True and meta["oracle_collection"]["missing_sequences"] == 5
    from ldlp.models.acceptance import AcceptanceHead

    assert AcceptanceHead.from_pretrained(tmp_path / "head").config.meta["allow_partial"] is True


def test_a_complete_collection_trains_without_the_override(tmp_path):
    from ldlp.labels.store import require_complete

    status = require_complete(_partial_collection(tmp_path, planned=8, num_shards=1))
    assert status["complete"] is True and status["missing_sequences"] == 0 and status["allow_partial"] is False


def test_ldlp_training_refuses_an_incomplete_collection_and_records_the_override(tmp_path):
    from hydra import compose, initialize_config_dir
    from test_ldlp import tiny_target_folder, write_oracle

    import eagle_backbone.paths  # noqa: F401
    from ldlp.models.predictor import LDLP
    from ldlp.training.predictor import run_ldlp_training

    target = tiny_target_folder(tmp_path / "target")
    oracle = write_oracle(tmp_path / "oracle", n_conversations=5, rows_per_conv=6, d=32, store_features=True)
    for meta in oracle.glob("*/*.json"):
        meta.write_text(json.dumps({"sequences": 4 if meta.parent.name == "train" else 1}))
    manifest = json.loads((oracle / "manifest.json").read_text())
    (oracle / "manifest.json").write_text(json.dumps({**manifest, "num_prompts": 7, "config": {"num_shards": 1}}))
    overrides = [f"model.target={target}", f"ldlp_training.oracle_dir={oracle}", f"ldlp_training.out_dir={tmp_path / 'o'}",
                 f"ldlp_training.feature_cache={tmp_path / 'cache'}", "ldlp.hidden_dim=8", "trainer.max_epochs=1",
                 "trainer.enable_progress_bar=false", "ldlp_training.evaluation.baselines=[constant]",
                 "ldlp_training.evaluation.benchmark=false", f"logger.save_dir={tmp_path}",
                 f"trainer.default_root_dir={tmp_path}", "threads=1"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train_ldlp", overrides=overrides)
        cfg_partial = compose(config_name="train_ldlp", overrides=overrides + ["allow_partial=true"])
    with pytest.raises(ValueError) as e:
        run_ldlp_training(cfg)
    assert "2 of 7 sequences are missing" in _one_line(e) and "allow_partial=true" in str(e.value)
    run_ldlp_training(cfg_partial)
    meta = LDLP.from_pretrained(tmp_path / "o").config.meta
    assert meta["allow_partial"] is True and meta["oracle_collection"]["missing_sequences"] == 2


# -- 4. user text never becomes control tokens -------------------------------------------------------


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


# -- 7. heads and drafters of the wrong size fail when the decoder is built, before any generation ------


def test_heads_of_the_wrong_size_fail_before_any_generation(tmp_path, target, drafter):
    from eagle_backbone.candidates import DraftModelCandidateGenerator, EagleCandidateGenerator
    from eagle_backbone.engine import SpeculativeDecoder
    from ldlp.models.acceptance import AcceptanceHead, AcceptanceHeadConfig
    from ldlp.policies.threshold import AcceptancePolicy, LDLPDDDPolicy, LDLPPolicy
    from ldlp.models.predictor import LDLP, LDLPConfig

    d = target.hidden_size
    cands = EagleCandidateGenerator(drafter, target)
    AcceptanceHead(AcceptanceHeadConfig(hidden_size=d + 4, k_max=8)).save_pretrained(tmp_path / "acc")
    LDLP(LDLPConfig(input_dim=2 * (d + 4))).save_pretrained(tmp_path / "ldlp")
    for policy, what in ((AcceptancePolicy(str(tmp_path / "acc")), f"hidden_size={d + 4}"),
                         (LDLPPolicy(str(tmp_path / "ldlp")), f"input_dim={2 * (d + 4)}"),
                         (LDLPDDDPolicy(str(tmp_path / "ldlp")), f"input_dim={2 * (d + 4)}")):
        with pytest.raises(ValueError) as e:
            SpeculativeDecoder(target, cands, policy)
        msg = _one_line(e)
        assert what in msg and str(d) in msg and "train" in msg
    # the right sizes build; an acceptance head with a draft LM (no drafter states) fails at once
    AcceptanceHead(AcceptanceHeadConfig(hidden_size=d, k_max=8)).save_pretrained(tmp_path / "acc_ok")
    SpeculativeDecoder(target, cands, AcceptancePolicy(str(tmp_path / "acc_ok")))
    draft_lm = LlamaForCausalLM(tiny_llama_config(layers=1)).double()
    with pytest.raises(ValueError, match="drafter_kind=eagle"):
        SpeculativeDecoder(target, DraftModelCandidateGenerator(draft_lm, target), AcceptancePolicy(str(tmp_path / "acc_ok")))
    # a drafter trained for another target fails when its generator is built
    from conftest import make_drafter

    other = make_drafter(make_target(d=48))
    with pytest.raises(ValueError, match="hidden size 48 != target hidden size"):
        EagleCandidateGenerator(other, target)


def test_a_torn_last_checkpoint_with_resume_fails_in_one_line(tmp_path):
    from hydra import compose, initialize_config_dir
    from test_ldlp import write_oracle

    import eagle_backbone.paths  # noqa: F401
    from ldlp.training.predictor import run_ldlp_training

    oracle = write_oracle(tmp_path / "oracle", n_conversations=5, rows_per_conv=6, d=32, store_features=True)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    import zipfile

    with zipfile.ZipFile(ckpt / "whole.ckpt", "w") as z:  # what torch.save writes: a zip archive
        z.writestr("archive/data.pkl", b"x" * 5000)
    data = (ckpt / "whole.ckpt").read_bytes()
    (ckpt / "last.ckpt").write_bytes(data[: len(data) // 2])
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train_ldlp", overrides=[
            f"model.target={tmp_path / 'no_target_needed'}", f"ldlp_training.oracle_dir={oracle}",
            f"ldlp_training.ckpt_dir={ckpt}", "resume=true", f"logger.save_dir={tmp_path}",
            f"trainer.default_root_dir={tmp_path}"])
    with pytest.raises(ValueError) as e:  # before the target is loaded (there is none)
        run_ldlp_training(cfg)
    msg = _one_line(e)
    assert str(ckpt / "last.ckpt") in msg and "torn or corrupt" in msg and "resume=false" in msg
    from ldlp.training.predictor import check_checkpoint

    torch.save({"state_dict": {"w": torch.zeros(3)}, "epoch": 1}, ckpt / "good.ckpt")
    check_checkpoint(ckpt / "good.ckpt")  # a whole one passes
    # the LM and drafter trainers (resume=true by default) check theirs too, before fit
    from eagle_backbone.train.lm import fit_resumable

    trainer = {"_target_": "lightning.pytorch.Trainer", "default_root_dir": str(tmp_path), "logger": False,
               "enable_progress_bar": False}
    with pytest.raises(ValueError) as e:
        fit_resumable(None, None, trainer, None, ckpt, resume=True)
    assert str(ckpt / "last.ckpt") in _one_line(e) and "torn or corrupt" in str(e.value)


# -- 8. cheap inputs are validated before any weights load --------------------------------------------


@pytest.mark.parametrize("bad", ["data", "policy", "checkpoint"])
def test_bad_inputs_fail_before_the_models_load(tmp_path, monkeypatch, bad):
    import ldlp.bench.evaluate as ev

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


# -- 5. the LDLP timing: interleaved medians, threads respected, a step far off the last one flagged ------


def test_ldlp_benchmark_interleaves_respects_threads_and_flags_a_step_far_off(tmp_path, target, monkeypatch):
    from eagle_backbone.runtime import set_threads
    from ldlp.models.policy_cost import HISTORY_FILE, benchmark_ldlp
    from ldlp.models.predictor import LDLP, LDLPConfig

    ldlp = LDLP(LDLPConfig(input_dim=2 * target.hidden_size, hidden_dim=8)).double().eval()
    calls = []
    predict, forward = ldlp.predict_length, type(target).forward
    monkeypatch.setattr(ldlp, "predict_length", lambda *a: calls.append("ldlp") or predict(*a))
    monkeypatch.setattr(type(target), "forward", lambda self, *a, **k: calls.append("target") or forward(self, *a, **k))
    before = torch.get_num_threads()
    set_threads(1)
    try:
        t = benchmark_ldlp(ldlp, target, context_len=16, reps=20, history=tmp_path / HISTORY_FILE)
        assert torch.get_num_threads() == 1 and t["threads"] == 1  # the benchmark left the threads as set
    finally:
        torch.set_num_threads(before)
    timed = calls[calls.index("target", 1):]  # after the context's prefill
    assert t["interleaved"] and t["reps"] == 20 and timed.count("target") >= 20 and timed.count("ldlp") >= 20
    # every repetition has one of each: the two never run in long blocks of their own
    runs = max(len(list(g)) for _, g in __import__("itertools").groupby(timed))
    assert runs <= 2, timed[:40]
    assert t["flag"] is None and t["last_target_step_ms"] is None  # nothing measured before
    history = json.loads((tmp_path / HISTORY_FILE).read_text())
    [(setting, last)] = history.items()
    # a recorded step 10x faster than today's: flagged, in the dict and in metrics.md
    history[setting]["target_step_ms"] = t["target_step_ms"] / 10
    (tmp_path / HISTORY_FILE).write_text(json.dumps(history))
    from ldlp.models.policy_cost import check_step_cost

    checked = check_step_cost(tmp_path / HISTORY_FILE, t, setting)
    assert checked["flag"] and "more than 3x off" in checked["flag"] and checked["ratio_to_last"] == pytest.approx(10)
    assert check_step_cost(tmp_path / HISTORY_FILE, {**t, "target_step_ms": t["target_step_ms"] / 5}, setting)["flag"] is None
    from ldlp.training.baselines import ldlp_metrics_markdown

    md = ldlp_metrics_markdown({"head": "regression", "val_rows": 1, "train_rows": 1, "k_max": 4, "under_weight": 3.0,
                                "results": {"LDLP": {"mae": 1.0}}, "timing": {**t, **checked}})
    assert "**Timing flagged**" in md and "interleaved" in md


# -- speculative sampling stays exact with the EAGLE drafter and adaptive policies ---------------------


class RandomGamma(DraftLengthPolicy):
    """γ drawn at random every step (from its own generator, not the sampler's): a per-sequence policy, the
    slow path (eagle_backbone.policy.PerSlot)."""

    name, adaptive = "random_gamma", True

    def __init__(self, max_gamma=4, seed=0):
        self.rng, self.max_gamma = torch.Generator().manual_seed(seed), max_gamma

    def begin(self, prompt_ids):
        pass

    def gamma(self, ctx):
        return int(torch.randint(0, self.max_gamma + 1, (1,), generator=self.rng))

    def keep_drafting(self, ctx, i, token, probs):
        return True

    def observe(self, ctx, drafted, accepted):
        pass


@pytest.fixture(scope="module")
def tiny_eagle_pair(tmp_path_factory):
    from conftest import make_drafter

    target = make_target(seed=11, vocab=4, d=16, layers=1, eos=None)
    target.eos_token_ids = set()
    drafter = make_drafter(target, seed=5)
    with torch.no_grad():  # a poor drafter: many rejections, so the residual matters (the power check's point)
        drafter.fc.weight.mul_(3.0)
    from ldlp.models.predictor import LDLP, LDLPConfig

    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp("ldlp") / "ldlp"
    LDLP(LDLPConfig(input_dim=32, hidden_dim=8, k_max=4)).save_pretrained(folder)
    return target, drafter, folder


def _policy(kind, ldlp_folder):
    from eagle_backbone.policy import StaticPolicy
    from ldlp.policies.threshold import ConfidencePolicy, LDLPPolicy

    if kind == "static":
        return StaticPolicy(2)
    if kind == "random":
        return RandomGamma()
    if kind == "threshold":
        return ConfidencePolicy(threshold=0.4, max_gamma=4)
    return LDLPPolicy(str(ldlp_folder), max_gamma=4, offset=1)


def _eagle_counts(target, drafter, policy, prompt, length, cfg, n):
    from eagle_backbone.candidates import EagleCandidateGenerator
    from eagle_backbone.engine import SpeculativeDecoder

    dec = SpeculativeDecoder(target, EagleCandidateGenerator(drafter, target), policy)
    counts = {}
    for seed in range(n):
        seq = tuple(dec.generate(prompt, length, cfg, seed=seed).tokens)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("kind", ["static", "random", "threshold", "ldlp"])
def test_eagle_and_adaptive_policies_sample_the_target_distribution(tiny_eagle_pair, kind, temperature):
    from test_sampling import _chi2_pvalue, _exact_sequence_distribution

    from eagle_backbone.sampling import SamplingConfig

    target, drafter, folder = tiny_eagle_pair
    cfg, prompt, n = SamplingConfig(temperature=temperature), [1, 3], 1500  # seeded: the p-values are fixed
    probs = _exact_sequence_distribution(target, prompt, 3, cfg)
    counts = _eagle_counts(target, drafter, _policy(kind, folder), prompt, 3, cfg, n)
    assert _chi2_pvalue(counts, probs, n) > 1e-3


@pytest.mark.parametrize("kind", ["random", "ldlp"])
def test_a_broken_residual_is_detected_with_eagle_and_adaptive_policies(tiny_eagle_pair, monkeypatch, kind):
    """The test above has power: with the same samples' size and seeds, resampling from p instead of
    max(p - q, 0) gives p-values far below its acceptance level of 1e-3."""
    from test_sampling import _chi2_pvalue, _exact_sequence_distribution

    from eagle_backbone import sampling as S
    from eagle_backbone.sampling import SamplingConfig

    target, drafter, folder = tiny_eagle_pair
    cfg, prompt, n = SamplingConfig(temperature=0.7), [1, 3], 1500
    probs = _exact_sequence_distribution(target, prompt, 3, cfg)
    monkeypatch.setattr(S, "residual", lambda p, q: p)
    assert _chi2_pvalue(_eagle_counts(target, drafter, _policy(kind, folder), prompt, 3, cfg, n), probs, n) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_sampling_on_the_targets_device(tiny_eagle_pair):
    """On a GPU the random stream lives on the target's device: a seed gives the same output every time,
    and the sampled sequences still follow the target's distribution."""
    import copy

    from test_sampling import _chi2_pvalue, _exact_sequence_distribution

    from eagle_backbone.engine import autoregressive_generate
    from eagle_backbone.sampling import SamplingConfig

    cpu_target, cpu_drafter, folder = tiny_eagle_pair
    target, drafter = copy.deepcopy(cpu_target).to("cuda"), copy.deepcopy(cpu_drafter).to("cuda")
    cfg, prompt, n = SamplingConfig(temperature=1.0), [1, 3], 600
    probs = _exact_sequence_distribution(cpu_target, prompt, 3, cfg)  # the same weights, enumerated on the CPU
    for kind in ("static", "ldlp"):
        policy = _policy(kind, folder)
        if kind == "ldlp":
            policy.model = policy.model.to("cuda")
        counts = _eagle_counts(target, drafter, policy, prompt, 3, cfg, n)
        again = _eagle_counts(target, drafter, _policy(kind, folder) if kind == "static" else policy, prompt, 3, cfg, n)
        assert counts == again  # seeded: the same outputs
        assert _chi2_pvalue(counts, probs, n) > 1e-3
    runs = [autoregressive_generate(target, prompt, 8, cfg, seed=s).tokens for s in (0, 0, 1)]
    assert runs[0] == runs[1]


def test_seeded_streams_are_reproducible_and_a_generator_continues_its_stream():
    """A sampled sequence's stream is counter-based on the target's device (eagle_backbone.sampling): the same
    int seed gives the same samples every time; a generator passed in draws the stream's seed, so two
    generators seeded alike agree and one generator used twice continues (the second call differs)."""
    from eagle_backbone.candidates import DraftModelCandidateGenerator
    from eagle_backbone.engine import SpeculativeDecoder
    from eagle_backbone.policy import StaticPolicy
    from eagle_backbone.sampling import SamplingConfig

    target, draft = make_target(seed=11, vocab=8, d=16, layers=1), make_target(seed=12, vocab=8, d=16, layers=1)
    target.eos_token_ids = set()
    dec = SpeculativeDecoder(target, DraftModelCandidateGenerator(draft.model, target), StaticPolicy(2))
    cfg = SamplingConfig(temperature=1.0)
    for seed in (7, 8):
        by_int = dec.generate([1, 3], 12, cfg, seed=seed).tokens
        assert by_int == dec.generate([1, 3], 12, cfg, seed=seed).tokens
        g = torch.Generator().manual_seed(seed)
        by_gen = dec.generate([1, 3], 12, cfg, seed=g).tokens
        assert by_gen == dec.generate([1, 3], 12, cfg, seed=torch.Generator().manual_seed(seed)).tokens
        assert dec.generate([1, 3], 12, cfg, seed=g).tokens != by_gen  # the stream went on
    assert dec.generate([1, 3], 12, cfg, seed=7).tokens != by_int  # the seed matters: the check can fail


# -- 9. resume=true replays the uninterrupted LDLP training bit for bit --------------------------------


def test_ldlp_training_resumed_from_last_ckpt_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir
    from test_ldlp import tiny_target_folder, write_oracle

    import eagle_backbone.paths  # noqa: F401
    from ldlp.models.predictor import LDLP
    from ldlp.training import predictor as P

    target = tiny_target_folder(tmp_path / "target")
    oracle = write_oracle(tmp_path / "oracle", n_conversations=10, rows_per_conv=6, d=32, store_features=True)

    def cfg(name, *extra):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            return compose(config_name="train_ldlp", overrides=[
                f"model.target={target}", f"ldlp_training.oracle_dir={oracle}", f"ldlp_training.out_dir={tmp_path / name}",
                f"ldlp_training.feature_cache={tmp_path / 'cache'}", "ldlp.hidden_dim=8", "ldlp.dropout=0.1",
                "ldlp_training.batch_size=8", "trainer.max_epochs=3", "trainer.enable_progress_bar=false",
                "ldlp_training.evaluation.baselines=[constant]", "ldlp_training.evaluation.benchmark=false",
                "ldlp_training.early_stopping.patience=null", f"logger.save_dir={tmp_path / name}",
                f"trainer.default_root_dir={tmp_path / name}", "threads=1", *extra])

    P.run_ldlp_training(cfg("whole"))

    class Killed(Exception):
        pass

    start = P.LDLPModule.on_train_epoch_start

    def kill_at_epoch_2(self):
        if self.current_epoch == 2:
            raise Killed  # after epoch 1's last.ckpt
        return start(self)

    monkeypatch.setattr(P.LDLPModule, "on_train_epoch_start", kill_at_epoch_2)
    with pytest.raises(Killed):
        P.run_ldlp_training(cfg("resumed"))
    monkeypatch.setattr(P.LDLPModule, "on_train_epoch_start", start)
    assert (tmp_path / "resumed" / "checkpoints" / "last.ckpt").is_file()
    P.run_ldlp_training(cfg("resumed", "resume=true"))
    whole, resumed = (LDLP.from_pretrained(tmp_path / n).state_dict() for n in ("whole", "resumed"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert LDLP.from_pretrained(tmp_path / "resumed").config.meta["resumed_from"].endswith("last.ckpt")
    assert LDLP.from_pretrained(tmp_path / "whole").config.meta["resumed_from"] is None


def test_readme_block_states_dropped_prompts():
    from ldlp.report.publish import headline_block

    h2h = {"reference": "static γ=6", "n_prompts": 56, "n_dropped": 24, "dropped_reason": "longer than "
           "max_prompt_tokens=1536", "rounds": 2, "rows": []}
    block = headline_block({"headline": {"m": {"head_to_head": h2h}}}, "m", "python scripts/pipeline.py", "p.md")
    assert "56 prompts (**24 of 80 prompts (30%) dropped: longer than max_prompt_tokens=1536**) × 2 rounds" in block


from test_oracle import pair_dirs  # noqa: E402,F401  (the fixture: a tiny pair saved like the embedded one)


def test_a_real_collection_is_checked_against_its_manifest(tmp_path, pair_dirs):  # noqa: F811
    """The collector's own manifest and parts: one part of four is refused, the finished collection passes."""
    from test_oracle import run

    from ldlp.labels.store import require_complete

    run(pair_dirs, tmp_path, "max_parts_this_run=1")
    with pytest.raises(ValueError, match=r"of 17 sequences are missing") as e:
        require_complete(tmp_path)
    assert f"python scripts/collect_oracle.py out_dir={tmp_path}" in _one_line(e)
    run(pair_dirs, tmp_path)
    assert require_complete(tmp_path)["complete"] is True


def test_replay_checks_head_sizes_against_the_stored_rows(tmp_path):
    import numpy as np

    from ldlp.models.acceptance import AcceptanceHead, AcceptanceHeadConfig
    from eagle_backbone.cost import CostTable
    from ldlp.bench.replay import OracleRows, replay
    from ldlp.policies.threshold import AcceptancePolicy, LDLPPolicy
    from ldlp.models.predictor import LDLP, LDLPConfig

    n, k, d = 6, 4, 8
    rows = OracleRows({"seq_id": np.zeros(n, int), "index": np.arange(n), "last_token": np.arange(n) % 5,
                       "label": np.ones(n, int), "remaining": np.arange(n)[::-1], "draft_top1_prob": np.full((n, k), .5),
                       "draft_entropy": np.ones((n, k)), "feature": np.zeros((n, d), np.float32),
                       "draft_state": np.zeros((n, k * d), np.float32)})
    AcceptanceHead(AcceptanceHeadConfig(hidden_size=d + 4, k_max=k)).save_pretrained(tmp_path / "acc")
    LDLP(LDLPConfig(input_dim=2 * (d + 4))).save_pretrained(tmp_path / "ldlp")
    costs = CostTable.linear(step_ms=1000.0, draft_ms=100.0)
    for policy, what in ((AcceptancePolicy(str(tmp_path / "acc"), max_gamma=k), f"hidden_size={d + 4}"),
                         (LDLPPolicy(str(tmp_path / "ldlp")), f"input_dim={2 * (d + 4)}")):
        with pytest.raises(ValueError, match=what):
            replay(rows, policy, costs, embed=lambda ids: torch.zeros(len(ids), d))


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


def test_pooling_refuses_runs_of_different_prompt_sets():
    from test_pool import _runs

    from ldlp.bench.pool import pool

    runs = _runs(1.02, n_runs=2)
    for r, sha in zip(runs, ("a" * 64, "b" * 64)):
        r.update(model="m", dataset="prompts", data_path="/d/q.jsonl", data_sha256=sha, n_prompts=40)
    with pytest.raises(ValueError) as e:
        pool(runs, bootstrap=10)
    assert "data_sha256" in _one_line(e) and "run 2 and run 1" in str(e.value)
    runs[1]["data_sha256"] = "a" * 64
    assert pool(runs, bootstrap=10)["reference"]


# -- issue 25: prompt identity, label folders, publishing one run, one-line errors ----------------------------


def test_duplicate_question_ids_are_refused_at_load(tmp_path):
    from eagle_backbone.data.conversations import DataError, load_conversations

    q = tmp_path / "question.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                         for i, c, t in ((1, "math", "2+2?"), (2, "code", "Sort."), (1, "writing", "A poem."))))
    with pytest.raises(DataError) as e:
        load_conversations(q)
    assert f"{q}:3: duplicate id '1' (first at {q}:1)" in _one_line(e)
    # skipping malformed records skips the repeat, counted, never a second prompt under the same id
    kept = load_conversations(q, on_error="skip")
    assert [c["id"] for c in kept] == ["1", "2"] and kept.skipped == 1


def test_per_temperature_labels_are_found_however_t_was_spelt_and_missing_ones_name_the_collector(tmp_path):
    from ldlp.training.draft_acceptance import label_folder, load_labels

    (tmp_path / "embedded_train" / "t1").mkdir(parents=True)  # collect_acceptance.py temperature=1
    assert label_folder(tmp_path, "embedded_train", 1.0) == tmp_path / "embedded_train" / "t1"
    assert label_folder(tmp_path, "embedded_train", 0.7) == tmp_path / "embedded_train" / "t0.7"
    with pytest.raises(ValueError) as e:
        load_labels(label_folder(tmp_path, "embedded_train", 0.7))
    msg = _one_line(e)
    assert "scripts/collect_acceptance.py data=embedded_train temperature=0.7" in msg and "collect_oracle" not in msg


def _a_run(folder: Path, model: str = "m", tuning: bool = True, sweep_complete: bool | None = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "results.md").write_text("| policy |\n")
    (folder / "results.csv").write_text(f"model,policy\n{model},static\n")
    (folder / "tokens_per_s.png").write_bytes(b"png")
    (folder / "summary.json").write_text(json.dumps({"headline": {model: {}}, "rows": []}))
    if tuning:
        (folder / "tuning").mkdir()
        (folder / "tuning" / "tuning.md").write_text("tuning")
        (folder / "tuning" / "tuning.json").write_text("{}")
    if sweep_complete is not None:
        (folder / "load_sweep").mkdir()
        for f in ("batch_bench.md", "batch_bench.png"):
            (folder / "load_sweep" / f).write_text(f)
        (folder / "load_sweep" / "batch_bench.json").write_text(json.dumps([{"complete": sweep_complete}]))
        (folder / "load_sweep" / "batch_bench_runs.json").write_text(json.dumps({"meta": {"model": model}}))
    from ldlp.report.publish import write_run_manifest

    stages = ["corpus", "oracle"] + (["tune"] if tuning else []) + (["bench_batch"] if sweep_complete is not None
                                                                    else [])
    write_run_manifest(folder, model, stages, {s: 10.0 for s in stages})
    return folder


def test_publishing_takes_one_complete_run_of_this_model_or_refuses(tmp_path):
    from eagle_backbone.errors import ConfigError
    from ldlp.report.publish import PUBLISHED_FILES, check_publishable, group_files, prune_published, publish

    assert set(group_files()) == set(PUBLISHED_FILES)  # the check covers every file publish copies
    published, readme = tmp_path / "published", tmp_path / "README.md"
    readme.write_text("# r\n")
    old = _a_run(tmp_path / "old")
    publish(old, published, readme, None, "m", "cmd")
    assert (published / "tuning" / "tuning.json").is_file()
    # a newer run without tuning: the older run's tuning is removed, not linked from the new page
    new = _a_run(tmp_path / "new", tuning=False)
    files = check_publishable(new, "m")
    assert prune_published(published, files) == ["tuning/tuning.md", "tuning/tuning.json"]
    publish(new, published, readme, None, "m", "cmd")
    assert not (published / "tuning").exists() or not any((published / "tuning").iterdir())
    assert "tuning/tuning.md" not in (published / "README.md").read_text()
    # refused, in one line, before anything is copied
    bad = {"another model": (_a_run(tmp_path / "other", model="vicuna"), "not model.name=m"),
           "an unfinished sweep": (_a_run(tmp_path / "stopped", sweep_complete=False), "unfinished load sweep"),
           "no run": (tmp_path / "nothing", "missing results.md")}
    half = _a_run(tmp_path / "half")
    (half / "tuning" / "tuning.json").unlink()
    bad["half a group"] = (half, "tuning is incomplete")
    for case, (folder, why) in bad.items():
        with pytest.raises(ConfigError) as e:
            check_publishable(folder, "m")
        assert why in _one_line(e), case
    # both ways of publishing (publish_results.py, the main command's publish=true) go through publish_run
    from ldlp.report.publish import publish_run

    before = sorted(p.relative_to(published) for p in published.rglob("*"))
    with pytest.raises(ConfigError, match="not model.name=m"):
        publish_run(bad["another model"][0], published, readme, None, "m", "cmd")
    assert sorted(p.relative_to(published) for p in published.rglob("*")) == before  # nothing copied or removed
    assert any("published" in line for line in publish_run(old, published, readme, None, "m", "cmd"))
    assert (published / "tuning" / "tuning.json").is_file()


def test_scripts_print_the_projects_own_value_errors_in_one_line(monkeypatch, capsys):
    import sys

    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    from _setup import one_line_errors

    from ldlp.bench.load_sweep import check_sweep_args
    from eagle_backbone.errors import ConfigError

    @one_line_errors
    def main(fail):
        fail()

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    from eagle_backbone.data.conversations import load_conversations

    missing = lambda: load_conversations(REPO_ROOT / "no-such-prompts.json")  # noqa: E731  (a MissingInput)
    for fail in (lambda: check_sweep_args([0]), lambda: (_ for _ in ()).throw(ConfigError("data.path=x: bad\nmore")),
                 missing):
        with pytest.raises(SystemExit) as e:
            main(fail)
        assert e.value.code == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ")

    def library():  # a ValueError raised outside the project's code keeps its traceback
        raise ValueError("not ours")

    library.__code__ = library.__code__.replace(co_filename="/usr/lib/python3/somewhere.py")
    with pytest.raises(ValueError, match="not ours"):
        main(library)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ValueError, match="concurrency"):
        main(lambda: check_sweep_args([0]))


# -- issue 32: publishing is one run's whole result ----------------------------------------------------------


def test_publishing_takes_only_the_stages_this_run_had_and_lists_what_it_wrote(tmp_path):
    """A run with bench_batch.enabled=false over the folder of an earlier run with a load sweep: the earlier load
    sweep (page, plots, runs file) is neither published nor timed nor linked, the earlier publish's files are
    removed, and manifest.json lists exactly what this publish wrote."""
    import hashlib

    from ldlp.report.publish import publish_run, write_run_manifest

    published, readme = tmp_path / "published", tmp_path / "README.md"
    readme.write_text("# r\n")
    results = _a_run(tmp_path / "results")  # an earlier run: tuning and load sweep
    publish_run(results, published, readme, None, "m", "cmd")
    assert (published / "load_sweep" / "batch_bench_runs.json").is_file()  # every file of the group
    manifest = json.loads((published / "manifest.json").read_text())
    assert "load_sweep/batch_bench_runs.json" in manifest["files"]
    (published / "other.md").write_text("a page of another script")  # not the main command's: left alone
    # the next run has no load sweep; its files from the earlier run stay in the results folder
    write_run_manifest(results, "m", ["corpus", "oracle", "tune"], {"corpus": 1.0, "oracle": 2.0, "tune": 3.0})
    (results / "stage_seconds.json").write_text(json.dumps({"corpus": 1.0, "bench_batch": 99.0}))
    lines = publish_run(results, published, readme, None, "m", "cmd")
    assert not (published / "load_sweep").exists() or not any((published / "load_sweep").iterdir())
    assert any("not published: load sweep" in line for line in lines)
    assert json.loads((published / "stage_seconds.json").read_text()) == {"corpus": 1.0, "oracle": 2.0, "tune": 3.0}
    page = (published / "README.md").read_text()
    assert "load_sweep" not in page and "bench_batch" not in page
    manifest = json.loads((published / "manifest.json").read_text())
    on_disk = {str(p.relative_to(published)) for p in published.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == on_disk - {"manifest.json", "other.md"}
    for f, digest in manifest["files"].items():
        assert hashlib.sha256((published / f).read_bytes()).hexdigest() == digest
    assert (published / "other.md").is_file()
    # rewriting the page from the committed files (results=<the published folder>) keeps them as they are
    before = {f: (published / f).read_bytes() for f in manifest["files"] if f != "README.md"}
    publish_run(published, published, readme, None, "m", "cmd")
    assert {f: (published / f).read_bytes() for f in before} == before


def test_publishing_a_folder_no_main_command_finished_is_refused(tmp_path):
    from eagle_backbone.errors import ConfigError
    from ldlp.report.publish import publish_run

    results = _a_run(tmp_path / "results")
    (results / "run.json").unlink()
    with pytest.raises(ConfigError) as e:
        publish_run(results, tmp_path / "published", tmp_path / "README.md", None, "m", "cmd")
    assert "no run.json" in _one_line(e) and not (tmp_path / "published").exists()


def test_the_publish_script_does_not_import_the_orchestrator():
    text = (Path(__file__).resolve().parent.parent / "scripts" / "publish_results.py").read_text()
    assert "ldlp.pipeline" not in text and "ldlp.report.publish" in text


def test_the_cost_key_tells_cpus_of_one_name_apart_by_what_changes_costs(monkeypatch):
    """Two CPUs sold under one name, one with bf16 matmuls and AVX-512 and one without, get different keys and
    different file names."""
    import eagle_backbone.runtime as runtime
    from eagle_backbone.cost import cost_key, table_path

    monkeypatch.setattr("eagle_backbone.cost.processor_name", lambda device: "Same Marketing Name")
    keys = {}
    for kind, flags in (("bf16", {"avx512f", "avx512_bf16", "avx2"}), ("plain", {"avx2"})):
        monkeypatch.setattr(runtime, "cpu_flags", lambda flags=flags: flags)
        keys[kind] = cost_key("m", torch.float32, "cpu", 1)
    assert keys["bf16"]["cpu"] == keys["plain"]["cpu"]
    assert keys["bf16"]["cpu_caps"]["bf16"] and keys["bf16"]["cpu_caps"]["avx512"]
    assert not keys["plain"]["cpu_caps"]["bf16"] and not keys["plain"]["cpu_caps"]["avx512"]
    a, b = table_path("c", keys["bf16"]), table_path("c", keys["plain"])
    assert a != b and "avx512-bf16" in a.name and "bf16" not in b.name
    if Path("/proc/cpuinfo").is_file():
        assert {"cpu_family", "model"} <= set(keys["plain"]["cpu_caps"])


def test_a_cuda_device_on_a_torch_without_one_is_one_line(monkeypatch, capsys):
    """model.device=cuda where torch has no CUDA device: one error line at the script's start, before any model
    loads (torch's own failure is an assertion traceback); a script that only reads results is not refused."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    from _setup import start
    from omegaconf import OmegaConf

    from eagle_backbone.runtime import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="model.device=cuda: .*torch.cuda.is_available\\(\\) is False.*model.device=cpu"):
        check_device("cuda")
    with pytest.raises(ValueError, match="model.device=gpu0: not a device"):
        check_device("gpu0")
    cfg = OmegaConf.create({"threads": None, "model": {"device": "cuda", "dtype": "float16", "target": "t"}})
    with pytest.raises(SystemExit) as e:
        start(cfg)
    assert str(e.value).startswith("error: model.device=cuda: ")
    start(cfg, loads_models=False)  # publishing a GPU run's pages on a CPU machine


@pytest.mark.parametrize("script, override, message", [
    ("profile_cost.py", "reps=0", "error: reps must be an integer >= 1, got 0 (conf/profile_cost.yaml)"),
    ("bench_attention.py", "reps=0", "error: reps must be an integer >= 1, got 0 (conf/bench_attention.yaml)"),
    ("bench_engine_ref.py", "concurrency=[]", "error: concurrency must be a non-empty list of integers >= 1, got []"),
])
def test_a_bad_count_is_one_line_before_any_model_loads(script, override, message, tmp_path):
    """One subprocess per script (their lists share int_list_setting, tested below). reps=0 used to end in
    statistics.StatisticsError, an empty list in 'max() arg is an empty sequence', both
    after the models loaded; a missing model folder shows that nothing was loaded first."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(repo / "scripts" / script), override,
                          f"model.target={tmp_path / 'absent'}", f"model.drafter={tmp_path / 'absent'}",
                          f"model.tokenizer={tmp_path / 'absent'}",
                          f"out={tmp_path / 't.json'}" if script == "profile_cost.py" else f"out_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=300, cwd=repo)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith(message), out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_a_tree_too_large_names_the_settings_to_change():
    from eagle_backbone.tree_draft import TreeSpec

    with pytest.raises(ValueError, match="top_k=64, depth=6.*lower policy.top_k, policy.depth or policy.width"):
        TreeSpec(top_k=64, depth=6)


def test_an_engine_ref_without_the_batched_engine_is_one_line_and_leaves_no_temporary_folder(tmp_path):
    """bench_engine_ref.py against a commit from before the batched engine: one line naming ref=, and the
    temporary copy of that commit's core is gone when the process ends."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    root = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=repo, capture_output=True, text=True)
    if root.returncode != 0 or not root.stdout.strip():
        pytest.skip("no git history in this checkout")
    ref = root.stdout.split()[0]
    (tmp_path / "tmp").mkdir()
    code = ("from ldlp.bench.at_ref import load_core_at\n"
            "try:\n    load_core_at(%r)\nexcept ValueError as e:\n    print(e)\n" % ref)
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TMPDIR=str(tmp_path / "tmp")))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"ref={ref}: ") and "choose" in out.stdout
    assert list((tmp_path / "tmp").iterdir()) == []  # the temporary core copy is removed at exit


def test_int_settings_refuse_in_one_line_naming_the_key():
    from eagle_backbone.runtime import int_list_setting, int_setting

    assert int_setting("reps", 3, 1) == 3 and int_list_setting("slots", [1, 2], 1, distinct=True) == [1, 2]
    for bad in (0, 1.5, True, None, "2"):
        with pytest.raises(ValueError, match="reps must be an integer >= 1"):
            int_setting("reps", bad, 1, "conf/x.yaml")
    for bad in ([], None, [0], [1, 1], [2.0]):
        with pytest.raises(ValueError, match="slots must be a non-empty list of distinct integers >= 1"):
            int_list_setting("slots", bad, 1, distinct=True)
