"""A drafter kind is one class in one file: the registry finds the shipped ones, and a toy kind defined here (the
recipe of docs/batched.md, "Adding a drafter kind") loads from a model config through the registry, decodes through
the engine with the target's own greedy output and gives the step-cost profiler its forwards."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import prompts_of, save_tiny_pair
from omegaconf import OmegaConf

from eagle_backbone.candidates import CandidateGenerator
from eagle_backbone.drafter_kinds import get_kind, kind_names, kinds_labelled_by, register, unregister
from eagle_backbone.runtime import to_device

# ---- the toy kind: what a new kind's file holds ----------------------------------------------------------------


@register
class BigramCandidates(CandidateGenerator):
    """Drafts from a table of next-token logits by the last token (an ``nn.Embedding`` of V rows of V logits),
    saved as ``config.json`` (its vocabulary) and ``table.pt``."""

    kind = "toy_bigram"
    calls = {"context": 0, "feed": 0, "draft": 0}

    def __init__(self, drafter, target, attn="eager"):
        if drafter.num_embeddings != target.vocab_size:
            raise ValueError(f"bigram table of {drafter.num_embeddings} tokens, target vocabulary {target.vocab_size}")
        self.drafter, self.target = drafter, target

    @classmethod
    def load(cls, path, dtype, device="cpu", trust_remote_code=False):
        table = torch.load(f"{path}/table.pt", weights_only=True)
        return torch.nn.Embedding.from_pretrained(table.to(device, getattr(torch, dtype)))

    @classmethod
    def check_fits(cls, drafter, target):
        mine, theirs = (json.loads(open(f"{p}/config.json").read())["vocab_size"] for p in (drafter, target))
        if mine != theirs:
            raise ValueError(f"{drafter}: a bigram table of {mine} tokens cannot draft for a vocabulary of {theirs}")

    def prefill(self, slots, tokens, batch, first, hidden):
        pass  # the table reads the last token only, from the engine's tokens by position

    def start(self, slots, tlens):
        v = self.view
        last = v.seq[to_device(slots, v.device), to_device(tlens, v.device)]
        return self.drafter(last), None

    def extend(self, slots, tokens, tlens, depth, states):
        return self.drafter(tokens), None

    def profile_context(self, tokens, batch, g):
        BigramCandidates.calls["context"] += 1

    def profile_feed(self, tokens, batch, g):
        def run():
            BigramCandidates.calls["feed"] += 1
            self.drafter(tokens[batch.last()])
        return run

    def profile_draft(self, tokens, batch, g):
        def run():
            BigramCandidates.calls["draft"] += 1
            torch.softmax(self.drafter(tokens).float(), -1)
        return run


# ---- the tests -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _toy_kind_registered():
    yield
    unregister(BigramCandidates.kind)


def save_bigram(folder, target_model) -> None:
    """The target's own next-token logits after each single token: a table that drafts often right."""
    folder.mkdir(parents=True)
    V = target_model.config.vocab_size
    with torch.no_grad():
        table = target_model(torch.arange(V)[:, None]).logits[:, 0].float()
    torch.save(table, folder / "table.pt")
    (folder / "config.json").write_text(json.dumps({"vocab_size": V}))


def test_the_registry_finds_the_shipped_kinds_and_names_them_in_its_errors():
    assert {"eagle", "eagle3", "draft_lm", "toy_bigram"} <= set(kind_names())
    assert get_kind("eagle3").labelled_by == ("oracle",) and get_kind("draft_lm").causal_lm
    assert kinds_labelled_by("oracle") == ["eagle", "eagle3"] and kinds_labelled_by("acceptance") == ["eagle"]
    with pytest.raises(ValueError, match=r"registered drafter kind \('draft_lm', 'eagle', 'eagle3', 'toy_bigram'\), "
                                         r"got 'nope'"):
        get_kind("nope")
    clash = type("Other", (CandidateGenerator,), {"kind": "toy_bigram"})
    with pytest.raises(ValueError, match="registered already"):
        register(clash)


def test_a_toy_kind_loads_decodes_greedy_identically_and_profiles(tmp_path):
    from eagle_backbone.batched_engine import BatchedSpeculativeEngine
    from eagle_backbone.cost import cost_key, profile_costs
    from eagle_backbone.loading import load_pair
    from eagle_backbone.paths import REPO_ROOT
    from eagle_backbone.policy import StaticPolicy
    from ldlp.bench.harness.workload import run_workload

    target_model = save_tiny_pair(tmp_path, vocab=64)
    save_bigram(tmp_path / "bigram", target_model)
    # the kind's YAML (conf/model/<name>.yaml) names it; everything else is the shipped pair's
    model = OmegaConf.create(f"""
        name: tiny_bigram
        target: {tmp_path / 'target'}
        tokenizer: {REPO_ROOT / 'data' / 'embedded' / 'tokenizer'}
        drafter: {tmp_path / 'bigram'}
        drafter_kind: toy_bigram
        dtype: float32
        device: cpu
    """)
    pair = load_pair(model)
    assert type(pair.candidates) is BigramCandidates and pair.candidates.kind == "toy_bigram"
    target = pair.target
    prompts = prompts_of((3, 7, 5, 9, 4), seed=4)
    reference = [target.reference_greedy(p, 12) for p in prompts]
    for gamma in (1, 3):
        engine = BatchedSpeculativeEngine(target, pair.candidates, slots=3, policy=StaticPolicy(gamma), capacity=64)
        outputs = run_workload(engine, prompts, 3, 12).outputs
        assert [o.tokens for o in outputs] == reference
        assert sum(o.stats.accepted_tokens for o in outputs) > 0  # the table drafts right sometimes
    # the same kind named in another model config of a target of another vocabulary: refused before loading
    save_tiny_pair(tmp_path / "other", vocab=96)
    with pytest.raises(ValueError, match="cannot draft for a vocabulary of 96"):
        load_pair(OmegaConf.merge(model, {"target": str(tmp_path / "other" / "target")}))
    # the step-cost profiler runs the kind's own forwards
    key = cost_key("tiny_bigram", target.dtype, target.device, 1)
    table = profile_costs(lambda R, policy=None: BatchedSpeculativeEngine(target, pair.candidates, slots=R, capacity=64,
                                                                          policy=policy),
                          key, slots=(1, 2), tokens=(1, 3), context=8, reps=1, log=lambda *_: None)
    assert BigramCandidates.calls["context"] == 2 and BigramCandidates.calls["feed"] >= 2 * 2 * 2
    assert BigramCandidates.calls["draft"] >= 2 * 2 and len(table.draft) == 2 and min(table.draft) > 0
    # labels: the oracle and acceptance collectors label only the kinds that say so
    assert "toy_bigram" not in kinds_labelled_by("oracle") + kinds_labelled_by("acceptance")


def test_a_kind_without_profiler_forwards_is_refused_by_the_profiler_in_one_line(t32):
    from eagle_backbone.batched_engine import BatchedSpeculativeEngine
    from eagle_backbone.cost import profile_costs

    class Silent(BigramCandidates):
        kind = "toy_silent"
        profile_feed = CandidateGenerator.profile_feed

    table = torch.zeros(t32.vocab_size, t32.vocab_size)
    gen = Silent(torch.nn.Embedding.from_pretrained(table), t32)
    assert not Silent.profiles() and BigramCandidates.profiles() and get_kind("eagle").profiles()
    with pytest.raises(ValueError, match="kind 'toy_silent' gives the profiler no forwards"):
        profile_costs(lambda R, policy=None: BatchedSpeculativeEngine(t32, gen, slots=R, capacity=32, policy=policy),
                      {}, slots=(1,), tokens=(1,), context=4, reps=1, log=lambda *_: None)


def test_the_label_collectors_label_the_kinds_that_say_so_and_the_oracle_drafts_as_the_kind_says(tmp_path):
    from conftest import compose_config

    from ldlp.labels.acceptance_labels import collect_acceptance
    from ldlp.labels.collect import collect_oracle
    from ldlp.labels.oracle import oracle_labels

    for name, collect, labelled in (("collect_oracle", collect_oracle, "eagle or eagle3"),
                                    ("collect_acceptance", collect_acceptance, "eagle")):
        cfg = compose_config(name, ["model.drafter_kind=toy_bigram", f"out_dir={tmp_path / name}", "threads=null"])
        with pytest.raises(ValueError, match=rf"model.drafter_kind='toy_bigram': .*; use an {labelled} model config"):
            collect(cfg)  # refused before any model loads
    # a kind's oracle_rows: a recipe by name, or its own callable
    seen = []

    def rows(target, drafter, ids, prompt_len, k_max, full_target_prob, max_rows_per_pass):
        seen.append((ids, prompt_len, k_max, full_target_prob))
        return {"label": torch.zeros(0)}

    assert oracle_labels(None, None, [5, 6, 7], 1, 2, rows=rows)["label"].numel() == 0
    assert seen == [([5, 6, 7], 1, 2, True)]
    with pytest.raises(ValueError, match=r"no rows recipe 'bigram' \(recipes: eagle, eagle3\)"):
        oracle_labels(None, None, [5, 6, 7], 1, 2, rows="bigram")
