"""Per-position acceptance: labels against a by-hand recomputation, seeding, the head's batched forward and
files, the collector's resume, and the training/calibration report on a tiny collection."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, compose_config, one_line
from omegaconf import OmegaConf
from oracle_helpers import arrow_files

from eagle_backbone.sampling import SamplingConfig, probs_from_logits
from ldlp.models.acceptance import (
    DraftAcceptanceHead,
    DraftAcceptanceHeadConfig,
    prob_features,
)
from ldlp.labels.acceptance_labels import acceptance_labels, collect_acceptance
from ldlp.report.labels import write_acceptance_labels_page

PROMPT, BUDGET, K = [5, 9, 13, 4], 12, 4


def by_hand(target, drafter, seq, i, chain, sampling):
    """p_m and q_m for row ``i``: fresh passes, no cache shared with the collector."""
    prefix = seq[: i + 1]
    logits, feats = target(torch.tensor([prefix + chain[:-1]]))
    P = probs_from_logits(logits[0, i:], sampling)
    cache = drafter.new_cache()
    h = drafter(torch.tensor([prefix[1:]]), feats[:, :i].to(torch.float64), cache)[:, -1:]
    qs = []
    for m, tok in enumerate(chain):
        qs.append(probs_from_logits(target.lm_head(h)[0, -1], sampling))
        if m < len(chain) - 1:
            h = drafter(torch.tensor([[tok]]), h, cache)
    return P, torch.stack(qs)


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_labels_equal_a_by_hand_recomputation(target, drafter, temperature):
    sampling = SamplingConfig(temperature=temperature)
    response, lab = acceptance_labels(target, drafter, PROMPT, BUDGET, K, sampling, seed=3, seq_id=1)
    seq = PROMPT + response
    assert lab["index"].tolist() == list(range(len(PROMPT), len(seq) - 1))
    for r in range(len(lab["index"])):
        i, chain = int(lab["index"][r]), lab["draft_tokens"][r].tolist()
        P, Q = by_hand(target, drafter, seq, i, chain, sampling)
        if temperature == 0:
            assert chain == Q.argmax(-1).tolist()
            assert lab["beta"][r].tolist() == (P.argmax(-1) == torch.tensor(chain)).double().tolist()
            assert lab["kept"][r].tolist() == (P.argmax(-1) == torch.tensor(chain)).tolist()
        else:
            torch.testing.assert_close(lab["beta"][r].double(), torch.minimum(P, Q).sum(-1), atol=1e-5, rtol=0)
        ar = torch.arange(K)
        torch.testing.assert_close(lab["target_prob"][r].double(), P[ar, chain], atol=1e-5, rtol=0)
        torch.testing.assert_close(lab["draft_prob"][r].double(), Q[ar, chain], atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.stack([lab["draft_log_top1"][r], lab["draft_entropy"][r],
                                                lab["draft_sum_sq"][r]], 1), prob_features(Q), atol=1e-5, rtol=0)
        kept = lab["kept"][r].tolist()
        assert lab["valid"][r].tolist() == [all(kept[:m]) for m in range(K)]  # depth m+1 reached


def test_labels_are_seeded(target, drafter):
    sampling = SamplingConfig(temperature=1.0)
    a = acceptance_labels(target, drafter, PROMPT, BUDGET, K, sampling, seed=0, seq_id=2)
    b = acceptance_labels(target, drafter, PROMPT, BUDGET, K, sampling, seed=0, seq_id=2)
    c = acceptance_labels(target, drafter, PROMPT, BUDGET, K, sampling, seed=1, seq_id=2)
    assert a[0] == b[0]
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k
    assert a[0] != c[0] or not torch.equal(a[1]["draft_tokens"], c[1]["draft_tokens"])


def random_head(d=8, seed=0) -> DraftAcceptanceHead:
    head = DraftAcceptanceHead(DraftAcceptanceHeadConfig(hidden_size=d, temperature=0.7, k_max=4))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return head


def test_head_batched_forward_equals_rows_and_needs_no_host_read():
    head = random_head()
    g = torch.Generator().manual_seed(1)
    states = torch.randn(5, 8, generator=g)
    probs = torch.softmax(3 * torch.randn(5, 11, generator=g), -1)
    depth = torch.tensor([1, 2, 3, 4, 2])
    out = head(states, probs, depth)
    assert out.shape == (5,) and out.dtype == torch.float32 and ((out >= 0) & (out <= 1)).all()
    for r in range(5):
        one = head(states[r:r + 1], probs[r:r + 1], int(depth[r]))
        torch.testing.assert_close(one[0], out[r])
        feats = prob_features(probs[r:r + 1])[0]
        z = (states[r] @ head.state_weight + feats @ head.stat_weight[:3] + depth[r] * head.stat_weight[3]
             + head.bias)
        torch.testing.assert_close(torch.sigmoid(z), out[r])
    assert head.temperature == 0.7
    # on the meta device nothing can be read back: a host sync (.item(), float(), .tolist()) would raise
    meta = random_head().to("meta")
    res = meta(states.to("meta"), probs.to("meta"), depth.to("meta"))
    assert res.shape == (5,) and res.device.type == "meta"


def test_head_files_round_trip_and_refuse_wrong_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    head = random_head()
    head.save_pretrained(tmp_path / "h")
    back = DraftAcceptanceHead.from_pretrained(tmp_path / "h")
    x, q = torch.randn(3, 8), torch.softmax(torch.randn(3, 11), -1)
    torch.testing.assert_close(back(x, q, 2), head(x, q, 2))
    weights = tmp_path / "h" / "model.safetensors"
    state = load_file(str(weights))
    save_file({k: v for k, v in state.items() if k != "bias"}, str(weights))
    with pytest.raises(ValueError, match="missing keys \\['bias'\\]"):
        DraftAcceptanceHead.from_pretrained(tmp_path / "h")
    save_file({**state, "extra": torch.zeros(1)}, str(weights))
    with pytest.raises(ValueError, match="unexpected keys \\['extra'\\]"):
        DraftAcceptanceHead.from_pretrained(tmp_path / "h")
    (tmp_path / "h" / "config.json").write_text('{"kind": "acceptance_head"}')
    with pytest.raises(ValueError, match="not a draft acceptance head"):
        DraftAcceptanceHead.from_pretrained(tmp_path / "h")


def compose(root, out_dir, *overrides):
    return compose_config("collect_acceptance", [
        f"model.target={root}/target", f"model.tokenizer={root}/target", f"model.drafter={root}/drafter",
        "model.dtype=float32", "model.attn_implementation=eager",
        f"data.path={root}/train.json", f"data.validation_path={root}/validation.json", "data.limit=null",
        "data.validation_limit=null", "max_new_tokens=8", "k_max=3", "shard_size=3", "progress=false",
        "temperature=0.7", f"out_dir={out_dir}", *overrides])


@pytest.fixture(scope="module")
def full_collection(pair_dirs, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("acceptance_labels") / "embedded_train" / "t0.7"
    return out, collect_acceptance(compose(pair_dirs, out))


def test_collector_resumes_to_the_same_files(pair_dirs, full_collection, tmp_path):  # noqa: F811
    out, report = full_collection
    assert report["positions"] > 0 and report["this_run"]["complete"]
    part = tmp_path / "resumed"
    first = collect_acceptance(compose(pair_dirs, part, "max_parts_this_run=2"))
    assert not first["this_run"]["complete"]
    # the report of a partial collection says so (report.json; scripts/collect_acceptance.py renders report.md from it)
    assert first["complete"] is False and first["missing_sequences"] > 0
    saved = json.loads((part / "report.json").read_text())
    assert saved["complete"] is False
    page = write_acceptance_labels_page(part, saved).read_text()
    assert page.startswith("# Per-position acceptance labels: ") and "**Partial collection**" in page  # renders
    collect_acceptance(compose(pair_dirs, part))
    assert arrow_files(part) == arrow_files(out)
    with pytest.raises(ValueError, match="other settings"):
        collect_acceptance(compose(pair_dirs, part, "temperature=1.0", f"out_dir={part}"))


def test_training_writes_heads_and_calibration_report(full_collection, tmp_path):
    from ldlp.report.calibration import write_draft_acceptance_report
    from ldlp.training.draft_acceptance import train_at_temperature

    out, _ = full_collection
    cfg = OmegaConf.create({"labels_root": str(out.parent.parent), "in_domain": "embedded_train", "ood": ["absent"],
                            "out_root": str(tmp_path), "C": 0.5, "seed": 0, "val_fraction": 0.1,
                            "max_examples": None, "allow_partial": False, "online_calibration": {}})
    res = train_at_temperature(cfg, 0.7)
    assert list(res["sets"]) == ["validation (in domain)"]  # the absent OOD set is skipped
    summary = write_draft_acceptance_report([res], tmp_path, 10)
    head = DraftAcceptanceHead.from_pretrained(tmp_path / "t0.7")
    assert head.temperature == 0.7
    assert set(head.config.meta["made_for"]) == {"model", "dtype", "drafter_kind", "drafter_weights"}  # from the labels' manifest
    for f in ("metrics.json", "metrics.md", "reliability.png"):
        assert (tmp_path / "t0.7" / f).is_file()
    [scored] = summary["temperatures"]  # calibration.md is written from these scores
    assert "head + online recalibration" in scored["sets"]["validation (in domain)"]["estimators"]
    assert (tmp_path / "calibration.json").is_file()
    assert (tmp_path / "calibration.md").read_text().startswith("# Per-position acceptance heads: calibration")


def test_soft_scores_match_sklearn_on_hard_labels():
    from sklearn.calibration import calibration_curve
    from sklearn.metrics import log_loss

    from ldlp.report.calibration import reliability, scores

    rng = np.random.default_rng(0)
    p = rng.uniform(0.01, 0.99, 400)
    y = (rng.uniform(size=400) < p).astype(float)
    r = reliability(p, y, 10)
    obs, pred = calibration_curve(y, p, n_bins=10)
    np.testing.assert_allclose(r["mean_observed"], obs)
    np.testing.assert_allclose(r["mean_predicted"], pred)
    assert scores(p, y)["log_loss"] == pytest.approx(log_loss(y, p))
    # a soft label counts as its expectation: beta = 0.3 everywhere scores like 30% ones
    s = scores(np.full(10, 0.3), np.full(10, 0.3))
    assert s["ece"] == pytest.approx(0.0) and s["brier"] == pytest.approx(0.21)


def test_paths_default_has_the_draft_acceptance_key():
    assert "draft_acceptance" in OmegaConf.load(Path(REPO) / "conf/paths/default.yaml")


def test_training_checks_every_temperature_before_writing_any_head(full_collection, tmp_path):
    """Labels at T=0.7 only, heads asked for at 0.7 and 1.0: the run stops in one line naming the missing
    collection before the first head (which a load-aware policy would read) is written."""
    import subprocess
    import sys

    out, _ = full_collection
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "train_draft_acceptance.py"),
                          f"labels_root={out.parent.parent}", "temperatures=[0.7,1.0]", f"out_root={tmp_path / 'heads'}",
                          "ood=[]"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].startswith("error: ") and "embedded_train/t1.0" in run.stderr
    assert "collect_acceptance.py data=embedded_train temperature=1.0" in run.stderr
    assert not (tmp_path / "heads").exists()  # no head of T=0.7 went live
    from ldlp.training.draft_acceptance import check_inputs

    cfg = OmegaConf.create({"labels_root": str(out.parent.parent), "in_domain": "embedded_train",
                            "temperatures": [], "allow_partial": False})
    with pytest.raises(ValueError, match="temperatures: empty"):
        check_inputs(cfg)


def test_per_temperature_labels_are_found_however_t_was_spelt_and_missing_ones_name_the_collector(tmp_path):
    from ldlp.training.draft_acceptance import label_folder, load_labels

    (tmp_path / "embedded_train" / "t1").mkdir(parents=True)  # collect_acceptance.py temperature=1
    assert label_folder(tmp_path, "embedded_train", 1.0) == tmp_path / "embedded_train" / "t1"
    assert label_folder(tmp_path, "embedded_train", 0.7) == tmp_path / "embedded_train" / "t0.7"
    with pytest.raises(ValueError) as e:
        load_labels(label_folder(tmp_path, "embedded_train", 0.7))
    msg = one_line(e)
    assert "scripts/collect_acceptance.py data=embedded_train temperature=0.7" in msg and "collect_oracle" not in msg
