"""The EAGLE-3 drafter kind (eagle_backbone/eagle3.py): the target's layer states the engine keeps, greedy
identity with the target's own decoding (chains and trees, full and reduced draft vocabularies, several slots),
and both checkpoint layouts (EAGLE's and speculators') written with the real key names and shapes, loaded, and
refused with one line when a key is missing or unexpected. Its exact sampling (chi-square against the enumerated
distribution, with a reduced draft vocabulary: q mapped to the target's vocabulary by d2t) is checked beside the
draft LM's in tests/test_batched.py (test_sampled_prefixes_have_the_enumerated_distribution)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import EAGLE3_VOCAB as V
from conftest import SPECS, AnyTree, decode, make_eagle3, prompts_of

from eagle_backbone.kinds.eagle3 import Eagle3CandidateGenerator
from eagle_backbone.eagle3 import default_layer_ids
from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.llama import BatchedLlama
from eagle_backbone.ragged import RaggedBatch
from eagle_backbone.loading import load_drafter, tie_drafter_embedding
from eagle_backbone.policy import StaticPolicy

torch.set_num_threads(1)


def test_layer_states_are_transformers_hidden_states(t3):
    """Layer id i is the state entering decoder layer i: Hugging Face's output_hidden_states[i] (vLLM's and
    speculators' convention); the ids come back in the order asked."""
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = t3.model.model(ids, output_hidden_states=True).hidden_states
    m = BatchedLlama(t3.model, 32)
    _, extra = m(ids.reshape(-1), RaggedBatch([0, 1], [0, 0], [9, 9], "cpu"), m.new_cache(2), hidden_layers=(2, 0, 1))
    for got, i in zip(extra, (2, 0, 1)):
        torch.testing.assert_close(got, ref[i].reshape(18, -1), rtol=1e-5, atol=1e-5)


def test_default_layers_are_eagle3s():
    assert default_layer_ids(32) == (2, 16, 29) and default_layer_ids(40) == (2, 20, 37)
    assert default_layer_ids(8) == (2, 4, 5)  # the embedded target


@pytest.mark.parametrize("draft_vocab", [None, 5])
def test_greedy_chains_equal_the_targets_decoding(t3, draft_vocab):
    d = make_eagle3(t3, draft_vocab=draft_vocab)
    prompts = prompts_of((5, 12, 3, 8, 6), vocab=V)
    accepted = 0
    for gamma in (1, 3, 6):
        eng = BatchedSpeculativeEngine(t3, d, "eagle3", slots=3, policy=StaticPolicy(gamma))
        outs = decode(eng, prompts, n=24)  # more prompts than slots: admissions join running steps
        assert [o.tokens for o in outs] == [t3.reference_greedy(p, 24) for p in prompts]
        accepted += sum(o.stats.accepted_tokens for o in outs)
    assert accepted > 0 or draft_vocab is not None  # accepted paths as well as rollback (the sampling tests
    # reach accepted paths with a reduced vocabulary)


@pytest.mark.parametrize("spec", ["dyn2x3", "static_small"])
@pytest.mark.parametrize("draft_vocab", [None, 5])
def test_greedy_trees_equal_the_targets_decoding(t3, spec, draft_vocab):
    d = make_eagle3(t3, draft_vocab=draft_vocab)
    prompts = prompts_of((5, 12, 3, 8), vocab=V)
    eng = BatchedSpeculativeEngine(t3, d, "eagle3", slots=2, policy=AnyTree(SPECS[spec], 4))
    outs = decode(eng, prompts, n=20)
    assert [o.tokens for o in outs] == [t3.reference_greedy(p, 20) for p in prompts]


def test_the_generator_reads_the_drafters_layers(t3):
    d = make_eagle3(t3, layer_ids=(2, 0, 1))
    eng = BatchedSpeculativeEngine(t3, d, "eagle3", slots=1, policy=StaticPolicy(2))
    assert eng.feature_layers == (2, 0, 1) and eng.feat.shape[-1] == 3 * t3.hidden_size
    with pytest.raises(ValueError, match="do not fit a 3-layer target"):
        Eagle3CandidateGenerator(make_eagle3(t3, layer_ids=(0, 1, 3)), t3)


# ---- checkpoints: EAGLE's layout and speculators' ----------------------------------------------------------

def _llama_fields(target):
    c = target.model.config
    return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_attention_heads":
            c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads, "rms_norm_eps": c.rms_norm_eps,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size, "hidden_act": "silu",
            "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _real_weights(target, draft_vocab, prefix, seed=0):
    """Random weights under the names and shapes an EAGLE-3 head for ``target`` ships with (d = hidden size,
    heads·head_dim for the projections, 2d inputs to q/k/v, 3d to fc)."""
    g = torch.Generator().manual_seed(seed)
    c = target.model.config
    d, hd, f = c.hidden_size, c.hidden_size // c.num_attention_heads, c.intermediate_size
    shapes = {"fc.weight": (d, 3 * d), f"{prefix}hidden_norm.weight": (d,), f"{prefix}input_layernorm.weight": (d,),
              f"{prefix}post_attention_layernorm.weight": (d,),
              f"{prefix}self_attn.q_proj.weight": (c.num_attention_heads * hd, 2 * d),
              f"{prefix}self_attn.k_proj.weight": (c.num_key_value_heads * hd, 2 * d),
              f"{prefix}self_attn.v_proj.weight": (c.num_key_value_heads * hd, 2 * d),
              f"{prefix}self_attn.o_proj.weight": (d, c.num_attention_heads * hd),
              f"{prefix}mlp.gate_proj.weight": (f, d), f"{prefix}mlp.up_proj.weight": (f, d),
              f"{prefix}mlp.down_proj.weight": (d, f), "norm.weight": (d,), "lm_head.weight": (draft_vocab, d)}
    state = {k: 0.1 * torch.randn(s, generator=g) for k, s in shapes.items()}
    ids = torch.randperm(c.vocab_size, generator=g)[:draft_vocab].sort().values
    state["d2t"] = ids - torch.arange(draft_vocab)
    state["t2d"] = torch.zeros(c.vocab_size, dtype=torch.bool)
    state["t2d"][ids] = True
    return state


def _write(folder, config, state, fmt):
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(state, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")


def eagle_layout(target, folder, fmt="safetensors", draft_vocab=5, drop=(), extra=None):
    """A tiny head in SafeAILab's EAGLE-3 layout (config.json as their releases: a one-layer Llama config with
    draft_vocab_size; weights midlayer.*, no embedding)."""
    cfg = dict(_llama_fields(target), architectures=["LlamaForCausalLMEagle3"], model_type="llama",
               num_hidden_layers=1, draft_vocab_size=draft_vocab, tie_word_embeddings=False, torch_dtype="float16")
    state = _real_weights(target, draft_vocab, "midlayer.")
    state = {k: v for k, v in state.items() if k not in drop} | (extra or {})
    _write(folder, cfg, state, fmt)
    return state


def speculators_layout(target, folder, draft_vocab=5, layer_ids=(0, 1, 2), drop=(), extra=None):
    """A tiny head in speculators' layout (what vLLM serves): layers.0.*, embed_tokens, speculators_config."""
    layer = dict(_llama_fields(target), model_type="llama", num_hidden_layers=1, architectures=["LlamaForCausalLM"],
                 tie_word_embeddings=False)
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                        "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                  "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}},
           "transformer_layer_config": layer, "draft_vocab_size": draft_vocab, "norm_before_residual": False,
           "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": list(layer_ids)}
    state = _real_weights(target, draft_vocab, "layers.0.")
    state["embed_tokens.weight"] = target.embed_tokens.weight.detach().float().clone()
    state = {k: v for k, v in state.items() if k not in drop} | (extra or {})
    _write(folder, cfg, state, "safetensors")
    return state


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle_layout_loads_and_decodes(t3, tmp_path, fmt):
    state = eagle_layout(t3, tmp_path / "e3", fmt)
    d = load_drafter("eagle3", tmp_path / "e3")
    assert not d.has_own_embedding and d.draft_vocab_size == 5 and d.layer_ids is None
    assert tie_drafter_embedding(d, t3)
    torch.testing.assert_close(d.midlayer.self_attn.q_proj.weight, state["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(d.draft_to_target(), state["t2d"].nonzero()[:, 0])
    assert Eagle3CandidateGenerator(d, t3).feature_layers == (2, 1, 0)  # EAGLE-3's default for 3 layers
    prompts = prompts_of((5, 9), vocab=V)
    outs = BatchedSpeculativeEngine(t3, d, "eagle3", slots=2, policy=StaticPolicy(3)).generate(prompts, 12)
    assert [o.tokens for o in outs] == [t3.reference_greedy(p, 12) for p in prompts]


def test_speculators_layout_loads(t3, tmp_path):
    state = speculators_layout(t3, tmp_path / "sp", layer_ids=(2, 0, 1))
    d = load_drafter("eagle3", tmp_path / "sp")
    assert d.has_own_embedding and d.layer_ids == (2, 0, 1) and not d.norm_before_residual
    torch.testing.assert_close(d.midlayer.hidden_norm.weight, state["layers.0.hidden_norm.weight"])
    assert Eagle3CandidateGenerator(d, t3).feature_layers == (2, 0, 1)


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_missing_or_unexpected_keys_are_refused_in_one_line(t3, tmp_path, layout):
    write, prefix = (eagle_layout, "midlayer.") if layout == "eagle" else (speculators_layout, "layers.0.")
    write(t3, tmp_path / "a", drop=(f"{prefix}hidden_norm.weight",))
    with pytest.raises(ValueError, match=r"missing keys \['midlayer.hidden_norm.weight'\]") as e:
        load_drafter("eagle3", tmp_path / "a")
    assert "\n" not in str(e.value)
    write(t3, tmp_path / "b", extra={"verifier_lm_head.weight": torch.zeros(V, 32)})
    with pytest.raises(ValueError, match=r"unexpected keys \['verifier_lm_head.weight'\]"):
        load_drafter("eagle3", tmp_path / "b")
    write(t3, tmp_path / "c", drop=("d2t",))  # a reduced vocabulary needs its map
    with pytest.raises(ValueError, match=r"missing keys \['d2t'\]"):
        load_drafter("eagle3", tmp_path / "c")


def test_unsupported_speculators_variants_are_refused(t3, tmp_path):
    speculators_layout(t3, tmp_path / "n")
    cfg = json.loads((tmp_path / "n" / "config.json").read_text())
    (tmp_path / "n" / "config.json").write_text(json.dumps(cfg | {"norm_before_fc": True}))
    with pytest.raises(ValueError, match="norm_before_fc set"):
        load_drafter("eagle3", tmp_path / "n")


def test_a_d2t_past_the_vocabulary_is_refused_at_load(t3, tmp_path):
    state = eagle_layout(t3, tmp_path / "past")
    d2t = state["d2t"].clone()
    d2t[-1] = 100  # draft token 4 -> target token 104 of 8
    _write(tmp_path / "bad", json.loads((tmp_path / "past" / "config.json").read_text()), state | {"d2t": d2t},
           "safetensors")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'bad'}: d2t maps draft token 4 to target token 104, outside "
                                         "the vocabulary 0..7") as e:
        load_drafter("eagle3", tmp_path / "bad")
    assert "\n" not in str(e.value)
    _write(tmp_path / "identity", json.loads((tmp_path / "past" / "config.json").read_text()),
           state | {"d2t": torch.zeros(5, dtype=torch.long)}, "safetensors")  # draft token i -> i: fine
    assert load_drafter("eagle3", tmp_path / "identity").draft_vocab_size == 5
    _write(tmp_path / "dup", json.loads((tmp_path / "past" / "config.json").read_text()),
           state | {"d2t": torch.tensor([1, 0, 0, 0, 0])}, "safetensors")
    with pytest.raises(ValueError, match="d2t maps two draft tokens to one target token"):
        load_drafter("eagle3", tmp_path / "dup")


def test_a_head_for_another_hidden_size_is_refused_naming_both_sizes_and_files(t3, tmp_path):
    from eagle_backbone.loading import check_drafter_fits, load_pair

    speculators_layout(t3, tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    cfg["transformer_layer_config"]["hidden_size"] = 33  # not even a multiple of the heads: transformers' own error
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    t3.model.config.save_pretrained(tmp_path / "target")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'h' / 'config.json'}: hidden_size 33 differs from the "
                                         f"target's 32 \\({tmp_path / 'target' / 'config.json'}\\)") as e:
        check_drafter_fits("eagle3", tmp_path / "h", tmp_path / "target")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="hidden_size 33 differs from the target's 32"):  # before either model loads
        load_pair({"target": str(tmp_path / "target"), "drafter": str(tmp_path / "h"), "drafter_kind": "eagle3",
                   "dtype": "float32", "device": "cpu"})
    with pytest.raises(ValueError, match=f"^{tmp_path / 'h' / 'config.json'}: not a Llama layer config: The hidden "
                                         "size \\(33\\) is not a multiple") as e:  # the head alone, without a target
        load_drafter("eagle3", tmp_path / "h")
    assert "\n" not in str(e.value)
    check_drafter_fits("draft_lm", tmp_path / "h", tmp_path / "target")  # a draft LM has its own sizes


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
@pytest.mark.parametrize("draft_vocab", [None, 5])
def test_written_heads_load_back_identically(t3, tmp_path, layout, draft_vocab):
    d = make_eagle3(t3, draft_vocab=draft_vocab)
    d.save_pretrained(tmp_path / "h", layout=layout, verifier="tiny")
    back = load_drafter("eagle3", tmp_path / "h")
    tie_drafter_embedding(back, t3)
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    keys = set(__import__("safetensors.torch", fromlist=["load_file"]).load_file(str(tmp_path / "h" / "model.safetensors")))
    # the identity map of a full draft vocabulary is left out (vLLM refuses it), a reduced one's is written
    assert ({"d2t", "t2d"} <= keys) == (draft_vocab is not None)
    if layout == "eagle":
        assert "midlayer.hidden_norm.weight" in keys and "embed_tokens.weight" not in keys
    else:
        assert "layers.0.hidden_norm.weight" in keys and "embed_tokens.weight" in keys
        cfg = json.loads((tmp_path / "h" / "config.json").read_text())
        assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
        assert cfg["speculators_config"]["algorithm"] == "eagle3"


def test_the_verifier_is_written_relative_to_the_repository(t3, tmp_path):
    """speculators' verifier.name_or_path names no machine: a target inside the repository is written relative
    to its root (vllm serve run from the root finds it), a hub id or an outside folder as given."""
    from eagle_backbone.eagle3 import portable_verifier
    from eagle_backbone.paths import EMBEDDED_DIR, REPO_ROOT

    assert portable_verifier(EMBEDDED_DIR / "target") == "data/embedded/target"
    assert portable_verifier(str(REPO_ROOT / "data" / ".." / "data" / "embedded" / "target")) == "data/embedded/target"
    assert portable_verifier("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    assert portable_verifier("/models/Llama-3.1-8B") == "/models/Llama-3.1-8B" and portable_verifier(None) is None
    make_eagle3(t3).save_pretrained(tmp_path / "h", layout="speculators", verifier=str(EMBEDDED_DIR / "target"))
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "data/embedded/target"
    load_drafter("eagle3", tmp_path / "h")


def test_speculators_package_reads_the_written_config(t3, tmp_path):
    """When the optional ``speculators`` package is installed (pip install -e .[eagle3]), its own config class
    parses the config.json written here."""
    spec = pytest.importorskip("speculators.models.eagle3", reason="speculators not installed (extra eagle3)")
    make_eagle3(t3).save_pretrained(tmp_path / "h", layout="speculators", verifier="tiny")
    cfg = spec.Eagle3SpeculatorConfig.from_pretrained(str(tmp_path / "h"))
    assert cfg.draft_vocab_size == V and list(cfg.eagle_aux_hidden_state_layer_ids) == [0, 1, 2]


# ---- model configs ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,env", [("llama31_eagle3", ("LLAMA31_PATH", "EAGLE3_LLAMA31_PATH")),
                                      ("vicuna13b_eagle3", ("VICUNA13B_PATH", "EAGLE3_VICUNA13B_PATH"))])
def test_gpu_model_configs_compose_from_local_folders(tmp_path, monkeypatch, name, env):
    from conftest import compose_config
    from omegaconf import OmegaConf

    for var in env:
        (tmp_path / var).mkdir()
        (tmp_path / var / "config.json").write_text("{}")
        monkeypatch.setenv(var, str(tmp_path / var))
    model = OmegaConf.to_container(compose_config("evaluate", [f"model={name}"]).model, resolve=True)
    assert model["drafter_kind"] == "eagle3"
    assert (model["target"], model["drafter"]) == (str(tmp_path / env[0]), str(tmp_path / env[1]))
    monkeypatch.setenv(env[1], str(tmp_path / "nowhere"))
    with pytest.raises(Exception, match=f"set {env[1]} to the model folder"):
        OmegaConf.to_container(compose_config("evaluate", [f"model={name}"]).model, resolve=True)


def test_embedded_eagle3_config_reads_the_trained_heads_folder():
    from conftest import compose_config
    from omegaconf import OmegaConf

    from eagle_backbone.paths import EMBEDDED_DIR

    model = OmegaConf.to_container(compose_config("evaluate", ["model=embedded_eagle3"]).model, resolve=True)
    assert model["drafter_kind"] == "eagle3" and model["drafter"] == str(EMBEDDED_DIR / "eagle3")
    assert model["target"] == str(EMBEDDED_DIR / "target")


def test_the_cost_profiler_and_a_load_aware_policy_run_on_an_eagle3_drafter(t3, tmp_path):
    """The cost profile knows the EAGLE-3 generator (its fused features in, its own state a depth), so a
    cost-driven policy profiles its table on first use and decodes losslessly on the EAGLE-3 pair."""
    from ldlp.policies.load_aware import LoadAwareStep

    head = make_eagle3(t3)
    pol = LoadAwareStep({"cost_dir": str(tmp_path), "model": "tiny"}, explore_every=0)
    eng = BatchedSpeculativeEngine(t3, head, "eagle3", slots=2, policy=pol)
    prompts = prompts_of((5, 9), vocab=V)
    outs = eng.generate(prompts, 10)
    assert [o.tokens for o in outs] == [t3.reference_greedy(p, 10) for p in prompts]
    assert pol.pricing.table is not None and pol.pricing.table.key["drafter_kind"] == "eagle3" and eng.cost_model.seen > 0


def test_the_drafters_bench_compares_each_drafter_with_the_reference_on_the_same_prompts(tmp_path):
    """scripts/bench_drafters.py's library on the embedded pair, a few prompts: every drafter at every γ and AR,
    lossless, and each comparison a paired ratio with its interval (the point inside it); a prompt set whose file
    is missing is skipped with one line on the page, the others measured."""
    from conftest import compose_config

    from ldlp.bench.peers.drafters import bench_drafters
    from ldlp.report.drafters import drafters_markdown

    cfg = compose_config("bench_drafters", ["data.limit=4", "generation.max_new_tokens=8",
                                            "gammas=[3,4]", "tau_gamma=3", "temperatures=[0.0]", "rounds=1",
                                            "bootstrap=200", "evaluation.progress=false", "threads=1",
                                            "model.dtype=float32", "sets=[embedded_test,mt_bench]",
                                            f"prompt_sets.mt_bench.path={tmp_path / 'absent.jsonl'}",
                                            "pairs=[[eagle1,eagle3]]"])
    result = bench_drafters(cfg)
    assert list(result["sets"]) == ["embedded_test"]
    assert result["skipped"] == {"mt_bench": f"{tmp_path / 'absent.jsonl'} does not exist (prompt_sets.mt_bench.path)"}
    cell = result["sets"]["embedded_test"]["by_temperature"]["0.0"]
    assert cell["lossless"] is True and result["sets"]["embedded_test"]["n_prompts"] == 4
    assert cell["labels"] == ["eagle1 γ=3", "eagle1 γ=4", "eagle3 γ=3", "eagle3 γ=4", "ar_ours"]
    for comparison in (cell["tau_vs_reference"]["eagle3"], cell["best_static_vs_reference"]["eagle3"],
                       *cell["same_gamma_vs_reference"]["eagle3"].values()):
        lo, hi = comparison["ci95"]
        assert lo <= comparison["ratio"] <= hi and comparison["ratio"] > 0
    [row] = result["summary"]
    assert (row["set"], row["temperature"], row["tau"]) == ("embedded_test", 0.0, cell["tau_vs_reference"]["eagle3"]["tau"])
    [pair] = result["pairs"]  # eagle1 over eagle3: the reference's ratio inverted, on the same resampled prompts
    assert (pair["drafter"], pair["over"]) == ("eagle1", "eagle3")
    assert pair["ratio"] == pytest.approx(1 / row["ratio"]) and pair["ci95"][0] <= pair["ratio"] <= pair["ci95"][1]
    assert (pair["set"], pair["temperature"]) == ("embedded_test", 0.0)
    assert (row["n_prompts"], row["drafter"]) == (4, "eagle3")  # the rows behind the page's tables
    assert drafters_markdown(result).startswith("### Drafters head to head (")  # the page's render check
    for name in ("eagle1", "eagle3"):  # each chain's acceptance by depth at tau_gamma: reached, then kept, falling counts
        depth = cell["acceptance_by_depth"][name]
        assert [x["depth"] for x in depth] == [1, 2, 3] and depth[0]["reached"] > 0
        assert all(x["kept"] <= x["reached"] for x in depth)
        assert all(b["reached"] <= a["kept"] for a, b in zip(depth, depth[1:]))
    assert "#### acceptance by draft depth at γ = 3, every prompt set" in drafters_markdown(result)
    cell["costs"]["eagle3"] = {"step_ms": 0.0, "draft_ms": 1.0, "c": None}  # one γ alone fits no step cost
    assert "fitted costs of eagle3" not in drafters_markdown(result)


def test_the_drafters_bench_times_sampled_decoding_when_asked():
    """sampled_timed=true: at T = 1 every drafter runs every γ beside AR in turns, as at T = 0, and the page gives
    each drafter's best static γ with its paired tokens/s against the reference's; without it T = 1 is τ alone."""
    from conftest import compose_config

    from ldlp.bench.peers.drafters import bench_drafters

    base = ["data.limit=3", "generation.max_new_tokens=8", "gammas=[3,4]", "tau_gamma=3", "temperatures=[1.0]",
            "sampled_rounds=2", "bootstrap=200", "evaluation.progress=false", "threads=1", "model.dtype=float32",
            "sets=[embedded_test]"]
    result = bench_drafters(compose_config("bench_drafters", [*base, "sampled_timed=true"]))
    cell = result["sets"]["embedded_test"]["by_temperature"]["1.0"]
    assert cell["labels"] == ["eagle1 γ=3", "eagle1 γ=4", "eagle3 γ=3", "eagle3 γ=4", "ar_ours"]
    assert cell["rounds"] == 2 and cell["lossless"] is None  # greedy identity is checked at T = 0 only
    best = cell["best_static_vs_reference"]["eagle3"]
    lo, hi = best["ci95"]
    assert lo <= best["ratio"] <= hi and best["gamma"] in (3, 4) and 0 <= best["rounds_faster"] <= 2
    [row] = result["speed_summary"]
    assert (row["set"], row["temperature"], row["ratio"]) == ("embedded_test", 1.0, best["ratio"])
    assert row["tokens_per_s"] == cell["best_static"]["eagle3"]["tokens_per_s"]
    assert (row["n_prompts"], row["rounds"], row["drafter"]) == (3, 2, "eagle3")  # the row behind the page's table

    untimed = bench_drafters(compose_config("bench_drafters", [*base, "sampled_rounds=1"]))
    cell = untimed["sets"]["embedded_test"]["by_temperature"]["1.0"]
    assert cell["labels"] == ["eagle1 γ=3", "eagle3 γ=3"] and "best_static" not in cell
    assert untimed["speed_summary"] == []  # the page has no tokens/s table


def test_the_drafters_bench_names_its_prompt_sets_and_refuses_none_left(tmp_path):
    """Unknown set names and a run whose every set is missing are one-line errors, before anything loads;
    sets=[] is the data node alone."""
    from conftest import compose_config

    from ldlp.bench.peers.drafters import prompt_sets

    cfg = compose_config("bench_drafters", ["sets=[]", "data=mt_bench", f"data.path={tmp_path / 'q.jsonl'}"])
    assert list(prompt_sets(cfg)[0]) == ["mt_bench"]
    with pytest.raises(ValueError, match=r"^sets: \['nope'\] not in prompt_sets"):
        prompt_sets(compose_config("bench_drafters", ["sets=[nope]"]))
    absent = [f"prompt_sets.{n}.path={tmp_path / n}" for n in ("mt_bench", "sharegpt")]
    with pytest.raises(ValueError, match="^no prompt set to measure: every one of"):
        prompt_sets(compose_config("bench_drafters", ["sets=[mt_bench,sharegpt]", *absent]))
