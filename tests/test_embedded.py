"""The embedded default: corpus, tokenizer, tiny runs of the training scripts, and the shipped pair."""

import json
import subprocess
import sys

import pytest
import torch

from eagle_backbone.data.corpus import CorpusConfig, build_corpus, corpus_hash, write_corpus
from eagle_backbone.paths import EMBEDDED_DIR, REPO_ROOT


def test_corpus_is_deterministic_and_split_by_module(tmp_path, embedded_corpus):
    a = json.loads((embedded_corpus / "manifest.json").read_text())  # the session's build
    b = write_corpus(tmp_path / "b")  # and another one
    assert a["sha256"] == b["sha256"] and a["python_version"]
    for split in ("train", "validation", "test"):
        assert (embedded_corpus / f"{split}.json").read_bytes() == (tmp_path / "b" / f"{split}.json").read_bytes()
    splits = {s: json.loads((embedded_corpus / f"{s}.json").read_text()) for s in ("train", "validation", "test")}
    assert {s: len(v) for s, v in splits.items()} == a["counts"]
    modules = {s: {c["module"] for c in convs} for s, convs in splits.items()}
    assert not modules["train"] & modules["validation"]
    assert not modules["train"] & modules["test"]
    assert not modules["validation"] & modules["test"]
    assert all(len(v) > 0 for v in splits.values())
    conv = splits["train"][0]
    assert {t["from"] for c in splits["train"][:50] for t in c["conversations"]} == {"human", "gpt"}
    assert set(conv) >= {"id", "conversations"}
    # both kinds of text are there on purpose: prose and code
    answers = [t["value"] for c in splits["train"] for t in c["conversations"] if t["from"] == "gpt"]
    assert any(a.startswith("```python") for a in answers) and any(not a.startswith("```") for a in answers)


def test_small_corpus_option_and_seed():
    small = build_corpus(CorpusConfig(max_modules=20))
    assert corpus_hash(small) == corpus_hash(build_corpus(CorpusConfig(max_modules=20)))
    assert corpus_hash(small) != corpus_hash(build_corpus(CorpusConfig(max_modules=20, seed=1)))


def test_tokenizer_training_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from eagle_backbone.data.tokenizer import train_bpe_tokenizer

    convs = build_corpus(CorpusConfig(max_modules=15))["train"]
    train_bpe_tokenizer((t["value"] for c in convs for t in c["conversations"]), 400, tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 400
    text = tok.apply_chat_template([{"role": "user", "content": "What does `x` do?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<s>") and text.endswith("USER: What does `x` do? ASSISTANT:")
    ids = tok("def f(x):\n    return x", add_special_tokens=False).input_ids
    assert tok.decode(ids) == "def f(x):\n    return x"


def _run(args, cwd):
    res = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_tiny_training_runs(tmp_path, embedded_corpus):
    """A few steps of each training script on a tiny model: target LM, then an EAGLE drafter for it."""
    lm_dir, drafter_dir = tmp_path / "lm", tmp_path / "drafter"
    _run(["scripts/train_lm.py", "lm=tiny", f"lm.out_dir={lm_dir}", f"corpus_dir={embedded_corpus}",
          "trainer.max_steps=2", "max_conversations=40",
          "block_size=64", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
          "trainer.enable_progress_bar=false", f"ckpt_dir={tmp_path / 'ck1'}", f"hydra.run.dir={tmp_path / 'run1'}"],
         REPO_ROOT)
    assert (lm_dir / "model.safetensors").exists()
    _run(["scripts/train_drafter.py", f"model.target={lm_dir}", f"model.tokenizer={lm_dir}",
          f"drafter_training.out_dir={drafter_dir}", "trainer.max_steps=2", "data.limit=30",
          f"data.path={embedded_corpus / 'train.json'}",
          f"drafter_training.validation_path={embedded_corpus / 'validation.json'}",
          "drafter_training.block_size=64", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
          "trainer.enable_progress_bar=false", f"drafter_training.ckpt_dir={tmp_path / 'ck2'}",
          f"hydra.run.dir={tmp_path / 'run2'}"], REPO_ROOT)
    from eagle_backbone.loading import load_pair

    pair = load_pair({"target": str(lm_dir), "drafter": str(drafter_dir), "tokenizer": str(lm_dir),
                      "drafter_kind": "eagle", "dtype": "float32", "device": "cpu"})
    summary = json.loads((drafter_dir / "training_summary.json").read_text())
    assert summary["steps"] == 2 and 0 <= summary["val_top1"] <= 1
    assert pair.drafter.hidden_size == pair.target.hidden_size


SHIPPED = all((EMBEDDED_DIR / p / "config.json").exists() for p in ("target", "drafter", "draft_lm"))


def _shipped_model_config() -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "conf" / "model" / "embedded.yaml"), resolve=True)


@pytest.mark.skipif(not SHIPPED, reason="the embedded models are not in data/embedded yet")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("packed", [True, False], ids=["cpu_routes", "no_packed_matmul"])
def test_the_engines_target_is_batch_invariant_on_this_cpu(dtype, packed, monkeypatch):
    """A token's logits are the same bits whether the engine verifies it among γ + 1 tokens, in a draft tree, in
    a batch of 8 rows (dense blocks or rows alone), after a chunked prefill, or decodes it alone: greedy
    speculative decoding cannot differ from plain decoding even at a near-tie. Both dtypes on every CPU (bfloat16
    is emulated, slowly, where the CPU lacks it), on the routes this CPU takes and with oneDNN's packed matmul
    forced off (an AVX2-only CPU's bfloat16 route)."""
    from eagle_backbone import runtime
    from eagle_backbone.llama import BatchedLlama
    from eagle_backbone.loading import load_target
    from ldlp.bench.measurements.target import engine_batch_invariance

    if not packed:
        if not runtime.packed_matmul(getattr(torch, dtype)):
            pytest.skip(f"this CPU has no packed {dtype} route: the cpu_routes case is this case")
        monkeypatch.setattr(runtime, "packed_matmul", lambda dtype: False)
    target = load_target({**_shipped_model_config(), "dtype": dtype})
    lm = BatchedLlama(target.model, 512)
    assert {p.route for layer in lm.run_layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)} == \
        {"packed" if packed and runtime.packed_matmul(getattr(torch, dtype)) else "plain"}
    res = engine_batch_invariance(lm, contexts=(3, 40, 251), tokens=6, others=7)
    bad = {case: r for case, r in res.items() if r["bitwise_equal"] != r["positions"]}
    assert not bad, (f"on this CPU ({runtime.cpu_isa()}, {dtype}) the engine is not batch-invariant: {bad}; greedy "
                     "output may then differ from plain decoding at near-ties (eagle_backbone/linear.py)")
    assert all(r["positions"] > 0 for r in res.values())


@pytest.mark.skipif(not SHIPPED, reason="the embedded models are not in data/embedded yet")
def test_shipped_pair_is_lossless_on_held_out_prompts(embedded_corpus):
    from eagle_backbone.data.conversations import build_prompts, load_conversations
    from eagle_backbone.decoder import SpeculativeDecoder, autoregressive_generate
    from eagle_backbone.loading import load_pair
    from eagle_backbone.policy import StaticPolicy

    cfg = _shipped_model_config()  # as the main command loads it (bfloat16, eager attention)
    pair = load_pair(cfg)
    lm_pair = load_pair({**cfg, "drafter": str(EMBEDDED_DIR / "draft_lm"), "drafter_kind": "draft_lm"})
    test = load_conversations(embedded_corpus / "test.json", limit=40)
    prompts = build_prompts(pair.tokenizer, test, 512)[::10][:3]
    accepted = 0
    for _, p in prompts:
        ref = autoregressive_generate(pair.target, p, 48).tokens
        for candidates in (pair.candidates, lm_pair.candidates):
            out = SpeculativeDecoder(pair.target, candidates, StaticPolicy(4)).generate(p, 48)
            assert out.tokens == ref
            accepted += out.stats.accepted_tokens
    assert accepted > 0  # a trained pair agrees at least sometimes
