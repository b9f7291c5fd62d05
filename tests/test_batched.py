"""The batched engine (eagle_backbone/batched_engine.py, eagle_backbone/llama.py, eagle_backbone/ragged.py; the workload in ldlp/bench/harness/workload.py): greedy identity with each sequence's own batch-1 output,
sampling exactness in a batch (γ per slot from a fixed cycle or policy=load_aware; chains and trees of the draft LM
and EAGLE-3 against the enumerated distribution; the chi-square's power against a broken residual or sibling
rejection), a sequence's samples independent of the batch (chains and trees), per-slot cache rollback, an EOS inside
a chain's or a tree's draft, continuous batching and bad input.

Tiny float32 Llamas (tests/conftest.py); the embedded pair, where present, gives an EAGLE drafter whose
drafts the target actually accepts. No test reads a clock."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import (SAMPLES, SPECS, TINY_PROMPT, TINY_TREES, AnyTree, ar, chi2_pvalue, counters,
                      exact_sequence_distribution, load_aware_policy, make_eagle3, make_target, noisy_copy,
                      pair_distribution, pooled_chi2_pvalue, prompts_of, sampled_prefix_counts, table)

from eagle_backbone import sampling as bsampling
from eagle_backbone import tree as btree
from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.cost import cost_key
from eagle_backbone.llama import BatchedLlama
from eagle_backbone.ragged import RaggedBatch
from ldlp.bench.harness.workload import run_workload
from eagle_backbone.kinds.draft_lm import DraftModelCandidateGenerator
from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.decoder import SpeculativeDecoder
from eagle_backbone.policy import DraftPolicy, StaticPolicy, go_while
from eagle_backbone.sampling import SamplingConfig
from eagle_backbone.tree_draft import TreeSpec

torch.set_num_threads(1)
EMBEDDED = Path(__file__).resolve().parent.parent / "data" / "embedded"


class PromptGamma(DraftPolicy):
    """γ = a slot-specific constant (from its prompt length): different γ per slot, 0 included."""

    name = "prompt_gamma"

    def __init__(self):
        self.g = {}

    def begin(self, slot, prompt_ids, max_new_tokens=None):
        self.g[slot] = len(prompt_ids) % 4

    def plan(self, rows):
        return [self.g[b] for b in rows.slots]


class Varying(DraftPolicy):
    """γ changes every step (0..4) and the chain may stop early: exercises stop() and ragged drafts."""

    name, reads_drafts = "varying", True

    def plan(self, rows):
        return [(len(a) * 3 + p) % 5 for a, p in zip(rows.accepted, rows.positions)]

    def stop(self, d):
        return go_while((d.probs.max(-1).values > 0.05) | (d.depth < 2))


# ---- the compact forward ---------------------------------------------------------------------------


def test_compact_forward_gives_transformers_logits(t32):
    ids = torch.randint(4, 64, (3, 11), generator=torch.Generator().manual_seed(1))
    ref = t32.model(ids).logits
    m = BatchedLlama(t32.model, 32)
    cache = m.new_cache(3)
    h1 = m(ids[:, :7].reshape(-1), RaggedBatch([0, 1, 2], [0] * 3, [7] * 3, "cpu"), cache)
    h2, extra = m(ids[:, 7:].reshape(-1), RaggedBatch([0, 1, 2], [7] * 3, [4] * 3, "cpu"), cache, hidden_layers=(0, 1))
    logits = m.logits(torch.cat([h1.view(3, 7, -1), h2.view(3, 4, -1)], 1))
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    assert len(extra) == 2 and extra[0].shape == (12, 32)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("slack", [0, 10_000])  # every row on its own / consecutive rows as dense blocks
def test_ragged_rows_attend_over_their_own_slot_only(t32, attn, slack):
    """Rows of different lengths and token counts in one forward, in slots out of order, each read in place:
    every row's logits equal transformers' on that row's sequence alone."""
    m = BatchedLlama(t32.model, 64, attn)
    cache = m.new_cache(5)
    seqs = prompts_of((9, 30, 4, 17, 12), seed=5)
    # prefill all but each sequence's tail, then score the tails (1..3 tokens) in one ragged forward
    tails = [1, 3, 1, 1, 2]
    slots = [4, 0, 1, 2, 3]
    heads = [s[: len(s) - t] for s, t in zip(seqs, tails)]
    m(torch.tensor([x for h in heads for x in h]), RaggedBatch(slots, [0] * 5, [len(h) for h in heads], "cpu"), cache)
    batch = RaggedBatch(slots, [len(h) for h in heads], tails, "cpu", dense_slack=slack)
    if slack:
        assert any(j - i > 1 for i, j in batch.blocks)  # slots 0, 1, 2 hold one token each: a dense block
    got = m.logits(m(torch.tensor([x for s, t in zip(seqs, tails) for x in s[len(s) - t:]]), batch, cache))
    o = 0
    for seq, t in zip(seqs, tails):
        ref = t32.model(torch.tensor([seq])).logits[0, -t:]
        torch.testing.assert_close(got[o: o + t], ref, rtol=1e-5, atol=1e-5)
        o += t


def test_per_slot_rollback_overwrites_rejected_positions(t32):
    """Slot 0 scores 3 wrong tokens, slot 1 one; rolling back is only reusing the positions."""
    m = BatchedLlama(t32.model, 40)
    cache = m.new_cache(2)
    a, b = prompts_of((6, 9), seed=2)
    tail_a, tail_b = prompts_of((4, 4), seed=3)
    m(torch.tensor(a + b), RaggedBatch([0, 1], [0, 0], [6, 9], "cpu"), cache)  # prefill, nothing padded
    m(torch.tensor([60, 61, 62, 63]), RaggedBatch([0, 1], [6, 9], [3, 1], "cpu"), cache)  # drafts, all rejected
    h = m(torch.tensor(tail_a + tail_b), RaggedBatch([0, 1], [6, 9], [4, 4], "cpu"), cache)
    got = m.logits(h).view(2, 4, -1)
    for row, seq in enumerate((a + tail_a, b + tail_b)):
        ref = t32.model(torch.tensor([seq])).logits[0, -4:]
        torch.testing.assert_close(got[row], ref, rtol=1e-5, atol=1e-5)


# ---- greedy identity ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["eagle", "draft_lm"])
def test_greedy_identity_mixed_prompts_and_gammas(t32, eagle32, draft_lm, kind):
    prompts = prompts_of((5, 12, 3, 8, 6, 1))  # γ = len % 4: 1, 0, 3, 0, 2, 1
    drafter = eagle32 if kind == "eagle" else draft_lm
    engine = BatchedSpeculativeEngine(t32, drafter, kind, slots=6, policy=PromptGamma)
    out = engine.generate(prompts, 24)
    assert [o.tokens for o in out] == ar(t32, prompts, 24)
    assert [len(set(o.stats.draft_lengths)) for o in out][1] == 1 and out[1].stats.drafted_tokens == 0
    if kind == "draft_lm":
        assert sum(o.stats.accepted_tokens for o in out) > 10  # drafts were accepted, not only rejected


def test_greedy_identity_with_sdpa_attention(t32, draft_lm):
    prompts = prompts_of((5, 12, 3))
    engine = BatchedSpeculativeEngine(t32, draft_lm, "draft_lm", slots=3, policy=PromptGamma, attn="sdpa")
    assert [o.tokens for o in engine.generate(prompts, 16)] == ar(t32, prompts, 16)


def test_greedy_identity_varying_gamma_and_early_stop(t32, draft_lm):
    prompts = prompts_of((4, 7, 10, 2))
    engine = BatchedSpeculativeEngine(t32, draft_lm, "draft_lm", slots=4, policy=Varying)
    out = engine.generate(prompts, 30)
    assert [o.tokens for o in out] == ar(t32, prompts, 30)
    # same accepted lengths as today's batch-1 engine with the same policy
    for p, o in zip(prompts, out):
        ref = SpeculativeDecoder(t32, DraftModelCandidateGenerator(draft_lm, t32), Varying()).generate(p, 30)
        assert o.stats.accept_lengths == ref.stats.accept_lengths


# a chain of γ = 4, and a tree 2 wide and 4 deep
EOS_POLICIES = {"chain": lambda: StaticPolicy(4), "tree": lambda: AnyTree(TreeSpec(2, 4))}


@pytest.mark.parametrize("shape", EOS_POLICIES)
def test_eos_inside_one_slots_draft(t32, shape):
    """A perfect drafter (the target itself) drafts past an EOS in slot 0, along a chain or a tree's accepted path:
    slot 0 stops there, the others continue."""
    prompts = prompts_of((5, 9, 7))
    target = copy.copy(t32)
    eos = ar(t32, prompts[:1], 12)[0][6]  # slot 0's 7th token becomes the EOS
    target.eos_token_ids = {eos}
    ref = ar(target, prompts, 20)
    assert ref[0][-1] == eos and len(ref[0]) <= 7
    engine = BatchedSpeculativeEngine(target, t32.model, "draft_lm", slots=3, policy=EOS_POLICIES[shape]())
    out = engine.generate(prompts, 20)
    assert [o.tokens for o in out] == ref
    assert any(len(r) == 20 for r in ref[1:])  # another slot ran on past slot 0's end
    s = out[0].stats
    assert s.accepted_tokens == sum(s.accept_lengths) and s.new_tokens == len(ref[0])


def test_budget_reached_mid_draft(t32):
    prompts = prompts_of((5, 9))
    engine = BatchedSpeculativeEngine(t32, t32.model, "draft_lm", slots=2, policy=StaticPolicy(4))
    out = engine.generate(prompts, 7)  # 1 from the prefill, then 4 drafts + 1; the next γ is capped at 0
    assert [o.tokens for o in out] == ar(t32, prompts, 7)
    assert all(len(o.tokens) == 7 and max(o.stats.draft_lengths) == 4 and o.stats.draft_lengths[-1] == 0
               for o in out)


def test_refilled_slots_continuous_batching(t32, eagle32, draft_lm):
    prompts = prompts_of((5, 9, 3, 11, 6, 2, 8))
    ref = ar(t32, prompts, 15)
    for drafter, kind in ((eagle32, "eagle"), (draft_lm, "draft_lm"), (None, None)):
        engine = BatchedSpeculativeEngine(t32, drafter, kind, slots=3, policy=PromptGamma if drafter else None)
        res = run_workload(engine, prompts, 3, 15)
        assert [o.tokens for o in res.outputs] == ref
        assert len(res.token_gaps_s) == sum(len(r) - 1 for r in ref) and len(res.request_s) == len(prompts)


@pytest.mark.skipif(not (EMBEDDED / "drafter" / "config.json").exists(), reason="no embedded pair")
def test_embedded_eagle_accepts_and_matches_batch1():
    """The shipped EAGLE drafter (float32): real acceptance, same accepted lengths as the batch-1 engine."""
    from eagle_backbone.drafter import EagleDrafter
    from eagle_backbone.target import TargetModel

    target = TargetModel.from_pretrained(EMBEDDED / "target", attn_implementation="eager")
    drafter = EagleDrafter.from_pretrained(EMBEDDED / "drafter")
    prompts = prompts_of((9, 17, 5), seed=4, vocab=target.vocab_size)
    engine = BatchedSpeculativeEngine(target, drafter, "eagle", slots=3, policy=StaticPolicy(3))
    out = engine.generate(prompts, 24)
    assert [o.tokens for o in out] == ar(target, prompts, 24)
    for p, o in zip(prompts, out):
        ref = SpeculativeDecoder(target, EagleCandidateGenerator(drafter, target), StaticPolicy(3)).generate(p, 24)
        assert o.stats.accept_lengths == ref.stats.accept_lengths
    assert sum(o.stats.accepted_tokens for o in out) > 5


# ---- sampling -----------------------------------------------------------------------------------


def test_batched_one_step_distribution_is_exact():
    """Sum over drafts x ~ q of the accept/resample outcome, with the batched functions, equals p (per row)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(3 * torch.randn(5, 12, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(3 * torch.randn(5, 12, generator=g, dtype=torch.float64), -1)
    q[0] = p[0]  # p == q: rejection never happens
    q[1, :6] = 0
    q[1] /= q[1].sum()  # q misses half the support
    out = torch.zeros_like(p)
    for x in range(12):
        a = bsampling.accept_probability(p[:, x], q[:, x])
        out[:, x] += q[:, x] * a
        out += (q[:, x] * (1 - a))[:, None] * bsampling.residual(p, q)
    torch.testing.assert_close(out, p, rtol=0, atol=1e-12)


def test_counter_uniforms_are_uniform_and_per_sequence():
    seeds = torch.arange(4000)
    u = bsampling.uniforms(seeds, torch.zeros(4000, dtype=torch.long), torch.arange(3))
    assert 0 <= float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u.flatten().float(), bins=10, min=0, max=1)
    chi2 = float(((counts - 1200) ** 2 / 1200).sum())
    assert chi2 < 27.9  # 9 dof, p = 0.001
    assert torch.equal(bsampling.uniforms(seeds[7:9], torch.zeros(2, dtype=torch.long), torch.arange(3)), u[7:9])


def _sample_pairs(target, drafter, prompt, slots, runs, temperature, policy):
    """The first two tokens of sequences decoded 4 tokens deep: the second comes from a verification
    step (γ up to 2 there), so it is a kept draft, a replacement or a bonus token. ``policy()`` gives each run's
    engine its policy; returns the pairs and every γ drafted."""
    cfg = SamplingConfig(temperature=temperature)
    out, gammas = [], set()
    for r in range(runs):
        engine = BatchedSpeculativeEngine(target, drafter, "draft_lm", slots=slots, policy=policy(), sampling=cfg)
        seeds = [1000 * r + b for b in range(slots)]
        outs = engine.generate([prompt] * slots, 4, seeds=seeds)
        out += [tuple(o.tokens[:2]) for o in outs]
        gammas |= {d for o in outs for d in o.stats.draft_lengths}
    return out, gammas


class Mixed(PromptGamma):
    """γ from the sequence's seed-free slot order: 0, 1, 2, 3 cycling over admissions."""

    name = "mixed"
    counter = 0

    def begin(self, slot, prompt_ids, max_new_tokens=None):
        Mixed.counter += 1
        self.g[slot] = Mixed.counter % 4


@pytest.fixture(scope="module")
def rough_drafter(t32):
    return noisy_copy(t32, 0.6, seed=11)


@pytest.fixture(scope="module")
def no_eos(t32):
    target = copy.copy(t32)
    target.eos_token_ids = set()  # every sequence has its two tokens
    return target


# temperature 0.3: the tiny target's distribution is sharp enough that most mass sits in cells with
# expected counts >= 5, which is what gives the test its power
TEMP, RUNS = 0.3, 60


def load_aware_under_a_table(folder, target):
    """policy=load_aware's factory under a synthetic cost table for ``target`` (it mixes γ = 0, 1, 2 per slot)."""
    key = cost_key("tiny", target.dtype, target.device, torch.get_num_threads())
    return lambda: load_aware_policy(folder, table(0.02, 0.3, key=key), max_gamma=2)


# what chooses γ per slot: Mixed's cycle over admissions, or policy=load_aware by its cost table
CHOOSERS = {"mixed": lambda folder, target: Mixed, "load_aware": load_aware_under_a_table}


@pytest.mark.parametrize("chooser", CHOOSERS)
def test_sampled_sequences_have_the_target_distribution(no_eos, rough_drafter, tmp_path, chooser):
    """Speculative sampling in a batch stays exact with γ chosen per slot, mixed and 0 included: by a fixed cycle,
    and by the load-aware policy (ldlp/policies/load_aware.py)."""
    prompt = prompts_of((6,), seed=5)[0]
    exact = pair_distribution(no_eos, prompt, TEMP)
    samples, gammas = _sample_pairs(no_eos, rough_drafter, prompt, 32, RUNS, TEMP, CHOOSERS[chooser](tmp_path, no_eos))
    assert {0, 1, 2} <= gammas
    assert pooled_chi2_pvalue(samples, exact, len(samples)) > 1e-3


def test_chi_square_has_power_against_a_broken_residual(no_eos, rough_drafter, monkeypatch):
    """Resampling from p instead of normalize(max(p - q, 0)) must be caught by the same test."""
    monkeypatch.setattr(bsampling, "residual", lambda p, q: p)
    prompt = prompts_of((6,), seed=5)[0]
    exact = pair_distribution(no_eos, prompt, TEMP)
    samples, _ = _sample_pairs(no_eos, rough_drafter, prompt, 32, RUNS, TEMP, Mixed)
    assert pooled_chi2_pvalue(samples, exact, len(samples)) < 1e-5


# ---- sampled prefixes against the enumerated distribution (4-token targets) ----------------------------------


def draft_lm_pair(request, draft_vocab=None):
    """tiny_vocab_pair: a 4-token target and an independent draft LM, as the engine takes them."""
    target, draft = request.getfixturevalue("tiny_vocab_pair")
    return target, draft.model


def eagle3_pair(request, draft_vocab=None):
    """A 3-layer float32 target of 4 tokens, no EOS, and an EAGLE-3 head for it drafting from ``draft_vocab`` of them
    (3: the drafter never proposes the fourth, and q is zero there)."""
    target = make_target(seed=11, vocab=4, d=16, layers=3, eos=None, dtype=torch.float32)
    target.eos_token_ids = set()
    return target, make_eagle3(target, draft_vocab=draft_vocab)


def _enumerated(kind, pair, shape, policy, temperature, draft_vocab=None, capacity=16):
    vocab = "" if draft_vocab is None else f"-vocab{draft_vocab}"
    return pytest.param(kind, pair, policy, temperature, draft_vocab, capacity,
                        id=f"{kind}-{shape}{vocab}-T{temperature}")


# the draft LM's trees at T = 1 and 0.7; EAGLE-3's chains (γ = 2 at T = 1, the full draft vocabulary and 3 of 4) and
# a tree (dyn2x3 at depth 3, T = 0.7: it needs the larger capacity)
ENUMERATED = [*(_enumerated("draft_lm", draft_lm_pair, f"tree_{name}", lambda s=spec, g=g: AnyTree(s, g), t)
                for t in (1.0, 0.7) for name, (spec, g) in TINY_TREES.items()),
              _enumerated("eagle3", eagle3_pair, "chain", lambda: StaticPolicy(2), 1.0),
              _enumerated("eagle3", eagle3_pair, "chain", lambda: StaticPolicy(2), 1.0, draft_vocab=3),
              _enumerated("eagle3", eagle3_pair, "tree_dyn2x3", lambda: AnyTree(SPECS["dyn2x3"], 3), 0.7, draft_vocab=3,
                          capacity=24)]


@pytest.mark.parametrize("kind, pair, policy, temperature, draft_vocab, capacity", ENUMERATED)
def test_sampled_prefixes_have_the_enumerated_distribution(request, kind, pair, policy, temperature, draft_vocab,
                                                           capacity):
    """The first 3 tokens of 1200 seeded sequences, chains and trees of each kind, against the target's enumerated
    distribution; the drafts were accepted (more than one per two sequences), not only rejected."""
    target, drafter = pair(request, draft_vocab)
    cfg = SamplingConfig(temperature=temperature)
    probs = exact_sequence_distribution(target, TINY_PROMPT, 3, cfg)
    counts, accepted = sampled_prefix_counts(target, drafter, kind, policy, cfg, capacity=capacity)
    assert accepted > SAMPLES // 2
    assert chi2_pvalue(counts, probs, SAMPLES) > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chi_square_has_power_against_a_broken_sibling_rejection(tiny_vocab_pair, monkeypatch, temperature):
    """Keeping the residual as it was after a sampled sibling's rejection (no r <- norm(max(r - q, 0))) must
    fail the same test: at T > 0 the engine's siblings are draws from q."""
    monkeypatch.setattr(btree, "_reject_sampled", lambda r, q: r)
    cfg = SamplingConfig(temperature=temperature)
    probs = exact_sequence_distribution(tiny_vocab_pair[0], TINY_PROMPT, 3, cfg)
    spec, g = TINY_TREES["dyn2x3"]
    counts, _ = sampled_prefix_counts(tiny_vocab_pair[0], tiny_vocab_pair[1].model, "draft_lm",
                                      lambda: AnyTree(spec, g), cfg)
    assert chi2_pvalue(counts, probs, SAMPLES) < 1e-6


# ---- a sequence's samples do not depend on the batch ------------------------------------------------------------


# a chain of γ = 2, and the small static tree
SHAPES = {"chain": lambda: StaticPolicy(2), "tree": lambda: AnyTree(SPECS["static_small"])}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["eagle", "draft_lm"])
def test_a_sequences_samples_do_not_depend_on_the_batch(t32, drafters, kind, shape):
    """A seeded sequence sampled alone and in another slot of a batch of three: the same tokens and counters."""
    cfg = SamplingConfig(temperature=1.0)
    prompts = prompts_of((5, 12, 3))
    alone = BatchedSpeculativeEngine(t32, drafters[kind], kind, slots=1, policy=SHAPES[shape](), sampling=cfg)
    ref = alone.generate(prompts[1:2], 16, seeds=[42])[0]
    both = BatchedSpeculativeEngine(t32, drafters[kind], kind, slots=3, policy=SHAPES[shape](), sampling=cfg)
    out = both.generate([prompts[0], prompts[2], prompts[1]], 16, seeds=[1, 2, 42])[2]
    assert out.tokens == ref.tokens
    assert counters([out]) == counters([ref])


# ---- bad input ----------------------------------------------------------------------------------


class NegativeForShort(PromptGamma):
    name = "negative"

    def begin(self, slot, prompt_ids, max_new_tokens=None):
        self.g[slot] = -1 if len(prompt_ids) < 4 else 2


def test_bad_input_errors(t32, draft_lm):
    with pytest.raises(ValueError, match="batch size"):
        BatchedSpeculativeEngine(t32, slots=0)
    engine = BatchedSpeculativeEngine(t32, draft_lm, "draft_lm", slots=2, capacity=16)
    with pytest.raises(ValueError, match="batch size 0"):
        engine.generate([], 4)
    with pytest.raises(ValueError, match="cache holds 16 positions"):
        engine.generate([list(range(4, 24))], 4)
    with pytest.raises(ValueError, match="more streams than"):
        run_workload(engine, prompts_of((3, 4, 5)), 3, 4)
    engine = BatchedSpeculativeEngine(t32, draft_lm, "draft_lm", slots=2, policy=NegativeForShort)
    with pytest.raises(ValueError, match=r"gamma=-1 for slot 1"):
        engine.generate(prompts_of((6, 2)), 4)


# ---- vectorised LDLP, prefill modes, profiled mode --------------------------------------------------


@pytest.fixture(scope="module")
def ldlp_path(t32, tmp_path_factory):
    """A randomly initialised LDLP for the tiny target, saved where LDLPPolicy reads it."""
    from ldlp.models.predictor import LDLP, LDLPConfig

    torch.manual_seed(0)
    model = LDLP(LDLPConfig(input_dim=2 * t32.hidden_size, hidden_dim=16, k_max=4))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(20)  # spread the predictions over 0..4
    return model.eval().save_pretrained(tmp_path_factory.mktemp("ldlp") / "tiny")


def test_vectorised_ldlp_matches_per_slot_policy(t32, draft_lm, ldlp_path):
    from ldlp.policies.threshold import LDLPPolicy

    policy = LDLPPolicy(str(ldlp_path), max_gamma=4)
    assert policy.plans_ahead  # one predictor forward for all rows, read with the accept counts
    prompts = prompts_of((5, 9, 3, 7))
    engine = BatchedSpeculativeEngine(t32, draft_lm, "draft_lm", slots=4, policy=policy)
    out = engine.generate(prompts, 20)
    assert [o.tokens for o in out] == ar(t32, prompts, 20)
    lengths = {g for o in out for g in o.stats.draft_lengths}
    assert len(lengths) > 1  # the predictor varies γ
    for p, o in zip(prompts, out):
        ref = SpeculativeDecoder(t32, DraftModelCandidateGenerator(draft_lm, t32), policy).generate(p, 20)
        assert o.stats.draft_lengths == ref.stats.draft_lengths


@pytest.mark.parametrize("prefill", ["chunked", "joined", "separate"])
def test_prefill_modes_and_profile(t32, eagle32, prefill):
    prompts = prompts_of((5, 9, 3, 11, 6))
    engine = BatchedSpeculativeEngine(t32, eagle32, "eagle", slots=2, policy=PromptGamma, prefill=prefill,
                                      profile=True)
    res = run_workload(engine, prompts, 2, 12)
    assert [o.tokens for o in res.outputs] == ar(t32, prompts, 12)
    assert {"prefill", "draft", "verify", "read"} <= set(engine.prof.s)


def test_sweep_groups_by_category(t32, eagle32):
    """Per-category counters of a batched sweep sum back to the run's totals, and the page's table has one row per
    (contender, C) with a column per category."""
    from ldlp.bench.comparisons.load_aggregate import category_table
    from ldlp.bench.comparisons.load_sweep import Contender, sweep

    prompts = prompts_of((5, 9, 3, 11, 6, 2))
    categories = ["writing", "coding", "writing", None, "coding", "writing"]  # None: left out of the grouping
    contenders = [Contender("ar", "ar", 0, None), Contender("static γ=2", "static", 2, lambda: StaticPolicy(2))]
    cand = EagleCandidateGenerator(eagle32, t32)
    result = sweep(t32, cand, prompts, contenders, [1, 3], 8, rounds=1, categories=categories, log=lambda _: None)
    for row in result["rows"]:
        key = (row["contender"], row["concurrency"])
        run = next(x for x in result["runs"] if (x["contender"], x["concurrency"]) == key)
        by = row["by_category"]
        assert {c: v["n_prompts"] for c, v in by.items()} == {"writing": 3, "coding": 2}
        assert row["lossless"] is True
        # the uncategorised prompt is the only one missing from the categories' sums
        assert sum(v["new_tokens"] for v in by.values()) == run["new_tokens"] - len(ar(t32, [prompts[3]], 8)[0])
        assert all(v["tau"] >= 1.0 for v in by.values())
    assert {r["by_category"]["writing"]["tau"] for r in result["rows"] if r["policy"] == "ar"} == {1.0}
    table = category_table(result["rows"])
    assert table["categories"] == {"writing": 3, "coding": 2}
    assert [(r["contender"], r["concurrency"]) for r in table["rows"]] == \
        [(r["contender"], r["concurrency"]) for r in result["rows"]]
    with pytest.raises(ValueError, match="categories for"):
        sweep(t32, cand, prompts, contenders, [1], 8, rounds=1, categories=["x"])


def test_retired_loop_loads_from_history_and_agrees(t32, eagle32):
    """scripts/bench_retired_loop.py reads the batch-1 loop from git at c1cdba4: it still loads, and its
    greedy output equals the engine's and the target's own (float32: bit for bit). The retired loop exists only in
    the history, so a checkout without that commit (a shallow clone) fails here, saying how to fetch it."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    known = subprocess.run(["git", "cat-file", "-e", "c1cdba4^{commit}"], cwd=root, capture_output=True)
    assert known.returncode == 0, ("commit c1cdba4 (the retired batch-1 loop this test loads) is not in this "
                                   "checkout: a shallow clone? run `git fetch --unshallow` and rerun")
    sys.path.insert(0, str(root / "scripts"))
    try:
        from bench_retired_loop import load_retired
    finally:
        sys.path.remove(str(root / "scripts"))
    old_engine, old_cands = load_retired("c1cdba4")
    for p in prompts_of((5, 11), seed=4):
        ref = t32.reference_greedy(p, 16)
        old = old_engine.SpeculativeDecoder(t32, old_cands.EagleCandidateGenerator(eagle32, t32), old_engine.StaticPolicy(3))
        new = SpeculativeDecoder(t32, EagleCandidateGenerator(eagle32, t32), StaticPolicy(3))
        assert old.generate(p, 16).tokens == new.generate(p, 16).tokens == ref


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_steps_build_no_device_tensor_from_host_lists(t32, eagle32, draft_lm, monkeypatch, temperature):
    """On a GPU ``torch.tensor(list, device=...)`` synchronises the stream (the host waits for every queued
    kernel): the hot loop moves host lists with ``runtime.to_device`` (non-blocking) instead. Checked here by
    watching every torch.tensor/as_tensor call with a device while engines decode (refills included)."""
    calls = []
    for name in ("tensor", "as_tensor"):
        real = getattr(torch, name)

        def watch(*args, _real=real, _name=name, **kw):
            if kw.get("device") is not None:
                calls.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(torch, name, watch)
    sampling = SamplingConfig(temperature=temperature)
    for drafter, kind in ((eagle32, "eagle"), (draft_lm, "draft_lm")):
        engine = BatchedSpeculativeEngine(t32, drafter, kind, slots=2, policy=PromptGamma, sampling=sampling)
        out = run_workload(engine, prompts_of((5, 9, 3)), 2, 8)
        assert [len(o.tokens) for o in out.outputs] == [8, 8, 8]
    assert calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ragged_attention_and_greedy_identity_on_a_gpu(t32, draft_lm):
    """On a GPU every block of consecutive rows runs dense (one kernel, padded to the block's longest
    context with a mask): rows of different lengths still get transformers' logits, and the engine's greedy
    output is the target's own (on the same device), with joined prefills and refilled slots."""
    target = copy.deepcopy(t32).to("cuda")
    m = BatchedLlama(target.model, 64)
    cache = m.new_cache(4)
    seqs = prompts_of((9, 30, 4, 17), seed=5)
    m(torch.tensor([x for s in seqs for x in s[:-1]], device="cuda"),
      RaggedBatch(range(4), [0] * 4, [len(s) - 1 for s in seqs], "cuda"), cache)
    batch = RaggedBatch(range(4), [len(s) - 1 for s in seqs], [1] * 4, "cuda")
    assert batch.blocks == [(0, 4)]
    got = m.logits(m(torch.tensor([s[-1] for s in seqs], device="cuda"), batch, cache)).cpu()
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(got[row], t32.model(torch.tensor([seq])).logits[0, -1], rtol=1e-4, atol=1e-4)
    prompts = prompts_of((5, 12, 3, 8, 6, 1, 9))
    engine = BatchedSpeculativeEngine(target, copy.deepcopy(draft_lm).to("cuda"), "draft_lm", slots=3,
                                      policy=PromptGamma)
    outs = run_workload(engine, prompts, 3, 16).outputs
    assert [o.tokens for o in outs] == ar(target, prompts, 16)


def test_attention_benchmark_runs_every_route_and_renders_its_page(t32):
    """scripts/bench_attention.py's library on a tiny model: every route (flex where this build runs it), the
    linear kernels and the scaling rows, and the page written from them; no figure is checked (timings)."""
    from ldlp.bench.measurements.attention import attention_routes, elementwise_kernels, engine_scaling, linear_kernels
    from ldlp.report.engine import attention_markdown as markdown

    lm = BatchedLlama(t32.model, 64)
    routes = attention_routes(lm, [5, 20, 40], slots=(1, 3), reps=1)
    assert [r["slots"] for r in routes] == [1, 3]
    assert all({"gather", "copy", "per_row_qkT", "per_row", "dense"} <= set(r["ms"]) for r in routes)
    linear = linear_kernels(lm, tokens=(1, 4), reps=1)
    assert all("F.linear" in r["ms"] and "engine_fused" in r["ms"] for r in linear)
    assert all(r["fused_same_bits"] for r in linear)  # fused q/k/v and gate/up: the bits of one call each
    elementwise = elementwise_kernels(lm, tokens=(1, 4), reps=1, compile=False)  # compiling takes a minute
    assert [r["tokens"] for r in elementwise["rows"]] == [1, 4]
    assert all(r["same_bits"] == {"engine": True} for r in elementwise["rows"])  # fused norm, rotary in one pass
    scaling = engine_scaling(t32, prompts_of((6, 9, 4)), concurrency=(1, 2), max_new_tokens=4)
    assert [r["concurrency"] for r in scaling] == [1, 2] and all(0 <= r["prefill_share"] <= 1 for r in scaling)
    meta = {"model": "tiny", "threads": 1, "machine": {}, "command": "x", "dtype": "float32", "max_new_tokens": 4}
    page = markdown({"meta": meta, "routes": [{"dtype": "float32", "set": "s", "rows": routes}],
                     "linear": [{"dtype": "float32", "rows": linear}],
                     "elementwise": [{"dtype": "float32", **elementwise}],
                     "scaling": [{"set": "s", "mean_prompt_tokens": 6.3, "rows": scaling}]})
    assert page.startswith("# The engine at real prompt lengths\n")  # renders; its rows are the ones checked above


def test_bf16_scores_read_the_cache_as_stored_with_the_same_bits():
    """In bfloat16 attention scores run as k @ qᵀ over the cache's own layout (fast on a CPU); they equal
    q @ kᵀ over the transposed view bit for bit, for a row (3-d) and a block of rows (4-d)."""
    from eagle_backbone.llama import _scores

    g = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 2, 300, 16, generator=g).to(torch.bfloat16)  # (slots, Hkv, capacity, D)
    for L, m in ((1, 1), (37, 4), (250, 9), (300, 40)):  # 40 rows: q @ kᵀ itself (SCORES_KQ_ROWS)
        k = cache[1, :, :L]
        q = torch.randn(2, m, 16, generator=g).to(torch.bfloat16)
        assert torch.equal(_scores(q, k, 0.25), torch.matmul(q, k.transpose(1, 2)) * 0.25)
        kb, qb = cache[:, :, :L], torch.randn(3, 2, m, 16, generator=g).to(torch.bfloat16)
        assert torch.equal(_scores(qb, kb, 0.25), torch.matmul(qb, kb.transpose(2, 3)) * 0.25)


def test_the_dense_block_rule_is_per_dtype_and_keeps_each_rows_logits(t32):
    """Rows with about 130 keys of padding a row run alone in float32 and as one dense block in bfloat16
    (the per-row route's fixed cost is larger there: DENSE_SLACK); an explicit slack overrides both. In
    bfloat16 the dense block's logits are the per-row route's to bf16 rounding, with the same greedy tokens."""
    from eagle_backbone.ragged import DENSE_SLACK, dense_slack

    assert dense_slack(torch.float32) < 133 < dense_slack(torch.bfloat16) and dense_slack(torch.float16) == 64
    assert set(DENSE_SLACK) == {torch.float32, torch.bfloat16}
    lens = [20, 220, 20]  # padded to 220: 400 keys over 3 rows (133 a row); rows 1-2 alone: 100 a row
    batch = RaggedBatch([0, 1, 2], [n - 1 for n in lens], [1] * 3, "cpu")
    assert batch.blocks_for(torch.float32) == [(0, 1), (1, 2), (2, 3)] == batch.blocks
    assert batch.blocks_for(torch.bfloat16) == [(0, 3)]
    assert RaggedBatch([0, 1, 2], [n - 1 for n in lens], [1] * 3, "cpu", dense_slack=0).blocks_for(torch.bfloat16) \
        == [(0, 1), (1, 2), (2, 3)]
    m = BatchedLlama(copy.deepcopy(t32.model).to(torch.bfloat16), 256)
    seqs = prompts_of(lens, seed=11)
    got = {}
    for slack in (None, 0):
        cache = m.new_cache(3)
        m(torch.tensor([x for s in seqs for x in s[:-1]]), RaggedBatch(range(3), [0] * 3, [n - 1 for n in lens], "cpu"),
          cache)
        step = RaggedBatch(range(3), [n - 1 for n in lens], [1] * 3, "cpu", dense_slack=slack)
        got[slack] = m.logits(m(torch.tensor([s[-1] for s in seqs]), step, cache)).float()
    assert torch.equal(got[None], got[0])  # batch-invariant: a dense block's rows have the per-row route's bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_products_keep_a_querys_bits_whatever_shares_the_call(dtype):
    """The kernel facts the engine's batch invariance rests on, checked on this CPU: a query row's scores and
    weighted values are the same bits alone or among more rows, and with masked keys (probability 0) after its
    own, up to the chunk the float32 route splits keys into (eagle_backbone/llama.py: INVARIANT_ROWS, KEY_CHUNK)."""
    from eagle_backbone.llama import KEY_CHUNK, _probs, _scores, _weighted_values

    g = torch.Generator().manual_seed(0)
    H, D = 3, 64
    for L in (5, 77, KEY_CHUNK, KEY_CHUNK + 61, 3 * KEY_CHUNK + 7):
        q = torch.randn(H, 9, D, generator=g).to(dtype)
        k, v = (torch.randn(H, L + 9, D, generator=g).to(dtype) for _ in range(2))
        probs = torch.softmax(torch.randn(H, 9, L, generator=g), -1).to(dtype)
        one_s, one_v = _scores(q[:, :1], k[:, :L], 0.125), _weighted_values(probs[:, :1], v[:, :L])
        for rows in (2, 3, 4, 9):
            assert torch.equal(_scores(q[:, :rows], k[:, :L], 0.125)[:, 0], one_s[:, 0])
            assert torch.equal(_scores(q[:, :rows], k, 0.125)[:, 0, :L], one_s[:, 0])  # more keys after
            padded = torch.cat([probs[:, :rows], probs.new_zeros(H, rows, 9)], -1)  # masked keys after its own
            assert torch.equal(_weighted_values(padded, v)[:, 0], one_v[:, 0])
        if dtype == torch.float32:  # the float32 softmax, over as few keys as a context's first tokens
            scores = 3 * torch.randn(H, 2, min(L, 40), generator=g)
            masked = torch.cat([scores, torch.full((H, 2, 9), torch.finfo(dtype).min)], -1)
            assert torch.equal(_probs(masked, dtype)[..., : scores.shape[-1]], _probs(scores, dtype))


def test_half_precision_softmax_by_row_chunks_has_the_same_bits():
    """A long bfloat16 prefill's softmax runs a few query rows at a time (cache-sized float32 rows): the same
    bits as one float32 softmax over the whole tensor cast back, for a row's and a dense block's shapes."""
    from eagle_backbone.llama import SOFTMAX_ROWS, _probs

    g = torch.Generator().manual_seed(0)
    for shape in ((2, 3 * SOFTMAX_ROWS + 5, 90), (3, 2, 1, SOFTMAX_ROWS + 1, 40), (2, SOFTMAX_ROWS, 33)):
        s = (4 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        s[..., -3:] = torch.finfo(torch.bfloat16).min  # masked keys, as the causal bias leaves them
        assert torch.equal(_probs(s, torch.bfloat16), torch.softmax(s, dim=-1, dtype=torch.float32).to(torch.bfloat16))
        f = s.float()
        assert torch.equal(_probs(f, torch.float32), torch.softmax(f, dim=-1, dtype=torch.float32))


@pytest.mark.parametrize("kind", ["eagle", "draft_lm"])
def test_a_finished_engine_is_freed_without_the_cyclic_collector(t32, eagle32, draft_lm, kind):
    """An engine and its candidate generator hold each other in one direction only (the generator's is weak): a
    benchmark that builds an engine per run frees each with its KV caches when it drops it, not whenever the
    cyclic collector next runs a full pass (a sweep on long prompts grew to 10 GB so)."""
    import gc
    import weakref

    drafter = eagle32 if kind == "eagle" else draft_lm
    gc.collect()
    gc.disable()
    try:
        engine = BatchedSpeculativeEngine(t32, drafter, kind, slots=2, policy=lambda: StaticPolicy(3))
        run_workload(engine, prompts_of((5, 9, 4)), 2, 8)
        alive = weakref.ref(engine)
        del engine
        assert alive() is None
    finally:
        gc.enable()
