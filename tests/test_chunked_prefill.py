"""Chunked prefill (eagle_backbone/prefill.py, ``prefill="chunked"``): prompts longer than ``max_batched_tokens``
read in chunks beside the decoding rows of the same target forward. Greedy output equals the target's own
greedy decoding with the shipped EAGLE-1 and EAGLE-3 heads (float32, and bfloat16 where the CPU has bf16
matmuls, as the shipped config runs), chains and trees; a seeded sampled run gives the tokens joined prefill
gives (each sequence's random stream does not depend on the schedule); bad settings are refused in one line.
No test reads a clock."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import SPECS, AnyTree, one_line

from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.policy import StaticPolicy
from eagle_backbone.sampling import SamplingConfig
from ldlp.bench.harness.workload import run_workload

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parent.parent
EMBEDDED = REPO / "data" / "embedded"
SHIPPED = (EMBEDDED / "target").is_dir() and (EMBEDDED / "drafter").is_dir() and (EMBEDDED / "eagle3").is_dir()
pytestmark = pytest.mark.skipif(not SHIPPED, reason="the embedded models are not in data/embedded")

BUDGET = 24  # tokens a target forward scores: the test prompts are longer, the decoding rows take up to 3 × 5


def _pair(dtype: str, eagle3: bool):
    from eagle_backbone.loading import load_pair
    from eagle_backbone.paths import embedded_model_config

    extra = {"drafter": str(EMBEDDED / "eagle3"), "drafter_kind": "eagle3"} if eagle3 else {}
    return load_pair(embedded_model_config(dtype=dtype, **extra))


@pytest.fixture(scope="module")
def pairs():
    cache = {}

    def get(dtype: str, eagle3: bool):
        if (dtype, eagle3) not in cache:
            cache[(dtype, eagle3)] = _pair(dtype, eagle3)
        return cache[(dtype, eagle3)]

    return get


def long_prompts(tokenizer) -> list[list[int]]:
    """Real text (this repository's own source, which the embedded pair's corpus resembles), short and long
    prompts mixed so that long ones are admitted while others decode."""
    text = [line for name in ("batched_engine.py", "prefill.py", "tree_step.py")  # the engine's source
            for line in (REPO / "eagle_backbone" / name).read_text().splitlines()]
    spans = [(40, 44), (100, 112), (130, 131), (300, 318), (420, 424), (470, 490), (610, 612), (700, 716)]
    return [tokenizer.encode("\n".join(text[a:b]))[:90] for a, b in spans]


def _run(pair, prompts, prefill, policy, max_new=24, slots=3, sampling=None, budget=BUDGET):
    eng = BatchedSpeculativeEngine(pair.target, pair.candidates, slots=slots, policy=policy, prefill=prefill,
                                   max_batched_tokens=budget, sampling=sampling)
    res = run_workload(eng, prompts, slots, max_new, list(range(100, 100 + len(prompts))))
    eng.accepted = [o.stats.accept_lengths for o in res.outputs]  # accepted drafts per step, per prompt
    return [o.tokens for o in res.outputs], eng


def _check_chunks_mixed(eng, prompts, budget):
    """The run did what the test is about: prompt chunks rode beside decoding rows within the budget, and some
    prompt took more than one chunk."""
    mixed = [r.shape for r in eng.step_log if r.shape.prefill > 0]
    assert mixed, "no prompt chunk joined a decoding step"
    assert all(s.scored + s.prefill <= budget for s in mixed)
    assert sum(len(p) > budget for p in prompts) >= 3
    assert any(s.prefill_keys > s.prefill * (s.prefill + 1) / 2 for s in mixed)  # a chunk past a prompt's start


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle", "eagle3"])
def test_chunked_greedy_equals_the_targets_decoding_float32(pairs, eagle3):
    pair = pairs("float32", eagle3)
    prompts = long_prompts(pair.tokenizer)
    ref = [pair.target.reference_greedy(p, 24) for p in prompts]
    got, eng = _run(pair, prompts, "chunked", StaticPolicy(4))
    assert got == ref
    _check_chunks_mixed(eng, prompts, BUDGET)
    # the drafter read every chunk's features: it accepts what it accepts after a whole-prompt prefill
    _, joined = _run(pair, prompts, "joined", StaticPolicy(4))
    assert eng.accepted == joined.accepted and sum(map(sum, eng.accepted)) > 0


@pytest.mark.parametrize("budget", [1, 7, 4096])
def test_chunked_budgets_from_one_token_to_whole_prompts(pairs, budget):
    """A one-token budget (prompts advance only while the decoding rows leave room, or when nothing runs), a
    small one, and one larger than any prompt (every prompt read whole, as joined)."""
    pair = pairs("float32", False)
    prompts = long_prompts(pair.tokenizer)[:5]
    got, _ = _run(pair, prompts, "chunked", StaticPolicy(2), max_new=12, budget=budget)
    assert got == [pair.target.reference_greedy(p, 12) for p in prompts]


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle", "eagle3"])
def test_chunked_greedy_with_draft_trees(pairs, eagle3):
    pair = pairs("float32", eagle3)
    prompts = long_prompts(pair.tokenizer)[:6]
    got, eng = _run(pair, prompts, "chunked", AnyTree(SPECS["dyn2x3"], 4), max_new=16, budget=40)
    assert got == [pair.target.reference_greedy(p, 16) for p in prompts]
    assert any(r.shape.tree and r.shape.prefill > 0 for r in eng.step_log)  # chunks beside tree rows


@pytest.mark.skipif(not any("avx512_bf16" in line or "amx_bf16" in line
                            for line in Path("/proc/cpuinfo").read_text().splitlines()
                            if line.startswith("flags")) if Path("/proc/cpuinfo").exists() else True,
                    reason="bfloat16 identity is checked where the CPU has bf16 matmuls (the shipped setting)")
@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle", "eagle3"])
def test_chunked_greedy_equals_the_targets_decoding_bfloat16(pairs, eagle3):
    pair = pairs("bfloat16", eagle3)
    prompts = long_prompts(pair.tokenizer)
    got, eng = _run(pair, prompts, "chunked", StaticPolicy(4))
    assert got == [pair.target.reference_greedy(p, 24) for p in prompts]
    _check_chunks_mixed(eng, prompts, BUDGET)


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle", "eagle3"])
def test_sampled_tokens_do_not_depend_on_the_prefill_schedule(pairs, eagle3):
    """Each sequence draws from its own stream (its seed, its step, the draw's index): chunked prefill changes
    when a prompt is read, not what its sequence draws."""
    pair = pairs("float32", eagle3)
    prompts = long_prompts(pair.tokenizer)
    samp = SamplingConfig(temperature=1.0)
    joined, _ = _run(pair, prompts, "joined", StaticPolicy(3), sampling=samp)
    chunked, eng = _run(pair, prompts, "chunked", StaticPolicy(3), sampling=samp)
    assert chunked == joined
    _check_chunks_mixed(eng, prompts, BUDGET)


@pytest.mark.parametrize("kw, message", [
    ({"max_batched_tokens": 0}, r"max_batched_tokens must be an integer >= 1, got 0"),
    ({"max_batched_tokens": -3}, r"max_batched_tokens must be an integer >= 1, got -3"),
    ({"max_batched_tokens": 2.5}, r"max_batched_tokens must be an integer >= 1, got 2.5"),
    ({"max_batched_tokens": True}, r"max_batched_tokens must be an integer >= 1, got True"),
    ({"prefill": "lazy"}, r"prefill must be one of joined, chunked, separate, got 'lazy'"),
])
def test_bad_prefill_settings_are_refused_in_one_line(pairs, kw, message):
    pair = pairs("float32", False)
    with pytest.raises(ValueError, match=message) as e:
        BatchedSpeculativeEngine(pair.target, pair.candidates, slots=2, **kw)
    one_line(e)


def test_bench_contenders_carry_engine_settings():
    """scripts/bench_batch.py: a contender's prefill settings come out of its policy tokens, over the config's
    engine defaults, and bad ones are refused in one line before any model loads."""
    from eagle_backbone.errors import ConfigError
    from ldlp.bench.harness.contender import engine_defaults, engine_label, engine_settings, parse_contender

    defaults = {"prefill": "joined", "max_batched_tokens": 512}
    spec = parse_contender("policy=static policy.gamma=3 prefill=chunked")
    assert spec.policy_overrides() == ["policy=static", "policy.gamma=3"] and spec.engine == {"prefill": "chunked"}
    assert engine_settings(spec, defaults) == {"prefill": "chunked", "max_batched_tokens": 512}
    assert engine_label("static γ=3", spec.engine) == "static γ=3 prefill=chunked"
    assert engine_settings(parse_contender("policy=static"), defaults) == defaults
    for text, message in (("max_batched_tokens=0", "max_batched_tokens must be an integer >= 1, got 0"),
                          ("prefill=lazy", "prefill must be one of joined, chunked, separate, got 'lazy'")):
        with pytest.raises(ConfigError, match=message) as e:
            engine_settings(parse_contender(text), defaults)
        one_line(e)
    with pytest.raises(ConfigError, match="engine: max_batched_tokens") as e:
        engine_defaults({"prefill": "chunked", "max_batched_tokens": -1})
    one_line(e)


def test_a_contenders_budget_is_one_the_engine_applies():
    """A max_batched_tokens the chosen prefill ignores is refused, and so is one below a decode step at the largest
    C (the engine would score past it), each in one line naming the contender."""
    from eagle_backbone.errors import ConfigError
    from ldlp.bench.harness.contender import ENGINE_DEFAULTS, engine_settings, parse_contender
    from ldlp.bench.comparisons.load_sweep import Contender, check_token_budgets

    with pytest.raises(ConfigError, match="max_batched_tokens applies to prefill=chunked only.*joined") as e:
        engine_settings(parse_contender("policy=static policy.gamma=2 max_batched_tokens=1"),
                        {**ENGINE_DEFAULTS, "prefill": "joined"})
    one_line(e)
    ok = Contender("static γ=4", "static", 4, None, engine={"prefill": "chunked", "max_batched_tokens": 160})
    check_token_budgets([ok], [1, 32], 64)  # 32 rows x 5 tokens fit
    tight = Contender("load_aware", "load_aware", None, None, engine={"prefill": "chunked", "max_batched_tokens": 160})
    with pytest.raises(ConfigError, match="load_aware: max_batched_tokens=160 is below one decode step at C=32") as e:
        check_token_budgets([tight], [1, 32], 64)
    one_line(e)
    check_token_budgets([Contender("x", "x", None, None, engine={"prefill": "joined", "max_batched_tokens": 1})],
                        [32], 64)  # joined prefill has no budget to keep
