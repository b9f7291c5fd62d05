"""Oracle labels and the LDLP on an EAGLE-3 pair (ldlp/labels/oracle.py, oracle_labels_eagle3): the vectorised labels equal
the engine's drafting loop run at every position, and the collector writes rows an LDLP reads (the target's
embedding and final-normed last hidden state: width d, not the drafter's fused 3d layer states), whose policy then
runs on the EAGLE-3 engine. That drafting exactly the label wastes nothing in the engine is checked for EAGLE-1 and
EAGLE-3 alike in tests/test_oracle.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import decode, make_eagle3, save_tiny_target
from oracle_helpers import CONVS, VAL, assert_same_rows

from eagle_backbone.decoder import autoregressive_generate
from ldlp.labels.oracle import oracle_labels
from ldlp.labels.oracle import oracle_labels_eagle3_sequential

torch.set_num_threads(1)


def _sequence(target, prompt, n):
    return list(prompt) + autoregressive_generate(target, prompt, n).tokens


@pytest.mark.parametrize("draft_vocab, k_max, rows", [(None, 4, None), (5, 5, 3), (None, 1, None)])
def test_vectorised_equals_the_engines_loop(t3, draft_vocab, k_max, rows):
    d = make_eagle3(t3, draft_vocab=draft_vocab)
    s = _sequence(t3, [1, 5, 3, 6, 2], 14)
    got = oracle_labels(t3, d, s, 5, k_max, max_rows_per_pass=rows)
    ref = oracle_labels_eagle3_sequential(t3, d, s, 5, k_max)
    assert_same_rows({k: got[k] for k in ref}, ref, atol=1e-5)
    assert got["feature"].shape[-1] == t3.hidden_size and got["draft_state"].shape[-1] == t3.hidden_size
    assert 0 < int(got["label"].sum()) or draft_vocab is not None  # accepted drafts as well as misses


@pytest.fixture(scope="module")
def eagle3_dirs(tmp_path_factory):
    """A tiny tokenizer, 3-layer target and EAGLE-3 head (speculators' layout) saved like the embedded pair."""
    from eagle_backbone.eagle3 import Eagle3Drafter

    root = tmp_path_factory.mktemp("pair3")
    model = save_tiny_target(root, layers=3)
    torch.manual_seed(1)
    head = Eagle3Drafter.from_target_config(model.config, layer_ids=(0, 1, 2))
    with torch.no_grad():
        head.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
    head.save_pretrained(root / "eagle3")
    (root / "train.json").write_text(json.dumps(CONVS[:3]))
    (root / "validation.json").write_text(json.dumps(VAL[:1]))
    return root


def test_collector_and_ldlp_run_on_an_eagle3_pair(eagle3_dirs, tmp_path):
    from hydra import compose, initialize_config_dir

    from eagle_backbone.batched_engine import BatchedSpeculativeEngine
    from eagle_backbone.loading import load_pair
    from eagle_backbone.paths import REPO_ROOT
    from ldlp.labels.collect import collect_oracle
    from ldlp.labels.store import load_oracle_rows, read_rows
    from ldlp.policies.threshold import LDLPPolicy
    from ldlp.models.predictor import LDLP, LDLPConfig

    root = eagle3_dirs
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("collect_oracle", overrides=[
            "model=embedded_eagle3", "model.dtype=float32", f"model.target={root}/target",
            f"model.tokenizer={root}/target", f"model.drafter={root}/eagle3", f"data.path={root}/train.json",
            f"data.validation_path={root}/validation.json", "data.limit=null", "data.validation_limit=null",
            "generation.max_new_tokens=8", "k_max=4", "progress=false", f"out_dir={tmp_path / 'oracle'}"])
    assert cfg.model.drafter_kind == "eagle3"
    report = collect_oracle(cfg)
    rows = load_oracle_rows(tmp_path / "oracle")
    assert len(rows) == report["positions"] > 0 and set(rows["split"]) == {"train", "validation"}
    manifest = json.loads((tmp_path / "oracle" / "manifest.json").read_text())
    assert manifest["identity"]["model"]["drafter_kind"] == "eagle3" and manifest["feature_dim"] == 32
    assert len(rows[0]["feature"]) == 32 and len(rows[0]["draft_state"]) == 4 * 32

    # an LDLP reads (the target's embedding of the last token, the row's feature): 2d inputs, d = 32
    pair = load_pair(cfg.model)
    ldlp = LDLP(LDLPConfig(input_dim=64, k_max=4)).eval()
    cols, _ = read_rows(tmp_path / "oracle", ["feature", "last_token"])
    feats = torch.from_numpy(cols["feature"]).float()
    emb = pair.target.embed(torch.from_numpy(cols["last_token"]).long())
    lengths = ldlp.predict_length(emb, feats)
    assert lengths.shape == (len(rows),) and int(lengths.min()) >= 0 and int(lengths.max()) <= 4

    # and its policy drafts on the EAGLE-3 engine, from Rows.features (width d), losslessly
    ldlp.save_pretrained(tmp_path / "ldlp")
    eng = BatchedSpeculativeEngine(pair.target, pair.drafter, "eagle3", slots=2,
                                   policy=LDLPPolicy(str(tmp_path / "ldlp"), max_gamma=4))
    assert eng.feat.shape[-1] == 3 * 32 and eng.last_feat.shape[-1] == 32
    prompt = [5, 9, 11, 3]
    outs = decode(eng, [prompt, prompt[:3]], n=8)
    assert [o.tokens for o in outs] == [pair.target.reference_greedy(p, 8) for p in (prompt, prompt[:3])]
