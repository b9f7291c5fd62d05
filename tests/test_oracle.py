"""Oracle labels: the vectorised collector equals the naive per-position reference, the labels mean what
they say in the engine (EAGLE-1 and EAGLE-3: drafting exactly the label wastes nothing), and the sharded collection
is resumable, splittable and reloadable. EAGLE-3's vectorised labels and its collector: tests/test_eagle3_oracle.py."""

import json
import random

import numpy as np
import pytest
import torch
from conftest import REPO, compose_config, make_eagle3, one_line
from oracle_helpers import CONVS, LabelPolicy, arrow_files, assert_same_rows, greedy_oracle

from eagle_backbone.decoder import SpeculativeDecoder, autoregressive_generate
from eagle_backbone.drafter_kinds import get_kind
from eagle_backbone.errors import MissingInput
from ldlp.labels.oracle import oracle_labels, oracle_labels_sequential, recompute_features
from ldlp.labels.store import load_oracle_rows, load_oracle_sequences


def perturbed_greedy(target, prompt, length, p_random=0.3, seed=0):
    """Greedy continuation with random tokens mixed in: any sequence is valid input, and this one has
    stretches the drafter gets right and places where it does not."""
    rng = random.Random(seed)
    s = list(prompt)
    while len(s) < len(prompt) + length:
        logits, _ = target(torch.tensor([s]))
        s.append(rng.randrange(3, target.vocab_size) if rng.random() < p_random else int(logits[0, -1].argmax()))
    return s


@pytest.mark.parametrize("k_max, rows_per_pass, full", [(1, None, True), (4, None, True), (8, 5, True),
                                                         (6, 7, False)])
def test_vectorised_equals_sequential(mimic, k_max, rows_per_pass, full):
    target, drafter = mimic
    seqs = [perturbed_greedy(target, [5, 9, 11, 3], 24, seed=k_max), perturbed_greedy(target, [7], 12, seed=1),
            perturbed_greedy(target, [12, 40], 20, p_random=0.0)]  # greedy only: long agreeing stretches
    labels = []
    for s, n in zip(seqs, (4, 1, 2)):
        fast = oracle_labels(target, drafter, s, n, k_max, full_target_prob=full, max_rows_per_pass=rows_per_pass)
        slow = oracle_labels_sequential(target, drafter, s, n, k_max, full_target_prob=full)
        assert_same_rows(fast, slow)
        assert fast["index"].tolist() == list(range(n, len(s) - 1))
        assert torch.equal(fast["last_token"], torch.tensor(s[n:-1]))
        labels += fast["label"].tolist()
    assert min(labels) == 0 and max(labels) == k_max  # the comparison covered short, long and full drafts
    if k_max >= 4:
        assert len(set(labels)) >= 4


def test_vectorised_equals_sequential_random_pair(target, drafter):
    """The general two-layer target with an untrained drafter (labels mostly 0; all statistics compared)."""
    s = perturbed_greedy(target, [4, 8, 15], 25, p_random=0.1, seed=7)
    assert_same_rows(oracle_labels(target, drafter, s, 3, 5, max_rows_per_pass=6),
                     oracle_labels_sequential(target, drafter, s, 3, 5))


def test_target_prob_semantics(mimic):
    target, drafter = mimic
    s = perturbed_greedy(target, [5, 9, 11, 3], 30, seed=2)
    rows = oracle_labels(target, drafter, s, 4, 6, full_target_prob=False)
    assert (rows["label"] <= rows["remaining"]).all()
    assert ((rows["draft_top1_prob"] > 0) & (rows["draft_top1_prob"] <= 1)).all()
    s = perturbed_greedy(target, [5, 9, 11, 3], 30, p_random=0.0)  # greedy: s[i+a+1] is the target's top-1
    rows = oracle_labels(target, drafter, s, 4, 6, full_target_prob=False)
    tp, label = rows["target_prob"], rows["label"]
    for r in range(len(label)):
        a = int(label[r])
        assert not tp[r, : min(a + 1, 6)].isnan().any()  # known along the true prefix and at the first miss
        assert tp[r, a + 1:].isnan().all()
        if a < 6 and a < int(rows["remaining"][r]):
            # the first wrong draft is not the target's greedy token: the target gives it less than its top-1
            logits, _ = target(torch.tensor([s[: int(rows["index"][r]) + a + 1]]))
            assert float(tp[r, a]) < float(torch.softmax(logits[0, -1].float(), -1).max())
            assert int(rows["draft_tokens"][r, a]) != s[int(rows["index"][r]) + a + 1]


def labelled_pair(request, kind):
    """A target and a drafter of ``kind`` whose labels reach accepted drafts: EAGLE-1 the float64 mimic pair (drafts
    agree for a while, then diverge), EAGLE-3 a random head that shares the 8-token float32 target's LM head."""
    if kind == "eagle":
        return request.getfixturevalue("mimic")
    t3 = request.getfixturevalue("t3")
    return t3, make_eagle3(t3)


# per kind: the prompt, the budget, and the features' absolute tolerance (its pair's dtype: float64, float32)
ZERO_WASTE = [pytest.param("eagle", [5, 9, 11, 3], 40, 1e-9, id="eagle"),
              pytest.param("eagle3", [1, 5, 3, 6], 24, 1e-5, id="eagle3")]


@pytest.mark.parametrize("kind, prompt, budget, atol", ZERO_WASTE)
def test_labels_give_zero_waste_in_the_engine(request, kind, prompt, budget, atol):
    """Drafting exactly the label at every step keeps the greedy output and wastes no draft, and the
    stored (last_token, feature) is what the engine's rows hold at that step (EAGLE-3's feature too is the
    target's last hidden state, not the drafter's fused layer states)."""
    target, drafter = labelled_pair(request, kind)
    response, rows = greedy_oracle(target, drafter, prompt, budget, k_max=6)
    policy = LabelPolicy(lambda position: int(rows["label"][position - 1]))
    out = SpeculativeDecoder(target, get_kind(kind)(drafter, target), policy).generate(prompt, budget)
    assert out.tokens == response == autoregressive_generate(target, prompt, budget).tokens
    assert out.stats.wasted_tokens == 0 and out.stats.accepted_tokens > 0
    for ctx in policy.seen:
        r = ctx.position - 1  # row of index i = n + position - 1
        assert ctx.last_token == int(rows["last_token"][r])
        torch.testing.assert_close(ctx.feature, rows["feature"][r], rtol=1e-5, atol=atol)
    # and one more draft than the label is always one wasted token (when the chain may still go on)
    greedy_plus = LabelPolicy(lambda position: int(rows["label"][position - 1]) + 1)
    more = SpeculativeDecoder(target, get_kind(kind)(drafter, target), greedy_plus).generate(prompt, budget)
    assert more.tokens == response and more.stats.wasted_tokens > 0


def test_edge_cases(target, drafter):
    rows = oracle_labels(target, drafter, [5, 6, 7], 2, 4)  # the response is one token: no decision to make
    assert rows["label"].shape == (0,) and rows["target_prob"].shape == (0, 4)
    assert rows["feature"].shape == (0, target.hidden_size)
    s = [5, 6, 7, 8, 9]
    rows = oracle_labels(target, drafter, s, 2, 8)
    assert rows["remaining"].tolist() == [2, 1] and (rows["label"] <= rows["remaining"]).all()
    assert torch.allclose(recompute_features(target, s, 2), rows["feature"])
    with pytest.raises(ValueError, match="k_max"):
        oracle_labels(target, drafter, s, 2, 0)
    with pytest.raises(ValueError, match="prompt_len"):
        oracle_labels(target, drafter, s, 0, 4)


# ---- the collector -----------------------------------------------------------------------------------

def compose(root, out_dir, *overrides):
    return compose_config("collect_oracle", [
        f"model.target={root}/target", f"model.tokenizer={root}/target", f"model.drafter={root}/drafter",
        f"data.path={root}/train.json", f"data.validation_path={root}/validation.json", "data.limit=null",
        "data.validation_limit=null", "generation.max_new_tokens=10", "k_max=4", "shard_size=3", "progress=false",
        f"out_dir={out_dir}", *overrides])


def run(root, out_dir, *overrides):
    from ldlp.labels.collect import collect_oracle

    return collect_oracle(compose(root, out_dir, *overrides))


@pytest.fixture(scope="module")
def full_run(pair_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    return out, run(pair_dirs, out)


def test_collection_files_report_and_manifest(pair_dirs, full_run):
    out, report = full_run
    rows, seqs = load_oracle_rows(out), load_oracle_sequences(out)
    # 7 train conversations x 2 user turns + 3 validation prompts
    assert len(seqs) == 17 and sorted(seqs["seq_id"]) == list(range(17))
    assert set(seqs["split"]) == {"train", "validation"} and set(rows["split"]) == {"train", "validation"}
    assert "c0@turn1" in seqs["conversation_id"]
    assert len(rows) == sum(seqs["positions"]) == report["positions"] > 0
    assert rows.column_names == ["seq_id", "conversation_id", "split", "index", "last_token", "label", "remaining",
                                 "draft_top1_prob", "draft_entropy", "target_prob", "target_stats", "feature",
                                 "draft_state"]
    assert len(rows[0]["feature"]) == 32 and len(rows[0]["target_prob"]) == 4 and len(rows[0]["target_stats"]) == 3
    # every row is the vectorised label of its sequence
    from eagle_backbone.loading import load_pair

    pair = load_pair(compose(pair_dirs, out).model)
    seq = seqs[5]
    ref = oracle_labels(pair.target, pair.drafter, seq["input_ids"], seq["prompt_len"], 4)
    mine = rows.filter(lambda r: r["seq_id"] == seq["seq_id"], keep_in_memory=True)
    assert mine["label"] == ref["label"].tolist() and mine["index"] == ref["index"].tolist()
    np.testing.assert_allclose(np.asarray(mine["feature"]), ref["feature"].float().numpy(), atol=2e-3, rtol=2e-3)
    states = np.asarray(mine["draft_state"]).reshape(len(mine), 4, 32)  # (k_max, d) per row, row-major
    np.testing.assert_allclose(states, ref["draft_state"].float().numpy(), atol=2e-3, rtol=2e-3)
    assert report["label_hist"] == np.bincount(rows["label"], minlength=5).tolist()
    assert report["splits"]["train"]["sequences"] == 14
    saved = json.loads((out / "report.json").read_text())
    assert saved["positions"] == len(rows) and saved["label_hist"] == report["label_hist"]
    assert {s: saved["splits"][s]["sequences"] for s in saved["splits"]} == {"train": 14, "validation": 3}
    from ldlp.report.labels import write_oracle_page

    page = write_oracle_page(out, saved)  # what scripts/collect_oracle.py writes next to report.json
    assert page == out / "report.md" and page.read_text().startswith("# Oracle labels: ")  # renders, from report.json
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["k_max"] == 4 and manifest["counts"]["positions"] == len(rows)
    assert len(manifest["models"]["target"]["files"]["model.safetensors"]["sha256"]) == 64


def test_resume_after_interruption_gives_the_same_files(pair_dirs, full_run, tmp_path):
    out, _ = full_run
    part = run(pair_dirs, tmp_path, "max_parts_this_run=2")
    assert part["this_run"]["parts_written"] == 2 and not part["this_run"]["complete"]
    # a kill in the middle of the next part: a half-written rows file and a stray temporary file
    (tmp_path / "train" / "000-of-001.00002.rows.arrow").write_bytes(b"half a file")
    (tmp_path / "train" / "000-of-001.00002.seqs.arrow.tmp").write_bytes(b"junk")
    with pytest.raises(ValueError, match="no complete oracle parts for split 'validation'"):
        load_oracle_rows(tmp_path, split="validation")  # incomplete parts are invisible to readers
    done = run(pair_dirs, tmp_path)
    assert done["this_run"]["parts_written"] == 4 and done["this_run"]["complete"]
    a, b = arrow_files(tmp_path), arrow_files(out)
    assert sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []
    again = run(pair_dirs, tmp_path)  # nothing left to do
    assert again["this_run"]["parts_written"] == 0 and again["positions"] == done["positions"]


def test_settings_mismatch_stops_unless_overwrite(pair_dirs, tmp_path):
    run(pair_dirs, tmp_path, "max_parts_this_run=1")
    with pytest.raises(ValueError, match="k_max: 4 -> 3"):
        run(pair_dirs, tmp_path, "k_max=3", "max_parts_this_run=1")
    report = run(pair_dirs, tmp_path, "k_max=3", "overwrite=true", "max_parts_this_run=1")
    assert report["k_max"] == 3 and report["parts"] == 1


def test_starting_over_removes_the_report_and_its_page(tmp_path):
    """``remove_collection`` (overwrite=true, the pipeline's reset) leaves no summary of labels no longer there:
    ``report.json`` and the page the script rendered from it go with the parts and the manifest."""
    from ldlp.labels.collect import remove_collection

    (tmp_path / "train").mkdir()
    for name in ("manifest.json", "report.json", "report.md", "notes.txt", "train/000-of-001.00000.json",
                 "train/000-of-001.00000.rows.arrow", "train/000-of-001.00000.seqs.arrow"):
        (tmp_path / name).write_text("x")
    remove_collection(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["notes.txt", "train"]


def test_shards_split_the_work(pair_dirs, full_run, tmp_path):
    out, _ = full_run
    for shard in (0, 1):
        run(pair_dirs, tmp_path, f"shard_id={shard}", "num_shards=2")
    key = lambda r: (r["seq_id"], r["index"])  # noqa: E731
    split_rows = sorted(load_oracle_rows(tmp_path).to_list(), key=key)
    whole = sorted(load_oracle_rows(out).to_list(), key=key)
    assert [key(r) for r in split_rows] == [key(r) for r in whole]
    assert [r["label"] for r in split_rows] == [r["label"] for r in whole]
    with pytest.raises(ValueError, match="shard_id"):
        run(pair_dirs, tmp_path, "shard_id=2", "num_shards=2")


def test_without_features_the_trainer_can_recompute_them(pair_dirs, full_run, tmp_path):
    out, _ = full_run
    run(pair_dirs, tmp_path, "store_features=false", "store_draft_states=false", "data.validation_path=null")
    rows, seqs = load_oracle_rows(tmp_path), load_oracle_sequences(tmp_path)
    assert "feature" not in rows.column_names and "draft_state" not in rows.column_names
    assert set(rows["split"]) == {"train"}
    from eagle_backbone.loading import load_pair

    target = load_pair(compose(pair_dirs, tmp_path).model).target
    stored = load_oracle_rows(out).filter(lambda r: r["seq_id"] == 3, keep_in_memory=True)
    seq = seqs.filter(lambda r: r["seq_id"] == 3, keep_in_memory=True)[0]
    feats = recompute_features(target, seq["input_ids"], seq["prompt_len"])
    np.testing.assert_allclose(feats.float().numpy(), np.asarray(stored["feature"], dtype=np.float32), atol=2e-3, rtol=2e-3)


def test_malformed_data_in_the_collector(pair_dirs, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(CONVS[0]) + "\n{broken\n" + json.dumps(CONVS[1]) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        run(pair_dirs, tmp_path / "o1", f"data.path={bad}", "data.validation_path=null")
    report = run(pair_dirs, tmp_path / "o2", f"data.path={bad}", "data.validation_path=null", "data.on_error=skip")
    assert report["sequences"] == 4
    manifest = json.loads((tmp_path / "o2" / "manifest.json").read_text())
    assert manifest["data_counts"]["skipped_records"] == 1
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        run(pair_dirs, tmp_path / "o3", f"data.path={empty}")


def test_embedded_pair_end_to_end(tmp_path, embedded_corpus):
    """The shipped pair on two corpus conversations, 16 new tokens (skipped until the pair is trained)."""
    for name in ("target", "drafter"):
        if not (REPO / "data" / "embedded" / name / "config.json").exists():
            pytest.skip(f"data/embedded/{name} is not there yet (trained by the lead, then committed)")
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import eagle_backbone.paths  # noqa: F401
    from ldlp.labels.collect import collect_oracle

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = hydra_compose("collect_oracle", overrides=[
            f"data.path={embedded_corpus / 'train.json'}", "data.limit=2", "data.validation_path=null",
            "generation.max_new_tokens=16", "data.turns=first",
            f"out_dir={tmp_path}", "progress=false"])
    report = collect_oracle(cfg)
    assert report["sequences"] == 2 and report["positions"] > 0
    assert sum(report["label_hist"]) == report["positions"]
    assert len(load_oracle_rows(tmp_path)[0]["feature"]) == 384


def test_vicuna_experiment_composes_without_weights():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import eagle_backbone.paths  # noqa: F401

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = hydra_compose("collect_oracle", overrides=["+experiment=vicuna", "data.path=/somewhere/sharegpt.json"])
    assert cfg.model.name == "vicuna-7b-v1.3" and cfg.model.dtype == "float16"
    assert cfg.data.name == "sharegpt" and cfg.data.limit is None and cfg.data.holdout_percent == 2
    assert cfg.data.chat_template == "vicuna_v1.1" and cfg.max_new_tokens == 512
    assert cfg.out_dir.endswith("data/oracle/vicuna-7b-v1.3")


def test_a_real_collection_is_checked_against_its_manifest(tmp_path, pair_dirs):
    """The collector's own manifest and parts: one part of four is refused, the finished collection passes."""
    from ldlp.labels.store import require_complete

    run(pair_dirs, tmp_path, "max_parts_this_run=1")
    with pytest.raises(ValueError, match=r"of 17 sequences are missing") as e:
        require_complete(tmp_path)
    assert f"python scripts/collect_oracle.py out_dir={tmp_path}" in one_line(e)
    run(pair_dirs, tmp_path)
    assert require_complete(tmp_path)["complete"] is True


def test_a_collection_grows_in_a_second_folder_and_both_read_as_one(pair_dirs, tmp_path):
    from ldlp.bench.comparisons.study_rows import load_split

    first = tmp_path / "first"
    run(pair_dirs, first, "data.limit=3", "data.validation_limit=1", "data.sample_seed=0")
    more = tmp_path / "more"
    report = run(pair_dirs, more, "data.validation_path=null", f"data.exclude_collections=[{first}]")
    ids = lambda d: {c.split("@turn")[0] for c in load_oracle_sequences(d)["conversation_id"]}  # noqa: E731
    assert len(ids(first)) == 4 and len(ids(more)) == 4 and not ids(first) & ids(more)  # 3 + 1 validation; 7 - 3
    assert report["splits"].keys() == {"train"}
    both = load_split([str(first), str(more)], "train", None)
    assert len(both) == len(load_split(str(first), "train", None)) + len(load_split(str(more), "train", None))
    assert len(both.sequences) == 6 + 8  # two user turns a conversation, ids numbered on
    assert len(load_split([str(first), str(more)], "validation", None).sequences) == 1  # only the first has one
    with pytest.raises(MissingInput, match="exclude_collections: .*nowhere holds no collection"):
        run(pair_dirs, tmp_path / "x", f"data.exclude_collections=[{tmp_path / 'nowhere'}]")
