"""vLLM as a peer (ldlp/bench/peers/vllm_peer.py): the drafter's fc bias folded into its own embedding for vLLM's
bias-free EAGLE-1 drafter (plain torch, always run), the contender strings and their refusals, the shipped
EAGLE-3 head's folder as vLLM reads it, and end-to-end tests (vLLM's AR, EAGLE and EAGLE-3 against the target's
greedy decoding) that run only where a Python with vLLM is given (ADAEAGLE_VLLM_PYTHON, or this interpreter
when it has vllm)."""

import json

import pytest
from conftest import needs_vllm, vllm_python
import torch
from transformers import LlamaConfig

from eagle_backbone.drafter import EagleDrafter
from eagle_backbone.paths import REPO_ROOT
from ldlp.bench.harness.contender import PeerNode, parse_contender
from ldlp.bench.peers.vllm_peer import contender_label, convert_drafter, fold_fc_bias

EMBEDDED = REPO_ROOT / "data" / "embedded"


def _bias_free_twin(drafter: EagleDrafter, folded: dict) -> EagleDrafter:
    """The same drafter without an fc bias (vLLM's EagleLlamaForCausalLM math), loaded with ``folded``."""
    cfg = LlamaConfig(**{**drafter.config.to_dict(), "bias": False})
    cfg._attn_implementation = drafter.config._attn_implementation
    twin = EagleDrafter(cfg).to(torch.float32).eval()
    assert twin.fc.bias is None
    twin.load_state_dict({k: v for k, v in folded.items()}, strict=False)
    twin.embed_tokens.weight.data.copy_(folded["embed_tokens.weight"])
    return twin


def _outputs(drafter, ids, feats):
    with torch.inference_mode():
        return drafter(ids, feats)


def test_folded_bias_reproduces_the_shipped_drafter_to_float32_rounding():
    drafter = EagleDrafter.from_pretrained(EMBEDDED / "drafter", dtype="float32")
    assert drafter.fc.bias is not None and bool(drafter.fc.bias.any())
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}
    folded = fold_fc_bias(state)
    assert "fc.bias" not in folded and folded["embed_tokens.weight"].dtype == torch.float32
    twin = _bias_free_twin(drafter, folded)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, drafter.vocab_size, (3, 24), generator=g)
    feats = torch.randn(3, 24, drafter.hidden_size, generator=g)
    # the fc output itself: W_e (e + W_e⁻¹ b) + W_f f against W_e e + W_f f + b, in float64 as the reference
    x64 = torch.cat([drafter.embed_tokens(ids).double(), feats.double()], -1)
    ref = x64 @ drafter.fc.weight.double().T + drafter.fc.bias.double()
    ours = drafter.fc(torch.cat([drafter.embed_tokens(ids), feats], -1)).double()
    folded_h = twin.fc(torch.cat([twin.embed_tokens(ids), feats], -1)).double()
    err_ours, err_folded = (ours - ref).abs().max().item(), (folded_h - ref).abs().max().item()
    scale = ref.abs().max().item()
    # both within a few float32 roundings of the exact value (the fold adds at most one rounding of e + shift)
    assert err_folded <= max(8 * err_ours, 64 * torch.finfo(torch.float32).eps * scale), (err_ours, err_folded)
    # and the whole layer: the drafted features agree to float32 rounding
    a, b = _outputs(drafter, ids, feats), _outputs(twin, ids, feats)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * a.abs().max().item()), (a - b).abs().max()
    # the target's LM head reads both the same way: the drafted tokens are the same
    from safetensors.torch import load_file

    head = load_file(str(EMBEDDED / "target" / "model.safetensors"))["lm_head.weight"].float()
    assert torch.equal((a @ head.T).argmax(-1), (b @ head.T).argmax(-1))


def test_fold_on_a_random_drafter_and_a_tied_embedding():
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=64, bias=True)
    drafter = EagleDrafter(cfg).float().eval()
    with torch.no_grad():
        drafter.fc.bias.normal_()
        drafter.embed_tokens.weight.normal_()
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}
    emb = state.pop("embed_tokens.weight")  # a checkpoint that ties the target's embedding
    with pytest.raises(ValueError, match="no embed_tokens"):
        fold_fc_bias(state)
    folded = fold_fc_bias(state, embedding=emb)
    twin = _bias_free_twin(drafter, folded)
    ids = torch.randint(0, 50, (2, 9))
    feats = torch.randn(2, 9, 32)
    a, b = _outputs(drafter, ids, feats), _outputs(twin, ids, feats)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()


def test_fold_refuses_a_singular_embedding_half():
    d = 8
    state = {"embed_tokens.weight": torch.randn(10, d), "fc.weight": torch.randn(d, 2 * d), "fc.bias": torch.randn(d)}
    state["fc.weight"][:, 0] = 0.0  # W_e loses a column: singular
    with pytest.raises(ValueError, match="condition number"):
        fold_fc_bias(state)
    state["fc.bias"] = torch.zeros(d)  # nothing to fold: any W_e will do
    assert "fc.bias" not in fold_fc_bias(state)


def test_convert_drafter_writes_once_in_vllms_layout(tmp_path):
    out = convert_drafter(EMBEDDED / "drafter", EMBEDDED / "target", tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["bias"] is False and cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLM"]
    from safetensors.torch import load_file

    w = load_file(str(out / "model.safetensors"))
    assert "fc.bias" not in w and all(v.dtype == torch.float32 for v in w.values())
    assert "lm_head.weight" not in w  # vLLM then shares the target's
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert convert_drafter(EMBEDDED / "drafter", EMBEDDED / "target", tmp_path) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rewritten


def test_contender_strings():
    assert parse_contender("policy=static policy.gamma=3").peer is None
    assert parse_contender("engine=vllm").peer == PeerNode("vllm", None, None, None)
    assert parse_contender("engine=vllm spec.k=3").peer == PeerNode("vllm", 3, "eagle", None)  # EAGLE-1
    assert parse_contender("engine=vllm spec.method=eagle spec.k=2").peer == PeerNode("vllm", 2, "eagle", None)
    assert parse_contender("engine=vllm spec.method=eagle3 spec.k=6").peer == PeerNode("vllm", 6, "eagle3", None)
    assert contender_label(None) == "vllm ar" and contender_label(3) == "vllm eagle k=3"
    assert contender_label(6, "eagle3") == "vllm eagle3 k=6"
    for bad, why in (("engine=sglang", "engine must be vllm"), ("engine=vllm spec.k=0", "integer >= 1"),
                     ("engine=vllm spec.k=x", "integer >= 1"), ("engine=vllm policy=static", "takes engine=vllm"),
                     ("engine=vllm spec.method=medusa spec.k=3", "spec.method must be one of eagle|eagle3"),
                     ("engine=vllm spec.method=eagle3", "spec.method needs spec.k")):
        with pytest.raises(ValueError, match=why):
            parse_contender(bad)


def _model_cfg(kind: str, drafter):
    from omegaconf import OmegaConf

    return OmegaConf.create({"drafter_kind": kind, "drafter": str(drafter), "target": str(EMBEDDED / "target")})


@pytest.mark.parametrize("spec,kind,why", [
    ("engine=vllm spec.method=eagle3 spec.k=3", "eagle", "vLLM's EAGLE-3 needs the pair's eagle3 drafter "
     r"\(model.drafter_kind=eagle3\), and model.drafter_kind is eagle \(model=embedded_eagle3"),
    ("engine=vllm spec.method=eagle3 spec.k=3", "draft_lm", "model.drafter_kind is draft_lm"),
    ("engine=vllm spec.k=3", "eagle3", r"vLLM's EAGLE needs .*drafter_kind is eagle3 \(spec.method=eagle3 for"),
])
def test_a_method_that_does_not_fit_the_drafter_is_refused_in_one_line(spec, kind, why):
    """Before any worker or weights: spec.method=eagle3 needs an EAGLE-3 pair, plain spec.k an EAGLE-1 one."""
    from ldlp.bench.peers.vllm_peer import make_contender

    with pytest.raises(ValueError, match=why) as e:
        make_contender(parse_contender(spec).peer, _model_cfg(kind, EMBEDDED / "drafter"), [[1, 2, 3]], 8,
                       {"python": "/nonexistent/python"}, "/nonexistent")
    assert "\n" not in str(e.value)


def test_the_shipped_eagle3_head_is_servable_as_it_is(tmp_path):
    """vLLM reads the shipped speculators folder unchanged: speculators' layout, no identity d2t (vLLM has
    nowhere to load it with a full draft vocabulary), a verifier path that names no machine; a folder that
    breaks either is refused in one line before vLLM starts."""
    import shutil

    from ldlp.bench.peers.vllm_peer import check_eagle3_head

    head = EMBEDDED / "eagle3"
    check_eagle3_head(head)
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "data/embedded/target"
    assert (REPO_ROOT / cfg["speculators_config"]["verifier"]["name_or_path"] / "config.json").exists()
    with pytest.raises(ValueError, match="not in speculators' layout"):
        check_eagle3_head(EMBEDDED / "drafter")
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(head, bad)
    w = load_file(str(bad / "model.safetensors"))
    w["d2t"] = torch.zeros(cfg["draft_vocab_size"], dtype=torch.long)
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="ships d2t with a full draft vocabulary"):
        check_eagle3_head(bad)


@needs_vllm
def test_vllm_ar_and_eagle_equal_the_targets_greedy_decoding(tmp_path):
    from eagle_backbone.loading import load_pair
    from eagle_backbone.paths import embedded_model_config
    from ldlp.bench.peers.vllm_peer import VllmRunner

    pair = load_pair(embedded_model_config(dtype="float32"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, pair.target.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 7)]
    ref = [pair.target.reference_greedy(p, 12) for p in prompts]
    for k in (None, 2):
        runner = VllmRunner(k, EMBEDDED / "target", EMBEDDED / "drafter", tmp_path / "drafters",
                            python=vllm_python(), max_model_len=64, log_dir=tmp_path)
        try:
            outs, summ = runner.run(prompts, 2, 12, [0, 1, 2], None, pair.target.eos_token_ids)
        finally:
            runner.close()
        assert outs == ref, (k, outs, ref)
        assert summ["new_tokens"] == sum(map(len, ref)) and summ["wall_s"] > 0
        assert summ["tau"] == 1.0 if k is None else summ["tau"] >= 1.0


@needs_vllm
def test_vllm_eagle3_serves_the_shipped_head_unchanged_and_equals_greedy(tmp_path):
    """vLLM's EAGLE-3 on the shipped speculators folder as it is (no conversion: the cache stays empty) gives
    the target's greedy decoding, and its counters count drafts of k tokens."""
    from eagle_backbone.loading import load_pair
    from eagle_backbone.paths import embedded_model_config
    from ldlp.bench.peers.vllm_peer import VllmRunner

    pair = load_pair(embedded_model_config(dtype="float32"))  # the same target as model=embedded_eagle3
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, pair.target.vocab_size, (n,), generator=g).tolist() for n in (6, 13, 9)]
    ref = [pair.target.reference_greedy(p, 16) for p in prompts]
    runner = VllmRunner(3, EMBEDDED / "target", EMBEDDED / "eagle3", tmp_path / "drafters", python=vllm_python(),
                        max_model_len=64, log_dir=tmp_path, method="eagle3")
    assert runner.base["drafter"] == str((EMBEDDED / "eagle3").resolve()) and not (tmp_path / "drafters").exists()
    try:
        outs, summ = runner.run(prompts, 2, 16, [0, 1, 2], None, pair.target.eos_token_ids)
    finally:
        runner.close()
    assert outs == ref, (outs, ref)
    assert summ["new_tokens"] == sum(map(len, ref)) and summ["tau"] >= 1.0
    assert summ["drafted_tokens"] == pytest.approx(3 * (summ["new_tokens"] / summ["tau"] - len(prompts)))
    assert (tmp_path / "vllm_worker_eagle3_k3.log").exists()


@needs_vllm
def test_vllm_serves_an_arrival_trace_open_loop_and_equals_greedy(tmp_path):
    """vLLM's runner on an arrival trace: requests added when their time comes (later ones queue behind 2 slots),
    the target's greedy outputs, and each request's latencies from its own arrival."""
    from eagle_backbone.loading import load_pair
    from eagle_backbone.paths import embedded_model_config
    from ldlp.bench.peers.vllm_peer import VllmRunner

    pair = load_pair(embedded_model_config(dtype="float32"))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, pair.target.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 7, 6)]
    ref = [pair.target.reference_greedy(p, 10) for p in prompts]
    arrivals = [0.0, 0.0, 0.0, 0.3]
    runner = VllmRunner(2, EMBEDDED / "target", EMBEDDED / "drafter", tmp_path / "drafters", python=vllm_python(),
                        max_model_len=64, log_dir=tmp_path)
    try:
        outs, summ = runner.serve(prompts, arrivals, 10, [0, 1, 2, 3], 2, None, pair.target.eos_token_ids)
    finally:
        runner.close()
    assert outs == ref, (outs, ref)
    assert summ["new_tokens"] == sum(map(len, ref)) and summ["tau"] >= 1.0 and summ["wall_s"] >= 0.3
    assert max(n for _, n, _ in summ["timeline"]) <= 2 and summ["ttft_ms_median"] > 0
    assert summ["steps"] == len(summ["timeline"])


class _FakePeer:
    """A peer runner without vLLM: the target's own greedy outputs (or one token changed), fixed seconds."""

    def __init__(self, target, k, wrong=False):
        self.target, self.k, self.wrong, self.calls = target, k, wrong, []

    def run(self, prompts, C, max_new_tokens, seeds, sampling=None, stop_ids=()):
        self.calls.append((len(prompts), C, max_new_tokens, sorted(stop_ids)))
        outs = [self.target.reference_greedy(p, max_new_tokens) for p in prompts]
        if self.wrong:
            outs[0] = [(outs[0][0] + 1) % self.target.vocab_size] + outs[0][1:]
        tok = sum(map(len, outs))
        tau = 1.0 if not self.k else 2.0
        return outs, {"new_tokens": tok, "wall_s": tok / (100.0 * C), "tokens_per_s": 100.0 * C, "cpu_s": tok / 90.0,
                      "tokens_per_cpu_s": 90.0, "tau": tau, "token_latency_ms_mean": 1.0, "token_latency_ms_p90": None,
                      "request_latency_ms_mean": 5.0, "request_latency_ms_p90": 6.0}


def test_peer_rows_in_the_sweep_and_on_the_page(t32, eagle32):
    from ldlp.bench.comparisons.load_aggregate import throughput_table
    from ldlp.bench.comparisons.load_sweep import Contender, sweep
    from ldlp.bench.comparisons.peer_rows import peer_table
    from ldlp.report.load_sweep import markdown
    from eagle_backbone.kinds.eagle import EagleCandidateGenerator
    from eagle_backbone.policy import StaticPolicy

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 64, (n,), generator=g).tolist() for n in (4, 7, 5, 9)]
    ar_peer, spec_peer = _FakePeer(t32, None), _FakePeer(t32, 2, wrong=True)
    cs = [Contender("ar", "ar", 0, None), Contender("static γ=2", "static", 2, lambda: StaticPolicy(2)),
          Contender("vllm ar", "vllm", 0, None, ar_peer), Contender("vllm eagle k=2", "vllm", 2, None, spec_peer)]
    result = sweep(t32, EagleCandidateGenerator(eagle32, t32), prompts, cs, [1, 2], 8, rounds=1, blocks=2,
                   log=lambda _: None)
    # the peer took the same blocks, budget and stop tokens, at every C
    assert sorted(c[1] for c in ar_peer.calls) == [1, 1, 2, 2]
    assert all(c[2] == 8 and c[3] == sorted(t32.eos_token_ids) for c in ar_peer.calls)
    rows = {(r["contender"], r["concurrency"]): r for r in result["rows"]}
    assert rows[("vllm ar", 2)]["lossless"] is True and rows[("vllm ar", 2)]["tokens_per_s"] == pytest.approx(200.0)
    assert rows[("vllm eagle k=2", 1)]["lossless"] is False  # checked against the target like every contender
    assert all(not rows[(p, C)].get("vs") for p in ("vllm ar", "vllm eagle k=2") for C in (1, 2))
    # the page's rows: the peers beside this engine's contenders, and per C the peer section's
    assert [r["contender"] for r in throughput_table(result["rows"], "tokens_per_s")["rows"]] == [c.label for c in cs]
    table = peer_table(result, result["rows"])
    assert [p["concurrency"] for p in table] == [1, 2]
    at2 = table[1]
    assert (at2["peer_ar"]["tokens_per_s"], at2["peer_ar"]["tau"]) == (pytest.approx(200.0), 1.0)
    assert at2["peer_best"]["gamma"] == 2 and at2["lossless"] is False
    assert at2["ar"]["contender"] == "ar" and at2["best_static"]["contender"] == "static γ=2"
    assert at2["ratio_ar"]["pairs"] == 2 and at2["ratio_speculative"]["pairs"] == 2
    # where the peer leaves the target: its EAGLE row's first token differs on each block's first prompt, and
    # its AR (identical) does not, so the EAGLE row does not leave where its own AR does
    d = at2["differences"]
    assert d["differing"] == 2 and d["as_ar"] is False and 0 <= d["near_ties"] <= 2
    assert markdown(result).startswith("# Batched speculative decoding")  # the page renders from these rows


def test_peer_differences_follow_the_peers_own_ar():
    """A peer whose EAGLE row leaves the target exactly where its own AR does (a near-tie its kernels round the
    other way) reads "as vLLM AR's"; a row that leaves elsewhere does not; no difference at C: None."""
    from ldlp.bench.comparisons.peer_rows import peer_differences

    ar, k2 = {"contender": "vllm ar"}, {"contender": "vllm eagle k=2"}
    first = {"concurrency": 4, "prompt": 3, "position": 7, "got_token": 11, "near_tie": True}
    diffs = [{**first, "contender": "vllm ar"}, {**first, "contender": "vllm eagle k=2"}]
    assert peer_differences(diffs, ar, [k2], 4) == {"differing": 2, "near_ties": 2, "as_ar": True}
    moved = diffs[:1] + [{**first, "contender": "vllm eagle k=2", "position": 9}]
    assert peer_differences(moved, ar, [k2], 4)["as_ar"] is False
    assert peer_differences(diffs, ar, [k2], 16) is None
    assert peer_differences(diffs, None, [k2], 4)["as_ar"] is None
