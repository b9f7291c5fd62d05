"""Greedy speculative decoding equals plain greedy decoding, token for token."""

import random

import pytest
import torch
from conftest import make_drafter, make_target

from eagle_backbone.candidates import CandidateGenerator
from eagle_backbone.kinds.draft_lm import DraftModelCandidateGenerator
from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.decoder import SpeculativeDecoder, autoregressive_generate
from eagle_backbone.policy import GO, STOP, DraftPolicy, StaticPolicy


class ScriptedCandidates(CandidateGenerator):
    """Proposes the target's own greedy continuation, corrupted at random: controlled acceptance
    lengths (including whole drafts accepted and drafts running past EOS) for a random target. A candidate
    generator of a kind of its own, through the extension interface the shipped ones use."""

    kind = "scripted"

    def __init__(self, prompt, reference, corrupt=0.3, seed=0):
        self.full, self.corrupt = list(prompt) + list(reference), corrupt
        self.rng = random.Random(seed)

    def bind(self, view):
        self.vocab = view.vocab_size

    def _one_hot(self, positions):
        out = torch.full((len(positions), self.vocab), float("-inf"))
        for row, pos in enumerate(positions):
            tok = self.full[pos] if pos < len(self.full) else self.rng.randrange(self.vocab)
            if self.rng.random() < self.corrupt:
                tok = self.rng.randrange(self.vocab)
            out[row, tok] = 0.0
        return out

    def prefill(self, slots, tokens, batch, first, hidden):
        pass

    def start(self, slots, tlens):
        return self._one_hot([t + 1 for t in tlens]), None  # draft 1 sits right after the last token

    def extend(self, slots, tokens, tlens, depth, states):
        return self._one_hot([t + depth + 1 for t in tlens]), None


def random_prompts_from_one_token(n, vocab=64, seed=0, max_len=12):
    """``n`` random prompts of 1..max_len tokens, one-token prompts included (tokens 3..vocab-1; Python's random;
    tests/conftest.py's ``random_prompts`` draws 3..11 tokens with torch's)."""
    g = random.Random(seed)
    return [[g.randrange(3, vocab) for _ in range(g.randint(1, max_len))] for _ in range(n)]


# γ = 1, 3 and 8 (the smallest, a middle one, the largest the sweeps use) run by default; the rest of
# the sweep 1..8 with `pytest -m slow`
GAMMAS = [g if g in (1, 3, 8) else pytest.param(g, marks=pytest.mark.slow) for g in range(1, 9)]


@pytest.mark.parametrize("gamma", GAMMAS)
def test_eagle_greedy_identity(target, drafter, gamma):
    dec = SpeculativeDecoder(target, EagleCandidateGenerator(drafter, target), StaticPolicy(gamma))
    for prompt in random_prompts_from_one_token(4, seed=gamma):
        ref = target.reference_greedy(prompt, 24)
        out = dec.generate(prompt, 24)
        assert out.tokens == ref
        assert out.stats.new_tokens == len(ref)
        assert out.stats.target_forwards == 1 + len(out.stats.draft_lengths)


@pytest.mark.parametrize("gamma", GAMMAS)
def test_scripted_drafts_greedy_identity_and_accounting(target, gamma):
    for k, prompt in enumerate(random_prompts_from_one_token(5, seed=100 + gamma)):
        ref = target.reference_greedy(prompt, 30)
        cand = ScriptedCandidates(prompt, ref, corrupt=0.25, seed=k)
        out = SpeculativeDecoder(target, cand, StaticPolicy(gamma)).generate(prompt, 30)
        assert out.tokens == ref
        s = out.stats
        assert s.drafted_tokens == s.accepted_tokens + s.wasted_tokens
        assert s.new_tokens == len(ref) and s.tau >= 1.0
        assert sum(s.accept_lengths) == s.accepted_tokens


def test_self_drafting_accepts_everything():
    """The target as its own draft model: every draft is kept, τ = γ + 1."""
    target = make_target()
    target.eos_token_ids = set()
    dec = SpeculativeDecoder(target, DraftModelCandidateGenerator(target.model, target), StaticPolicy(4))
    prompt = [5, 9, 11]
    out = dec.generate(prompt, 25)
    assert out.tokens == target.reference_greedy(prompt, 25)
    assert out.stats.wasted_tokens == 0 and out.stats.target_forwards == 1 + -(-24 // 5)


@pytest.mark.parametrize("gamma", [1, 3, 5, 8])
def test_eos_inside_a_draft(gamma):
    target = make_target(seed=3)
    prompt = [4, 8, 15, 16]
    ref = target.reference_greedy(prompt, 20)
    target.eos_token_ids = {ref[6]}  # a token the target really emits becomes EOS
    stop = ref.index(ref[6]) + 1
    # drafts run past EOS: the scripted drafter proposes the whole reference continuation
    cand = ScriptedCandidates(prompt, ref, corrupt=0.0)
    out = SpeculativeDecoder(target, cand, StaticPolicy(gamma)).generate(prompt, 20)
    assert out.tokens == target.reference_greedy(prompt, 20) == autoregressive_generate(target, prompt, 20).tokens == ref[:stop]
    assert out.tokens[-1] in target.eos_token_ids


@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 11])
def test_max_new_tokens_mid_draft(target, max_new):
    dec = SpeculativeDecoder(target, DraftModelCandidateGenerator(target.model, target), StaticPolicy(5))
    out = dec.generate([7, 7, 3], max_new)
    assert len(out.tokens) == max_new
    assert out.tokens == target.reference_greedy([7, 7, 3], max_new)
    # self-drafting accepts every draft, and no draft reaches past the budget: nothing is wasted, and
    # each target forward (the prefill included) emits one token besides the accepted drafts
    s = out.stats
    assert s.wasted_tokens == 0 and s.drafted_tokens == s.accepted_tokens == max_new - s.target_forwards
    assert all(k <= min(5, max_new - 2) for k in s.draft_lengths)


def test_one_token_prompt_and_zero_budget(target, drafter):
    dec = SpeculativeDecoder(target, EagleCandidateGenerator(drafter, target), StaticPolicy(3))
    assert dec.generate([1], 16).tokens == target.reference_greedy([1], 16)
    assert dec.generate([1], 0).tokens == []


def test_context_end():
    small = make_target(max_pos=24)
    small.eos_token_ids = set()  # the context end, not an EOS or the budget, ends the response
    prompt = list(range(3, 20))
    dec = SpeculativeDecoder(small, DraftModelCandidateGenerator(small.model, small), StaticPolicy(6))
    out = dec.generate(prompt, 50)
    assert out.tokens == small.reference_greedy(prompt, 50) == autoregressive_generate(small, prompt, 50).tokens
    assert len(out.tokens) == 24 - len(prompt) + 1  # up to the last position's prediction, as plain decoding


class ZeroThenFour(DraftPolicy):
    name = "alternating"

    def plan(self, rows):
        return [0 if len(a) % 2 == 0 else 4 for a in rows.accepted]


class StopAfterTwo(DraftPolicy):
    name, reads_drafts = "stop2", True

    def plan(self, rows):
        assert rows.embeddings.shape == rows.features.shape
        return [6] * len(rows)

    def stop(self, d):
        torch.testing.assert_close(d.probs.sum(-1), torch.ones_like(d.probs[:, 0]))
        return torch.full_like(d.tokens, GO if d.depth < 2 else STOP)


def test_gamma_zero_steps_and_early_stop(target, drafter):
    prompt = [3, 14, 15, 9, 26]
    ref = target.reference_greedy(prompt, 30)
    for policy in (ZeroThenFour(), StopAfterTwo()):
        for cand in (EagleCandidateGenerator(drafter, target), DraftModelCandidateGenerator(target.model, target)):
            out = SpeculativeDecoder(target, cand, policy).generate(prompt, 30)
            assert out.tokens == ref
            lengths = out.stats.draft_lengths
            if isinstance(policy, ZeroThenFour):
                assert lengths[::2] == [0] * len(lengths[::2]) and max(lengths[1::2]) == 4
            else:  # γ = 6, but keep_drafting stops every chain after its second token
                assert max(lengths) == 2


def test_fp32_engine_matches_ar():
    target = make_target(seed=5, dtype=torch.float32)
    drafter = make_drafter(target, dtype=torch.float32)
    dec = SpeculativeDecoder(target, EagleCandidateGenerator(drafter, target), StaticPolicy(4))
    for prompt in random_prompts_from_one_token(4, seed=9):
        assert dec.generate(prompt, 20).tokens == target.reference_greedy(prompt, 20)


def test_forward_cost_bench_and_batch_invariance_report(target):
    from ldlp.bench.measurements.target import batch_invariance, forward_costs

    costs = forward_costs({"tiny": target}, lengths=(1, 3), context=8, reps=2)
    assert set(costs["tiny"]) == {1, 3} and all(s > 0 for s in costs["tiny"].values())
    inv = batch_invariance(target, trials=2, tokens=4, context=8)
    assert inv["positions"] == 8 and inv["argmax_flips"] == 0 and inv["max_abs_diff"] < 1e-9  # float64
