"""EAGLE-3 training (eagle_backbone/train/eagle3.py): the training-time test's unrolled steps are what drafting
computes at each depth; self-distilled data is the target's own decoding; a run resumed from its checkpoint
ends with the weights of an uninterrupted one, bit for bit; the script trains and exports a head that
model=embedded_eagle3-style configs load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import make_target, pair_overrides, save_tiny_pair
from omegaconf import OmegaConf

from eagle_backbone.eagle3 import BatchedEagle3Drafter, Eagle3Drafter
from eagle_backbone.ragged import RaggedBatch
from eagle_backbone.paths import REPO_ROOT
from eagle_backbone.train.eagle3 import DistilledData, Eagle3Module, distill, distilled_records, ttt_loss
from eagle_backbone.train.lm import fit_resumable

torch.set_num_threads(1)


def test_unrolled_steps_are_what_drafting_sees():
    """Step k of the TTT at root j equals the engine's drafter at depth k + 1 after the true pairs 0..j, fed
    the tokens t_{j+2..} (the target's, as self-distilled drafts are) and its own states."""
    t = make_target(layers=3)  # float64
    torch.manual_seed(2)
    d = Eagle3Drafter.from_target_config(t.model.config, layer_ids=(0, 2, 1)).double().eval()
    ids = torch.randint(4, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    hs = t.model.model(ids, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i] for i in (0, 2, 1)], -1)
    with torch.no_grad():
        states = ttt_loss(d, aux, ids, None, None, steps=4, return_states=True)
        dm = BatchedEagle3Drafter(d, 32, "eager")
        for j in (0, 3, 6):
            cache = dm.new_cache(1)
            s = dm(ids[0, 1: j + 2], aux[0, : j + 1], RaggedBatch([0], [0], [j + 1], "cpu"), cache)[-1:]
            torch.testing.assert_close(s[0], states[0][0, j], rtol=1e-5, atol=1e-6)  # rotary tables in float32
            for k in range(1, 4):
                s = dm.draft(ids[0, j + 1 + k: j + 2 + k], s, RaggedBatch([0], [j + k], [1], "cpu"), cache)
                torch.testing.assert_close(s[0], states[k][0, j], rtol=1e-5, atol=1e-6)


def test_distillation_is_the_targets_greedy_decoding_and_seeded_sampling_repeats():
    t = make_target(dtype=torch.float32)
    prompts = [("a", [1, 5, 9, 7]), ("b", [1, 30, 2, 8, 8]), ("c", [1, 11])]
    recs = distill(t, prompts, 10, 0.0, seed=0, slots=2)
    assert [r["response_ids"] for r in recs] == [t.reference_greedy(p, 10) for _, p in prompts]
    assert distill(t, prompts, 10, 1.0, seed=3, slots=2) == distill(t, prompts, 10, 1.0, seed=3, slots=3)


def test_distilled_records_mix_greedy_and_sampled_answers_and_are_made_once(tmp_path, monkeypatch):
    """One response per prompt at each temperature, in the configured order, each temperature kept in its own
    file: a second call reads them back without decoding; distinct, non-negative temperatures only."""
    import json

    from eagle_backbone.data import conversations

    t = make_target(dtype=torch.float32)
    prompts = [("a", [1, 5, 9, 7]), ("b", [1, 30, 2, 8, 8]), ("c", [1, 11])]
    monkeypatch.setattr(conversations, "load_conversations", lambda path, limit=None: prompts)
    monkeypatch.setattr(conversations, "build_prompts", lambda tok, convs, n: convs)
    cfg = OmegaConf.create({"train_path": "train.json", "validation_path": "val.json", "distill": {
        "dir": str(tmp_path), "prompts": 3, "validation_prompts": 2, "max_prompt_tokens": 16, "max_new_tokens": 6,
        "temperatures": [0.0, 1.0], "seed": 4, "slots": 2}})
    recs = distilled_records(cfg, t, None, "train")
    assert recs[:3] == distill(t, prompts, 6, 0.0, seed=4, slots=2)
    assert recs[3:] == distill(t, prompts, 6, 1.0, seed=4, slots=2)
    assert json.loads((tmp_path / "train-T1.settings.json").read_text())["temperature"] == 1.0
    monkeypatch.setattr("eagle_backbone.train.eagle3.distill", lambda *a, **k: pytest.fail("decoded again"))
    assert distilled_records(cfg, t, None, "train") == recs
    for bad in ([], [1.0, 1.0], [-0.5]):
        cfg.distill.temperatures = bad
        with pytest.raises(ValueError, match="distill.temperatures"):
            distilled_records(cfg, t, None, "train")


def test_kept_answers_serve_fewer_prompts_and_extend_to_more(tmp_path, monkeypatch):
    """Answers to the first n prompts serve a smaller count and are extended, not remade, for a larger one; the
    extension (saved every save_every prompts) equals distilling all the prompts at once; other settings remake."""
    from eagle_backbone.data import conversations
    from eagle_backbone.train import eagle3

    t = make_target(dtype=torch.float32)
    prompts = [("a", [1, 5, 9, 7]), ("b", [1, 30, 2, 8, 8]), ("c", [1, 11]), ("d", [1, 4, 4]), ("e", [1, 60, 3])]
    monkeypatch.setattr(conversations, "load_conversations", lambda path, limit=None: prompts)
    monkeypatch.setattr(conversations, "build_prompts", lambda tok, convs, n: convs)
    cfg = OmegaConf.create({"train_path": "train.json", "validation_path": "val.json", "distill": {
        "dir": str(tmp_path), "prompts": 2, "validation_prompts": 2, "max_prompt_tokens": 16, "max_new_tokens": 6,
        "temperatures": [1.0], "seed": 4, "slots": 2, "save_every": 2}})
    whole = distill(t, prompts, 6, 1.0, seed=4, slots=3)
    assert distilled_records(cfg, t, None, "train") == whole[:2]
    calls = []
    real = eagle3.distill
    monkeypatch.setattr(eagle3, "distill", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    cfg.distill.prompts = 9  # more than there are: all five
    assert distilled_records(cfg, t, None, "train") == whole
    assert calls == [2, 1]  # prompts 2..3, then 4: saved between
    cfg.distill.prompts = 3
    assert distilled_records(cfg, t, None, "train") == whole[:3] and calls == [2, 1]
    cfg.distill.prompts = "all"  # every prompt the split has: the five kept, nothing decoded
    assert distilled_records(cfg, t, None, "train") == whole and calls == [2, 1]
    for bad in (-1, "many", 2.5):
        cfg.distill.prompts = bad
        with pytest.raises(ValueError, match=r"^drafter_training.distill.prompts: .*give a count >= 0 or 'all'$"):
            distilled_records(cfg, t, None, "train")
    cfg.distill.prompts = 3
    cfg.distill.max_new_tokens = 5
    assert [len(r["response_ids"]) <= 5 for r in distilled_records(cfg, t, None, "train")] == [True] * 3


def test_no_distilled_prompts_distil_nothing_for_a_corpus_only_run(tmp_path, monkeypatch):
    """``distill.prompts=0`` (a corpus-text-only run): no training answers, and nothing is decoded for them, with
    or without kept answers; validation answers are still made (every run's held-out set is the same)."""
    from eagle_backbone.data import conversations
    from eagle_backbone.train import eagle3

    t = make_target(dtype=torch.float32)
    prompts = [("a", [1, 5, 9, 7]), ("b", [1, 30, 2, 8, 8])]
    monkeypatch.setattr(conversations, "load_conversations", lambda path, limit=None: prompts)
    monkeypatch.setattr(conversations, "build_prompts", lambda tok, convs, n: convs)
    cfg = OmegaConf.create({"train_path": "train.json", "validation_path": "val.json", "distill": {
        "dir": str(tmp_path), "prompts": 0, "validation_prompts": 1, "max_prompt_tokens": 16, "max_new_tokens": 4,
        "temperatures": [0.0, 1.0], "seed": 4, "slots": 2}})
    real = eagle3.distill
    monkeypatch.setattr(eagle3, "distill", lambda *a, **k: pytest.fail("decoded training answers"))
    assert distilled_records(cfg, t, None, "train") == []
    monkeypatch.setattr(eagle3, "distill", real)
    assert len(distilled_records(cfg, t, None, "validation")) == 2
    cfg.distill.prompts = 2
    assert len(distilled_records(cfg, t, None, "train")) == 4  # kept now
    cfg.distill.prompts = 0
    monkeypatch.setattr(eagle3, "distill", lambda *a, **k: pytest.fail("decoded training answers"))
    assert distilled_records(cfg, t, None, "train") == []


def test_a_reduced_draft_vocabulary_keeps_the_most_frequent_response_tokens(tmp_path):
    """``draft_vocab_size`` < V: the kept tokens are the training blocks' most frequent loss (response) tokens,
    ties to the lower id (prompt tokens and tokens cut off by the block do not count), and the LM head starts
    as the target's rows of them."""
    from eagle_backbone.train.eagle3 import blocks_of, frequent_tokens

    save_tiny_pair(tmp_path, vocab=64, layers=3)
    records = [{"prompt_ids": [9, 9, 9, 9], "response_ids": [5, 7, 11, 5]},
               {"prompt_ids": [9, 9], "response_ids": [7, 5, 7, 11, 60, 2, 60, 60]}]  # block 8: two 60s cut
    ids, mask = blocks_of(records, 8, 0)
    kept, coverage = frequent_tokens(ids, mask, 4, 64)
    assert kept == [2, 5, 7, 11] and coverage == pytest.approx(9 / 10)  # 5, 7: 3 each; 11: 2; 2 and 60: 1 (2 kept)
    module = Eagle3Module(str(tmp_path / "target"), layer_ids=(0, 1, 2), draft_vocab_size=4)
    module.restrict_vocab(kept)
    d = module.drafter
    assert d.draft_to_target().tolist() == kept and d.t2d.nonzero().flatten().tolist() == kept
    assert module.hparams.draft_ids == kept
    assert torch.equal(d.lm_head.weight, module.target.lm_head.weight.float()[kept])
    full = d.full_logits(torch.randn(2, d.hidden_size))
    assert torch.isinf(full[:, [k for k in range(64) if k not in kept]]).all() and torch.isfinite(full[:, kept]).all()


def _fit(root, records, max_steps, ckpt, resume, schedule=6):
    torch.manual_seed(0)  # the run's seed (run_eagle3_training: seed_everything), before the head is made
    module = Eagle3Module(str(root / "target"), ttt_steps=3, lr=3e-3, warmup_steps=2, schedule_steps=schedule,
                          layer_ids=(0, 1, 2), draft_vocab_size=48, draft_ids=list(range(8, 56)))
    dm = DistilledData(records[:12], records[12:], block_size=24, batch_size=4, seed=7, steps=schedule, pad_id=0)
    trainer = OmegaConf.create({"_target_": "lightning.Trainer", "accelerator": "cpu", "devices": 1,
                                "precision": "32-true", "max_steps": max_steps, "limit_val_batches": 1,
                                "enable_progress_bar": False, "enable_model_summary": False,
                                "default_root_dir": str(root / "runs")})
    logger = OmegaConf.create({"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": str(root / "runs")})
    if max_steps == 0:
        return module.drafter, []
    seen, step = [], module.training_step
    module.training_step = lambda batch, *a: (seen.append(int(batch["step"])), step(batch, *a))[1]
    fit_resumable(module, dm, trainer, logger, ckpt, resume, every_n_steps=1)
    return module.drafter, seen


def test_resume_is_bit_exact(tmp_path):
    save_tiny_pair(tmp_path, vocab=64, layers=3)
    from eagle_backbone.target import TargetModel

    t = TargetModel.from_pretrained(tmp_path / "target")
    g = torch.Generator().manual_seed(1)
    prompts = [(str(i), torch.randint(4, 64, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist())
               for i in range(16)]
    records = distill(t, prompts, 12, 1.0, seed=0, slots=8)
    whole, seen = _fit(tmp_path, records, 6, tmp_path / "a", resume=False)
    assert seen == [0, 1, 2, 3, 4, 5]
    assert _fit(tmp_path, records, 3, tmp_path / "b", resume=False)[1] == [0, 1, 2]
    resumed, seen = _fit(tmp_path, records, 6, tmp_path / "b", resume=True)
    assert seen == [3, 4, 5]  # it resumed from last.ckpt and ran the rest
    assert not torch.equal(whole.fc.weight, _fit(tmp_path, records, 0, None, False)[0].fc.weight)  # it trained
    for (k, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k


def test_the_script_trains_and_exports_both_layouts(tmp_path, embedded_corpus):
    """``python scripts/train_drafter.py drafter=eagle3`` on a tiny pair, two steps: a speculators folder
    load_pair reads as model.drafter_kind=eagle3, and EAGLE's layout on request; a reduced draft vocabulary is
    the distilled blocks' most frequent response tokens."""
    import json
    save_tiny_pair(tmp_path, vocab=4096, layers=3)
    over = [o for o in pair_overrides(tmp_path, "float32") if not o.startswith(("model.drafter", "model.name"))]
    head = tmp_path / "eagle3"
    cmd = [sys.executable, "scripts/train_drafter.py", "drafter=eagle3", *over, f"model.drafter={head}",
           "trainer.max_steps=2", "trainer.precision=32-true", "trainer.limit_val_batches=1",
           "trainer.enable_progress_bar=false", f"drafter_training.ckpt_dir={tmp_path / 'ckpt'}",
           f"drafter_training.eagle_out_dir={tmp_path / 'eagle_layout'}", "drafter_training.layer_ids=[0,1,2]",
           f"drafter_training.distill.dir={tmp_path / 'distill'}", "drafter_training.distill.prompts=8",
           "drafter_training.distill.validation_prompts=2", "drafter_training.distill.max_new_tokens=8",
           "drafter_training.batch_size=2", "drafter_training.block_size=64", "drafter_training.ttt_steps=2",
           f"hydra.run.dir={tmp_path / 'run'}", f"data.path={embedded_corpus / 'train.json'}",
           f"drafter_training.validation_path={embedded_corpus / 'validation.json'}",
           "drafter_training.draft_vocab_size=1024", "drafter_training.corpus_text=0", "drafter_training.curve.every=null"]
    r = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    from eagle_backbone.loading import load_pair

    pair = load_pair({**{o.split("=", 1)[0][6:]: o.split("=", 1)[1] for o in over}, "drafter": str(head),
                      "drafter_kind": "eagle3", "device": "cpu"})
    assert pair.candidates.kind == "eagle3" and pair.candidates.feature_layers == (0, 1, 2)
    assert (tmp_path / "eagle_layout" / "model.safetensors").exists()
    summary = json.loads((head / "training_summary.json").read_text())
    from eagle_backbone.train.eagle3 import blocks_of, frequent_tokens

    records = [json.loads(x) for t in ("0", "1") for x in (tmp_path / "distill" / f"train-T{t}.jsonl").read_text().splitlines()]
    kept, coverage = frequent_tokens(*blocks_of(records, 64, 0), 1024, 4096)
    assert Eagle3Drafter.from_pretrained(head).draft_to_target().tolist() == kept
    assert (summary["draft_vocab_size"], summary["draft_vocab_coverage"]) == (1024, coverage)


def test_a_head_continues_on_distilled_and_corpus_text_with_its_learning_curve(tmp_path, embedded_corpus):
    """``drafter_training.init_from`` starts from a trained head, ``corpus_text=N`` mixes N corpus answers in, and
    ``curve.every`` writes τ of the head (and once of the reference) per step, set and T into ckpt_dir/curve.jsonl;
    a missing set is left out; a rerun with more steps resumes and adds only the new steps' points."""
    import json

    save_tiny_pair(tmp_path, vocab=4096, layers=3)
    over = [o for o in pair_overrides(tmp_path, "float32") if not o.startswith(("model.drafter", "model.name"))]

    def run(head, steps, *extra, ok=True):
        cmd = [sys.executable, "scripts/train_drafter.py", "drafter=eagle3", *over, f"model.drafter={head}",
               f"trainer.max_steps={steps}", "trainer.precision=32-true", "trainer.limit_val_batches=1",
               "trainer.enable_progress_bar=false", "drafter_training.layer_ids=[0,1,2]",
               f"drafter_training.distill.dir={tmp_path / 'distill'}", "drafter_training.distill.prompts=8",
               "drafter_training.distill.validation_prompts=2", "drafter_training.distill.max_new_tokens=8",
               "drafter_training.batch_size=2", "drafter_training.block_size=64", "drafter_training.ttt_steps=2",
               f"hydra.run.dir={tmp_path / 'run'}", f"data.path={embedded_corpus / 'train.json'}",
               f"drafter_training.validation_path={embedded_corpus / 'validation.json'}", *extra]
        r = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert (r.returncode == 0) == ok, r.stderr[-3000:]
        return r

    run(tmp_path / "first", 1, f"drafter_training.ckpt_dir={tmp_path / 'ckpt1'}", "drafter_training.corpus_text=0",
        "drafter_training.curve.every=null")
    curve = [f"drafter_training.ckpt_dir={tmp_path / 'ckpt2'}", f"drafter_training.init_from={tmp_path / 'first'}",
             "drafter_training.checkpoint_every=1",
             "drafter_training.corpus_text=5", "drafter_training.curve.every=2", "drafter_training.curve.prompts=2",
             "drafter_training.curve.max_new_tokens=6", "drafter_training.curve.temperatures=[0.0,1.0]",
             f"drafter_training.curve.sets.embedded_test={embedded_corpus / 'test.json'}",
             f"drafter_training.curve.sets.mt_bench={tmp_path / 'absent.jsonl'}",
             f"drafter_training.curve.reference.path={tmp_path / 'drafter'}"]
    r = run(tmp_path / "second", 2, *curve)
    assert "prompt set mt_bench skipped" in r.stdout + r.stderr
    summary = json.loads((tmp_path / "second" / "training_summary.json").read_text())
    assert (summary["corpus_records"], summary["distilled_records"]) == (5, 16)
    assert summary["init_from"] == str(tmp_path / "first")
    rows = [json.loads(x) for x in (tmp_path / "ckpt2" / "curve.jsonl").read_text().splitlines()]
    key = [(x["drafter"], x["step"], x["set"], x["temperature"]) for x in rows]
    assert key == [("eagle1", None, "embedded_test", 0.0), ("eagle1", None, "embedded_test", 1.0),
                   ("head", 0, "embedded_test", 0.0), ("head", 0, "embedded_test", 1.0),
                   ("head", 2, "embedded_test", 0.0), ("head", 2, "embedded_test", 1.0)]
    assert all(1.0 <= x["tau"] <= 3 and x["prompts"] == 2 for x in rows)  # γ = 6, 6 tokens: at most 3 per forward... or fewer
    run(tmp_path / "second", 4, *curve)  # resumed from step 2: only step 4's points are new
    rows = [json.loads(x) for x in (tmp_path / "ckpt2" / "curve.jsonl").read_text().splitlines()]
    assert [(x["drafter"], x["step"]) for x in rows[6:]] == [("head", 4), ("head", 4)]
    r = run(tmp_path / "third", 6, *curve, "drafter_training.lr=5e-4", ok=False)  # another recipe, same ckpt_dir
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'ckpt2' / 'last.ckpt'}: made with other settings (lr: 0.001 -> 0.0005); pass "
        "resume=false to train from the start, or give this run its own ckpt_dir"), r.stderr[-2000:]
    assert not (tmp_path / "third").exists()
    from ldlp.report.eagle3_curve import write_curve_page

    page = write_curve_page(tmp_path / "ckpt2" / "curve.jsonl", tmp_path / "page", "tiny", offset_tokens=1000)
    lines = page["markdown"].splitlines()
    assert "| step | block tokens (M) | embedded_test T=0 | embedded_test T=1 |" in lines
    assert [x.split(" | ")[0] for x in lines if x.startswith("| ") and x[2].isdigit()] == ["| 0", "| 2", "| 4"]
    assert any(x.startswith("| eagle1 (reference) |") and "(1.000)" in x for x in lines)
    assert (tmp_path / "page" / "curve.png").stat().st_size > 0


def test_corpus_records_are_first_answers_of_the_data(embedded_corpus):
    from eagle_backbone.data.conversations import encode_chat, load_conversations, to_messages
    from eagle_backbone.loading import load_tokenizer
    from eagle_backbone.train.eagle3 import corpus_records

    tok = load_tokenizer(str(REPO_ROOT / "data" / "embedded" / "tokenizer"))
    recs = corpus_records(embedded_corpus / "train.json", tok, 3, 128)
    conv = load_conversations(str(embedded_corpus / "train.json"), limit=1)[0]
    msgs = to_messages(conv["conversations"])[:2]
    assert len(recs) == 3 and recs[0]["source"] == "corpus"
    assert recs[0]["prompt_ids"] + recs[0]["response_ids"] == encode_chat(tok, msgs)
    assert corpus_records(embedded_corpus / "train.json", tok, 0, 128) == []


def test_all_corpus_records_are_every_conversations_first_answer(embedded_corpus, tmp_path):
    """``corpus_text: all`` (a limit of None): every conversation's first answer, the same records as a count of
    them; a count that is no count is refused in one line naming the key."""
    from eagle_backbone.loading import load_tokenizer
    from eagle_backbone.train.eagle3 import corpus_records, count_of

    tok = load_tokenizer(str(REPO_ROOT / "data" / "embedded" / "tokenizer"))
    four = tmp_path / "four.json"
    four.write_text(json.dumps(json.loads((embedded_corpus / "train.json").read_text())[:4]))
    every = corpus_records(four, tok, count_of("all", "corpus_text"), 128)
    assert len(every) == 4 and every == corpus_records(four, tok, 4, 128) == corpus_records(four, tok, 9, 128)
    with pytest.raises(ValueError, match=r"^drafter_training.corpus_text: -2: give a count >= 0 or 'all'$"):
        count_of(-2, "corpus_text")
