"""EAGLE's published checkpoint layout loads unchanged, and our own saves round-trip."""

import json

import pytest
import torch
from conftest import make_target

from eagle_backbone.candidates import EagleCandidateGenerator
from eagle_backbone.drafter import EagleDrafter
from eagle_backbone.engine import SpeculativeDecoder
from eagle_backbone.loading import tie_drafter_embedding
from eagle_backbone.policy import StaticPolicy

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
