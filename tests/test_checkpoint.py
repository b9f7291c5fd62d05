"""Checkpoints: EAGLE's published layout loads unchanged, our own saves round-trip, and every loader (target,
drafter, draft LM, LDLP, acceptance head) refuses missing, unexpected, misshapen or truncated weights in one line
that names the file."""

import json
from pathlib import Path

import pytest
import torch
from conftest import make_target, one_line, tiny_llama_config
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.drafter import EagleDrafter
from eagle_backbone.decoder import SpeculativeDecoder
from eagle_backbone.loading import tie_drafter_embedding
from eagle_backbone.paths import REPO_ROOT
from eagle_backbone.policy import StaticPolicy

EMBEDDED = REPO_ROOT / "data" / "embedded"

EAGLE_KEYS = ["embed_tokens.weight", "fc.weight", "fc.bias"] + [
    f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"] + [
    f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")] + ["layers.0.post_attention_layernorm.weight"]


@pytest.mark.parametrize("safe", [True, False])
def test_round_trip(tmp_path, target, drafter, safe):
    drafter.save_pretrained(tmp_path, safe_serialization=safe)
    assert (tmp_path / ("model.safetensors" if safe else "pytorch_model.bin")).exists()
    loaded = EagleDrafter.from_pretrained(tmp_path, dtype=torch.float64)
    for (k, a), (k2, b) in zip(sorted(drafter.state_dict().items()), sorted(loaded.state_dict().items())):
        assert k == k2 and torch.equal(a, b)
    prompt = [3, 9, 27]
    out = [SpeculativeDecoder(target, EagleCandidateGenerator(d, target), StaticPolicy(3)).generate(prompt, 12).tokens
           for d in (drafter, loaded)]
    assert out[0] == out[1]


def test_saved_keys_are_eagles(tmp_path, drafter):
    drafter.save_pretrained(tmp_path, safe_serialization=False)
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert sorted(state) == sorted(EAGLE_KEYS)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["bias"] is True


def _write_eagle_style(path, d=32, vocab=64, inter=64, bias=True, with_embedding=True):
    """A checkpoint written the way EAGLE's release is: a plain Llama config.json and a .bin of tensors."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d, "intermediate_size": inter,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": vocab,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "hidden_act": "silu", "bias": bias,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float16",
           "transformers_version": "4.28.1"}
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    shapes = {"embed_tokens.weight": (vocab, d), "fc.weight": (d, 2 * d), "fc.bias": (d,),
              "layers.0.self_attn.q_proj.weight": (d, d), "layers.0.self_attn.k_proj.weight": (d // 2, d),
              "layers.0.self_attn.v_proj.weight": (d // 2, d), "layers.0.self_attn.o_proj.weight": (d, d),
              "layers.0.mlp.gate_proj.weight": (inter, d), "layers.0.mlp.up_proj.weight": (inter, d),
              "layers.0.mlp.down_proj.weight": (d, inter), "layers.0.post_attention_layernorm.weight": (d,)}
    state = {k: torch.randn(s, generator=g).half() for k, s in shapes.items()
             if (bias or k != "fc.bias") and (with_embedding or k != "embed_tokens.weight")}
    torch.save(state, path / "pytorch_model.bin")
    return state


def test_eagle_release_layout_loads(tmp_path):
    state = _write_eagle_style(tmp_path)
    drafter = EagleDrafter.from_pretrained(tmp_path)
    assert torch.equal(drafter.fc.weight, state["fc.weight"].float())
    assert torch.equal(drafter.layers[0].post_attention_layernorm.weight,
                       state["layers.0.post_attention_layernorm.weight"].float())
    assert isinstance(drafter.layers[0].input_layernorm, torch.nn.Identity)


def test_checkpoint_without_bias_or_embedding(tmp_path):
    _write_eagle_style(tmp_path, bias=False, with_embedding=False)
    drafter = EagleDrafter.from_pretrained(tmp_path, dtype=torch.float64)
    assert drafter.fc.bias is None
    target = make_target()
    with pytest.raises(ValueError, match="tie_drafter_embedding"):  # the constructor checks, never ties
        EagleCandidateGenerator(drafter, target)
    assert tie_drafter_embedding(drafter, target)
    EagleCandidateGenerator(drafter, target)
    assert drafter.embed_tokens is target.embed_tokens


def test_bad_checkpoints_are_named(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        EagleDrafter.from_pretrained(tmp_path)
    _write_eagle_style(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match="neither of"):
        EagleDrafter.from_pretrained(tmp_path)
    torch.save({"fc.weight": torch.zeros(3, 3), "extra.weight": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="does not match an EAGLE-1 drafter"):
        EagleDrafter.from_pretrained(tmp_path)
    torch.save({"fc": object()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="not a plain tensor state dict"):
        EagleDrafter.from_pretrained(tmp_path)


# -- every loader refuses missing, unexpected, misshapen or truncated weights, in one line naming the file


def test_eagle_drafter_folder_loaded_as_draft_lm_fails_in_one_line():
    from eagle_backbone.loading import load_drafter

    with pytest.raises(ValueError) as e:
        load_drafter("draft_lm", EMBEDDED / "drafter")
    msg = one_line(e)
    assert str(EMBEDDED / "drafter") in msg
    assert "lm_head.weight" in msg and "model.norm.weight" in msg and "fc.weight" in msg
    assert "drafter_kind=eagle" in msg


def _save_llama(path: Path, tie: bool = False, drop: str | None = None, add: str | None = None) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tied_config() if tie else tiny_llama_config())
    model.save_pretrained(path)
    if drop or add:
        state = load_file(str(path / "model.safetensors"))
        if drop:
            del state[drop]
        if add:
            state[add] = torch.zeros(3)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _tied_config():
    cfg = tiny_llama_config()
    cfg.tie_word_embeddings = True
    return cfg


def test_target_with_missing_or_unexpected_weights_is_refused(tmp_path):
    from eagle_backbone.target import TargetModel

    with pytest.raises(ValueError) as e:
        TargetModel.from_pretrained(_save_llama(tmp_path / "missing", drop="model.norm.weight"))
    assert "model.norm.weight" in one_line(e) and "missing" in str(e.value)
    with pytest.raises(ValueError) as e:
        TargetModel.from_pretrained(_save_llama(tmp_path / "extra", add="extra.weight"))
    assert "extra.weight" in one_line(e) and "unexpected" in str(e.value)
    path = _save_llama(tmp_path / "shape")
    state = load_file(str(path / "model.safetensors"))
    state["model.norm.weight"] = torch.ones(5)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        TargetModel.from_pretrained(path)
    assert "model.norm.weight (5,) (config implies (32,))" in one_line(e) and str(path) in str(e.value)
    # a tied output head is not missing: it is the embedding
    tied = TargetModel.from_pretrained(_save_llama(tmp_path / "tied", tie=True))
    assert tied.lm_head.weight.data_ptr() == tied.embed_tokens.weight.data_ptr()


def test_drafter_without_embedding_is_the_one_documented_exception(tmp_path, target, drafter):
    from eagle_backbone.drafter import EagleDrafter
    from eagle_backbone.loading import tie_drafter_embedding

    drafter.save_pretrained(tmp_path / "d")
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    del state["embed_tokens.weight"]
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    loaded = EagleDrafter.from_pretrained(tmp_path / "d", dtype=torch.float64)
    assert loaded.has_own_embedding is False
    assert tie_drafter_embedding(loaded, target)
    assert torch.equal(loaded.embed_tokens.weight, target.embed_tokens.weight)
    del state["fc.weight"]  # any other key missing is refused
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        EagleDrafter.from_pretrained(tmp_path / "d")


def test_heads_with_missing_or_unexpected_keys_are_refused(tmp_path):
    from ldlp.models.acceptance import AcceptanceHead, AcceptanceHeadConfig
    from ldlp.models.predictor import LDLP, LDLPConfig

    LDLP(LDLPConfig(input_dim=8)).save_pretrained(tmp_path / "ldlp")
    AcceptanceHead(AcceptanceHeadConfig(hidden_size=4, k_max=8)).save_pretrained(tmp_path / "acc")
    for folder, cls in ((tmp_path / "ldlp", LDLP), (tmp_path / "acc", AcceptanceHead)):
        state = load_file(str(folder / "model.safetensors"))
        state["stray.weight"] = torch.zeros(2)
        state.pop(sorted(state)[0])
        save_file(state, str(folder / "model.safetensors"))
        with pytest.raises(ValueError) as e:
            cls.from_pretrained(folder)
        msg = one_line(e)
        assert str(folder / "model.safetensors") in msg and "stray.weight" in msg and "missing keys" in msg


def _truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("kind", ["target", "drafter", "draft_lm", "ldlp", "acceptance"])
def test_truncated_weights_name_the_file(tmp_path, kind, drafter):
    from eagle_backbone.drafter import EagleDrafter
    from eagle_backbone.loading import load_drafter
    from eagle_backbone.target import TargetModel
    from ldlp.models.acceptance import AcceptanceHead, AcceptanceHeadConfig
    from ldlp.models.predictor import LDLP, LDLPConfig

    folder = tmp_path / kind
    if kind in ("target", "draft_lm"):
        _save_llama(folder)
        load = (lambda: TargetModel.from_pretrained(folder)) if kind == "target" else (
            lambda: load_drafter("draft_lm", folder))
    elif kind == "drafter":
        drafter.save_pretrained(folder)
        load = lambda: EagleDrafter.from_pretrained(folder)  # noqa: E731
    elif kind == "ldlp":
        LDLP(LDLPConfig(input_dim=8)).save_pretrained(folder)
        load = lambda: LDLP.from_pretrained(folder)  # noqa: E731
    else:
        AcceptanceHead(AcceptanceHeadConfig(hidden_size=4, k_max=8)).save_pretrained(folder)
        load = lambda: AcceptanceHead.from_pretrained(folder)  # noqa: E731
    _truncate(folder / "model.safetensors")
    with pytest.raises(ValueError) as e:
        load()
    msg = one_line(e)
    assert str(folder / "model.safetensors") in msg and "truncated or corrupt" in msg
