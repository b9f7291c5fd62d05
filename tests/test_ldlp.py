"""The LDLP: heads, losses, checkpoints, data checks, learning a known rule, and the Lightning runs
(single process, two-process DDP, W&B offline) of scripts/train_ldlp.py on a tiny synthetic oracle: an incomplete
collection or a torn checkpoint is refused in one line, and a resumed run equals an uninterrupted one."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config, one_line

from ldlp.labels.store import load_oracle_rows
from ldlp.models.predictor import LDLP, LDLPConfig, asymmetric_l1, survival_nll
from ldlp.training.baselines import evaluate_all, length_metrics
from ldlp.training.predictor import LDLPModule, OracleDataModule, predict_lengths

REPO = Path(__file__).resolve().parent.parent
K_MAX = 4


# -- synthetic oracle directories ----------------------------------------------------------------------


def synthetic_rule(feature: np.ndarray) -> np.ndarray:
    """Labels that are a known function of the feature: a clipped linear score."""
    return np.clip(np.rint(1.5 + 1.5 * feature[..., 0] - 1.0 * feature[..., 1]), 0, K_MAX).astype(np.int64)


def write_rule_oracle(out_dir: Path, n_conversations: int, rows_per_conv: int, d: int, store_features: bool,
                 vocab: int = 64, seed: int = 0, target=None) -> Path:
    """An oracle directory in the collector's format: ``n_conversations`` sequences (every fifth in validation) whose
    labels are :func:`synthetic_rule` of their features. With ``target`` the features are the target's own
    (teacher-forced) so that recomputation reproduces them; otherwise random."""
    import datasets
    import pyarrow as pa

    from ldlp.labels.store import META_SUFFIX, ROWS_SUFFIX, SEQS_SUFFIX, rows_features, sequences_features

    rng = np.random.default_rng(seed)
    rows = {c: [] for c in ("seq_id", "conversation_id", "split", "index", "last_token", "label", "remaining",
                            "draft_top1_prob", "draft_entropy", "target_prob", "target_stats", "feature")}
    seqs = {c: [] for c in ("seq_id", "conversation_id", "split", "input_ids", "prompt_len", "positions", "eos")}
    for s in range(n_conversations):
        prompt_len = 3
        ids = rng.integers(3, vocab, prompt_len + rows_per_conv + 1).tolist()
        split = "validation" if s % 5 == 0 else "train"
        if target is not None:
            _, f = target(torch.tensor([ids]))
            feats = f[0].float().numpy()
        else:
            feats = rng.normal(size=(len(ids), d)).astype(np.float32)
        for i in range(prompt_len, len(ids) - 1):
            rows["seq_id"].append(s)
            rows["conversation_id"].append(f"conv-{s}")
            rows["split"].append(split)
            rows["index"].append(i)
            rows["last_token"].append(ids[i])
            rows["label"].append(int(synthetic_rule(feats[i - 1])))
            rows["remaining"].append(len(ids) - 1 - i)
            for c in ("draft_top1_prob", "draft_entropy", "target_prob"):
                rows[c].append(rng.random(K_MAX).tolist())
            rows["target_stats"].append(rng.random(3).tolist())
            rows["feature"].append(feats[i - 1].tolist())
        for c, v in zip(("seq_id", "conversation_id", "split", "input_ids", "prompt_len"),
                        (s, f"conv-{s}", split, ids, prompt_len)):
            seqs[c].append(v)
        seqs["positions"].append(rows_per_conv)
        seqs["eos"].append(False)
    if not store_features:
        rows.pop("feature")
    # one complete part per split, laid out as the collector writes them
    row_feats = rows_features(K_MAX, d if store_features else None, "float32", "float32")
    for split in ("train", "validation"):
        part = out_dir / split / "w0.00000"
        part.parent.mkdir(parents=True, exist_ok=True)
        for table, feats, suffix in ((rows, row_feats, ROWS_SUFFIX), (seqs, sequences_features(), SEQS_SUFFIX)):
            keep = [i for i, sp in enumerate(table["split"]) if sp == split]
            t = datasets.Dataset.from_dict({c: [v[i] for i in keep] for c, v in table.items()}, features=feats)
            with pa.OSFile(str(part) + suffix, "wb") as sink, pa.ipc.new_stream(sink, t.data.table.schema) as w:
                w.write_table(t.data.table)
        (Path(str(part) + META_SUFFIX)).write_text(json.dumps({"rows": len(keep)}))
    (out_dir / "manifest.json").write_text(json.dumps({"k_max": K_MAX, "store_features": store_features}))
    return out_dir


def tiny_target_folder(path: Path) -> Path:
    from conftest import tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)
    return path


@pytest.fixture
def one_thread():
    """Small models gain nothing from more threads, and oversubscribed ones crawl on a busy machine."""
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(1):
        yield
    torch.set_num_threads(before)


# -- model, heads and losses ---------------------------------------------------------------------------


def test_asymmetric_l1_gives_the_intended_gradients():
    pred = torch.tensor([1.0, 5.0, 3.5], requires_grad=True)
    label = torch.tensor([3, 2, 3])
    loss = asymmetric_l1(pred, label, under_weight=4.0)
    loss.backward()
    assert loss.item() == pytest.approx((4.0 * 2 + 3 + 0.5) / 3)
    # under-prediction pulls up λ times harder than over-prediction pushes down
    assert pred.grad.tolist() == pytest.approx([-4.0 / 3, 1.0 / 3, 1.0 / 3])


def test_survival_nll_is_the_categorical_likelihood_and_survival_falls():
    torch.manual_seed(0)
    model = LDLP(LDLPConfig(input_dim=8, hidden_dim=16, k_max=K_MAX, head="distribution"))
    x = torch.randn(5, 8)
    out = model(x)
    surv = model.survival_from_output(out)  # (5, K_MAX)
    assert torch.all(surv[:, 1:] <= surv[:, :-1] + 1e-7) and torch.all((surv > 0) & (surv < 1))
    s = torch.cat([torch.ones(5, 1), surv, torch.zeros(5, 1)], dim=1)
    pmf = s[:, :-1] - s[:, 1:]  # P(L = 0..k_max)
    assert torch.allclose(pmf.sum(1), torch.ones(5), atol=1e-6)
    labels = torch.tensor([0, 1, 2, 3, 4])
    expected = -torch.log(pmf[torch.arange(5), labels]).mean()
    assert survival_nll(out, labels).item() == pytest.approx(expected.item(), rel=1e-5)


def test_predict_length_per_head():
    d = 4
    e, f = torch.zeros(d), torch.zeros(d)
    reg = LDLP(LDLPConfig(input_dim=2 * d, k_max=K_MAX, head="regression"))
    with torch.no_grad():
        reg.output.weight.zero_()
        for bias, gamma in ((2.4, 2), (2.6, 3), (-1.0, 0), (9.0, K_MAX)):
            reg.output.bias.fill_(bias)
            assert reg.predict_length(e, f) == gamma
    assert isinstance(reg.predict_length(e, f), int)
    assert reg.predict_length(e[None].repeat(3, 1), f[None].repeat(3, 1)).tolist() == [K_MAX] * 3

    cls = LDLP(LDLPConfig(input_dim=2 * d, k_max=K_MAX, head="classification"))
    with torch.no_grad():
        cls.output.weight.zero_()
        cls.output.bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0, 0.0]))
    assert cls.predict_length(e, f) == 2

    dist = LDLP(LDLPConfig(input_dim=2 * d, k_max=K_MAX, head="distribution", threshold=0.5))
    with torch.no_grad():
        dist.output.weight.zero_()
        # continuation probabilities 0.99, 0.99, 0.3, 0.99 -> survival ~0.99, 0.98, 0.29, 0.29: γ = 2
        dist.output.bias.copy_(torch.logit(torch.tensor([0.99, 0.99, 0.3, 0.99])))
    assert dist.predict_length(e, f) == 2
    assert dist.survival(e, f).shape == (K_MAX,)
    with pytest.raises(ValueError, match="regression head"):
        reg.survival(e, f)


@pytest.mark.parametrize("head", ["regression", "classification", "distribution"])
def test_one_position_path_matches_the_batched_forward(head):
    torch.manual_seed(0)
    d = 6
    model = LDLP(LDLPConfig(input_dim=2 * d, hidden_dim=16, k_max=K_MAX, head=head, num_layers=4)).eval()
    with torch.no_grad():
        model.output.weight.mul_(20)  # spread the outputs over all lengths
        if head == "distribution":
            model.output.bias.fill_(3.0)  # continuation likely, so that long lengths occur too
    model.set_normalization(torch.randn(2 * d), torch.rand(2 * d) + 0.5)
    e, f = torch.randn(50, d, dtype=torch.float64), torch.randn(50, d, dtype=torch.float64)
    batched = model.predict_length(e, f)
    assert len(set(batched.tolist())) >= 3
    assert [model.predict_length(e[i], f[i]) for i in range(50)] == batched.tolist()
    # the numpy snapshot the policies decide one row with on a CPU: from [e; f], and from a token id, whose
    # first-layer half it keeps per token (asked twice: the kept row gives the same answer)
    net = model.numpy_decoder()
    assert [net.length(x=torch.cat((e[i], f[i])).numpy()) for i in range(50)] == batched.tolist()
    embed = torch.nn.Embedding.from_pretrained(e.float())
    for _ in range(2):
        assert [net.length(token=(i, embed), feature=f[i][None]) for i in range(50)] == batched.tolist()
    model.set_normalization(torch.zeros(2 * d), torch.ones(2 * d))  # in-place change: the folded copy follows
    assert [model.predict_length(e[i], f[i]) for i in range(50)] == model.predict_length(e, f).tolist()
    assert [model.numpy_decoder().length(x=torch.cat((e[i], f[i])).numpy()) for i in range(50)] == \
        model.predict_length(e, f).tolist()


def test_checkpoint_round_trip_and_dimension_errors(tmp_path):
    torch.manual_seed(0)
    model = LDLP(LDLPConfig(input_dim=16, hidden_dim=32, k_max=K_MAX, head="classification", meta={"a": 1}))
    model.set_normalization(torch.randn(16), torch.rand(16) + 0.5)
    model.save_pretrained(tmp_path / "ck")
    loaded = LDLP.from_pretrained(tmp_path / "ck")
    assert loaded.config == model.config
    x = torch.randn(7, 16)
    assert torch.equal(loaded(x), model.eval()(x))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["config.json", "model.safetensors"]

    with pytest.raises(ValueError, match="embedding and feature of size 8"):
        loaded.predict_length(torch.zeros(5), torch.zeros(5))
    # a config that does not match the weights
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["input_dim"] = 32
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="input.weight"):
        LDLP.from_pretrained(tmp_path / "ck")
    with pytest.raises(ValueError, match="not an LDLP checkpoint"):
        LDLP.from_pretrained(tmp_path / "nothing")
    with pytest.raises(ValueError, match="head must be one of"):
        LDLPConfig(input_dim=8, head="ranking")


# -- data and training ---------------------------------------------------------------------------------


def _trainer(max_epochs):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def test_feature_size_mismatch_is_a_clear_error(tmp_path):
    oracle = write_rule_oracle(tmp_path / "oracle", n_conversations=4, rows_per_conv=5, d=6, store_features=True)
    dm = OracleDataModule(str(oracle), feature_dim=8, k_max=K_MAX)
    with pytest.raises(ValueError, match="oracle features have size 6 but the LDLP expects 8"):
        dm.setup("fit")
    with pytest.raises(ValueError, match="embeddings have size 6"):
        LDLPModule(dict(input_dim=16, k_max=K_MAX), embedding=torch.zeros(10, 6))


@pytest.mark.parametrize("head", ["regression", "classification", "distribution"])
def test_learns_a_synthetic_rule(tmp_path, head, one_thread):
    import lightning as L

    L.seed_everything(0)
    d, vocab = 8, 64
    oracle = write_rule_oracle(tmp_path / "oracle", n_conversations=60, rows_per_conv=40, d=d, store_features=True)
    dm = OracleDataModule(str(oracle), feature_dim=d, k_max=K_MAX, batch_size=64)
    module = LDLPModule(dict(input_dim=2 * d, hidden_dim=64, k_max=K_MAX, head=head),
                        embedding=torch.randn(vocab, d), under_weight=2.0, lr=3e-3)
    _trainer(max_epochs=12).fit(module, datamodule=dm)
    tokens, feats, labels = dm.val.tensors
    assert len(set(np.unique(labels.numpy()))) >= 4  # the rule spans most lengths
    pred = predict_lengths(module.ldlp, module.inputs(tokens, feats))
    metrics = length_metrics(pred, labels.numpy(), under_weight=2.0)
    constant = length_metrics(np.full(len(labels), int(np.median(labels))), labels.numpy(), 2.0)
    assert metrics["mae"] < 0.2 and metrics["acc"] > 0.8, metrics
    assert metrics["mae"] < constant["mae"] / 3


def test_recomputed_features_match_stored_ones_and_split_by_conversation(tmp_path):
    from conftest import make_target

    target = make_target(dtype=torch.float32)
    kw = dict(n_conversations=10, rows_per_conv=6, d=target.hidden_size, target=target)
    stored = write_rule_oracle(tmp_path / "stored", store_features=True, **kw)
    bare = write_rule_oracle(tmp_path / "bare", store_features=False, **kw)
    dms = []
    for path, cache in ((stored, None), (bare, tmp_path / "cache")):
        dm = OracleDataModule(str(path), feature_dim=target.hidden_size, k_max=K_MAX, target=target,
                              feature_cache=str(cache) if cache else None, target_path="tiny", drop_censored=False)
        dm.prepare_data()
        dm.setup("fit")
        dms.append(dm)
    for a, b in zip(dms[0].train.tensors + dms[0].val.tensors, dms[1].train.tensors + dms[1].val.tensors):
        assert torch.allclose(a.float(), b.float(), atol=1e-5)
    assert (tmp_path / "cache" / "fingerprint.json").is_file()
    assert len(dms[0].val) == 2 * 6 and len(dms[0].train) == 8 * 6  # conversations 0 and 5 are validation


def test_censored_rows_are_dropped(tmp_path):
    oracle = write_rule_oracle(tmp_path / "oracle", n_conversations=5, rows_per_conv=10, d=4, store_features=True)
    rows = list(load_oracle_rows(oracle))
    censored = sum(r["label"] == r["remaining"] < K_MAX for r in rows)
    assert censored > 0
    kept = {}
    for drop in (True, False):
        dm = OracleDataModule(str(oracle), feature_dim=4, k_max=K_MAX, drop_censored=drop)
        dm.setup("fit")
        kept[drop] = len(dm.train) + len(dm.val)
    assert kept[False] == len(rows) and kept[True] == len(rows) - censored


def test_baselines_table(one_thread):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 4)).astype(np.float32)
    y = synthetic_rule(x)
    res = evaluate_all(ldlp_pred=y[400:], ldlp_name="oracle", x_train=x[:400], y_train=y[:400], x_val=x[400:],
                       y_val=y[400:], k_max=K_MAX, under_weight=3.0)
    assert list(res) == ["oracle", "constant", "linear", "logistic", "hgb"]
    assert res["oracle"]["mae"] == 0 and res["oracle"]["under"] == 0
    assert res["linear"]["mae"] < res["constant"]["mae"]


# -- the script: single process, DDP, W&B offline ------------------------------------------------------


@pytest.fixture(scope="module")
def script_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ldlp_script")
    target = tiny_target_folder(root / "target")
    from eagle_backbone.target import TargetModel

    tm = TargetModel.from_pretrained(target)
    oracle = write_rule_oracle(root / "oracle", n_conversations=10, rows_per_conv=20, d=tm.hidden_size,
                          store_features=False, target=tm)
    return root, target, oracle


def run_script(root: Path, target: Path, oracle: Path, name: str, *overrides, env=None) -> Path:
    out = root / name
    cmd = [sys.executable, str(REPO / "scripts" / "train_ldlp.py"), f"model.target={target}",
           f"ldlp_training.oracle_dir={oracle}", f"ldlp_training.out_dir={out}",
           f"ldlp_training.feature_cache={root / 'cache'}", f"hydra.run.dir={root / 'runs' / name}",
           "ldlp.hidden_dim=32", "ldlp_training.batch_size=32", "trainer.max_epochs=2",
           "trainer.enable_progress_bar=false", "ldlp_training.evaluation.benchmark_reps=20", "threads=1", *overrides]
    res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONHASHSEED": "0", **(env or {})})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return out


def test_train_script_tiny_run(script_inputs):
    root, target, oracle = script_inputs
    out = run_script(root, target, oracle, "single")
    ldlp = LDLP.from_pretrained(out)
    assert ldlp.config.input_dim == 64 and ldlp.config.k_max == K_MAX
    assert ldlp.config.meta["target"] == str(target)
    assert set(ldlp.config.meta["made_for"]) == {"model", "dtype", "drafter_kind", "drafter_weights"}  # from the labels' manifest
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["results"]) == {"LDLP (regression)", "constant", "linear", "logistic", "hgb"}
    for m in metrics["results"].values():
        assert 0 <= m["acc"] <= 1 and m["mae"] >= 0
    assert metrics["val_rows"] > 0 and metrics["train_rows"] > 0
    assert metrics["timing"]["ldlp_us"] > 0
    assert (out / "metrics.md").read_text().startswith("# LDLP validation metrics")  # renders, from metrics.json
    assert (out / "checkpoints" / "best.ckpt").is_file()
    assert list((root / "runs" / "single").rglob("metrics.csv"))  # the CSV logger wrote


# Lightning's own plumbing, run end to end (DDP's two processes, wandb's offline logger): marked slow to keep CI's
# clean-clone run within its 10 minutes; `pytest -m slow` runs them (the one-process script run above stays)
@pytest.mark.slow
def test_train_script_ddp_two_processes(script_inputs):
    root, target, oracle = script_inputs
    out = run_script(root, target, oracle, "ddp", "trainer=ddp", "trainer.max_epochs=1",
                     "ldlp_training.evaluation.baselines=[constant]", "ldlp_training.evaluation.benchmark=false")
    assert LDLP.from_pretrained(out).config.head == "regression"
    assert json.loads((out / "metrics.json").read_text())["steps"] > 0


@pytest.mark.slow
def test_train_script_wandb_offline(script_inputs):
    pytest.importorskip("wandb")
    root, target, oracle = script_inputs
    run_script(root, target, oracle, "wandb", "logger=wandb", "ldlp=distribution", "trainer.max_epochs=1",
               "ldlp_training.evaluation.baselines=[constant]", "ldlp_training.evaluation.benchmark=false",
               env={"WANDB_MODE": "offline", "WANDB_DIR": str(root / "wandb"), "WANDB_SILENT": "true"})
    assert list((root / "runs" / "wandb").rglob("offline-run-*")) or list((root / "wandb").rglob("offline-run-*"))


# -- incomplete collections, torn checkpoints and resumed runs


def test_ldlp_training_refuses_an_incomplete_collection_and_records_the_override(tmp_path):
    from ldlp.models.predictor import LDLP
    from ldlp.training.predictor import run_ldlp_training

    target = tiny_target_folder(tmp_path / "target")
    oracle = write_rule_oracle(tmp_path / "oracle", n_conversations=5, rows_per_conv=6, d=32, store_features=True)
    for meta in oracle.glob("*/*.json"):
        meta.write_text(json.dumps({"sequences": 4 if meta.parent.name == "train" else 1}))
    manifest = json.loads((oracle / "manifest.json").read_text())
    (oracle / "manifest.json").write_text(json.dumps({**manifest, "num_prompts": 7, "config": {"num_shards": 1}}))
    overrides = [f"model.target={target}", f"ldlp_training.oracle_dir={oracle}", f"ldlp_training.out_dir={tmp_path / 'o'}",
                 f"ldlp_training.feature_cache={tmp_path / 'cache'}", "ldlp.hidden_dim=8", "trainer.max_epochs=1",
                 "trainer.enable_progress_bar=false", "ldlp_training.evaluation.baselines=[constant]",
                 "ldlp_training.evaluation.benchmark=false", f"logger.save_dir={tmp_path}",
                 f"trainer.default_root_dir={tmp_path}", "threads=1"]
    cfg = compose_config("train_ldlp", overrides)
    cfg_partial = compose_config("train_ldlp", overrides + ["allow_partial=true"])
    with pytest.raises(ValueError) as e:
        run_ldlp_training(cfg)
    assert "2 of 7 sequences are missing" in one_line(e) and "allow_partial=true" in str(e.value)
    run_ldlp_training(cfg_partial)
    meta = LDLP.from_pretrained(tmp_path / "o").config.meta
    assert meta["allow_partial"] is True and meta["oracle_collection"]["missing_sequences"] == 2


def test_a_torn_last_checkpoint_with_resume_fails_in_one_line(tmp_path):
    from ldlp.training.predictor import run_ldlp_training

    oracle = write_rule_oracle(tmp_path / "oracle", n_conversations=5, rows_per_conv=6, d=32, store_features=True)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with zipfile.ZipFile(ckpt / "whole.ckpt", "w") as z:  # what torch.save writes: a zip archive
        z.writestr("archive/data.pkl", b"x" * 5000)
    data = (ckpt / "whole.ckpt").read_bytes()
    (ckpt / "last.ckpt").write_bytes(data[: len(data) // 2])
    cfg = compose_config("train_ldlp", [
        f"model.target={tmp_path / 'no_target_needed'}", f"ldlp_training.oracle_dir={oracle}",
        f"ldlp_training.ckpt_dir={ckpt}", "resume=true", f"logger.save_dir={tmp_path}",
        f"trainer.default_root_dir={tmp_path}"])
    with pytest.raises(ValueError) as e:  # before the target is loaded (there is none)
        run_ldlp_training(cfg)
    msg = one_line(e)
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
    assert str(ckpt / "last.ckpt") in one_line(e) and "torn or corrupt" in str(e.value)


def test_ldlp_training_resumed_from_last_ckpt_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    from ldlp.models.predictor import LDLP
    from ldlp.training import predictor as P

    target = tiny_target_folder(tmp_path / "target")
    oracle = write_rule_oracle(tmp_path / "oracle", n_conversations=10, rows_per_conv=6, d=32, store_features=True)

    def cfg(name, *extra):
        return compose_config("train_ldlp", [
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
