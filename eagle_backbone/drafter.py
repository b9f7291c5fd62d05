"""The EAGLE-1 drafter: autoregression at the feature level.

At position j it reads the pair (token t_{j+1}, target feature f_j) and predicts f_{j+1}:

    h = fc(concat(embed(t_{j+1}), f_j))          # Linear(2d -> d), bias optional
    f̂_{j+1} = LlamaDecoderLayer(h)                # without input_layernorm, and no final norm

and the target's own LM head turns f̂_{j+1} into a distribution over t_{j+2}. The embedding and LM
head are the target's (frozen); the drafter has its own KV cache.

Checkpoints use EAGLE's published layout, so a released EAGLE-Vicuna-7B-v1.3 loads unchanged:
``config.json`` (a Llama config with ``num_hidden_layers: 1`` and optional ``bias``) and
``pytorch_model.bin`` or ``model.safetensors`` with the keys ``embed_tokens.weight``, ``fc.weight``,
``fc.bias``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``
and ``layers.0.post_attention_layernorm.weight``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from eagle_backbone.io import atomic_path, atomic_write_json

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def causal_mask(q_len: int, past_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive (1, 1, q, past+q) mask: query i sees keys 0..past+i. Works for eager and sdpa alike."""
    k = torch.arange(past_len + q_len, device=device)
    q = torch.arange(q_len, device=device)[:, None] + past_len
    mask = torch.zeros(q_len, past_len + q_len, dtype=dtype, device=device)
    return mask.masked_fill(k[None, :] > q, torch.finfo(dtype).min)[None, None]


class EagleDrafter(nn.Module):
    has_own_embedding = True  # False when loaded from a checkpoint without one (tie the target's, loading.py)

    def __init__(self, config):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        if not isinstance(config, LlamaConfig):
            config = LlamaConfig(**config)
        if getattr(config, "_attn_implementation", None) is None:
            config._attn_implementation = "sdpa"
        self.config = config
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d, getattr(config, "pad_token_id", None))
        self.embed_tokens.weight.requires_grad_(False)  # shared with the target, never trained
        self.fc = nn.Linear(2 * d, d, bias=bool(getattr(config, "bias", True)))
        layer = LlamaDecoderLayer(config, layer_idx=0)
        layer.input_layernorm = nn.Identity()  # EAGLE drops it: fc's output is not a residual stream yet
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = LlamaRotaryEmbedding(config=config)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, cache=None,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) tokens t_{j+1} and (B, T, d) features f_j -> (B, T, d) predicted features f̂_{j+1}.

        With ``cache`` the call continues it; ``attention_mask`` (additive, (B, 1, T, past+T)) overrides
        the causal default, which the oracle collector uses to draft from every position at once.
        """
        past = cache.get_seq_length() if cache is not None else 0
        T = input_ids.shape[1]
        h = self.fc(torch.cat([self.embed_tokens(input_ids).to(features.dtype), features], dim=-1))
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=h.device)[None].expand(h.shape[0], T)
        if attention_mask is None:
            attention_mask = causal_mask(T, past, h.dtype, h.device)
        pos_emb = self.rotary_emb(h, position_ids=position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                      use_cache=cache is not None, position_embeddings=pos_emb)
        return h

    # ---- EAGLE checkpoint format -------------------------------------------------------------
    @classmethod
    def from_target_config(cls, target_config, bias: bool = True) -> "EagleDrafter":
        """A fresh drafter shaped like ``target_config`` (one layer), for training."""
        cfg = target_config.to_dict()
        cfg.update(num_hidden_layers=1, bias=bias, architectures=["LlamaForCausalLM"], model_type="llama")
        for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
            cfg.pop(key, None)
        from transformers import LlamaConfig

        return cls(LlamaConfig(**cfg))

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu") -> "EagleDrafter":
        """Load an EAGLE checkpoint folder (``config.json`` + safetensors or a weights-only ``.bin``)."""
        from transformers import LlamaConfig

        path = Path(path)
        if not (path / "config.json").exists():
            raise ValueError(f"drafter folder {path} has no config.json")
        raw = json.loads((path / "config.json").read_text())
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{path / 'config.json'}: num_hidden_layers is {raw['num_hidden_layers']}; "
                             "an EAGLE-1 drafter has exactly one decoder layer")
        cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version")})
        cfg.bias = raw.get("bias", True)
        state = load_state_dict(path)
        cfg.bias = "fc.bias" in state
        model = cls(cfg)
        expected = model.state_dict()
        missing = [k for k in expected if k not in state and k != "embed_tokens.weight"]  # embedding may be tied later
        unexpected = [k for k in state if k not in expected]
        wrong = [f"{k} {tuple(state[k].shape)} (config says {tuple(expected[k].shape)})"
                 for k in state if k in expected and state[k].shape != expected[k].shape]
        if missing or unexpected or wrong:
            raise ValueError(f"{path}: checkpoint does not match an EAGLE-1 drafter for {path / 'config.json'}; "
                             f"missing keys {missing}, unexpected keys {unexpected}, wrong shapes {wrong}")
        model.load_state_dict(state, strict=False)
        model.has_own_embedding = "embed_tokens.weight" in state
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return model.to(device=device, dtype=dtype).eval()

    def save_pretrained(self, path: str | Path, safe_serialization: bool = True, dtype: torch.dtype | None = None) -> None:
        """Write EAGLE's layout: ``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``)."""
        path = Path(path)
        cfg = self.config.to_dict()
        cfg.update(num_hidden_layers=1, bias=self.fc.bias is not None, architectures=["LlamaForCausalLM"])
        for key in ("_attn_implementation_autoset", "dtype", "torch_dtype"):
            cfg.pop(key, None)
        atomic_write_json(path / "config.json", cfg, newline=False, sort_keys=True)
        state = {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in self.state_dict().items()
                 if not k.startswith("rotary_emb.")}
        write_weights(path, state, safe_serialization)

    def tie_embedding(self, embedding: nn.Embedding) -> None:
        """Use the target's embedding (for checkpoints that do not ship ``embed_tokens.weight``)."""
        self.embed_tokens = checked_embedding(embedding, self.embed_tokens)


def checked_embedding(embedding: nn.Embedding, own: nn.Embedding) -> nn.Embedding:
    """The target's ``embedding``, refused in one line where its shape is not the drafter's ``own``."""
    if embedding.weight.shape != own.weight.shape:
        raise ValueError(f"target embedding {tuple(embedding.weight.shape)} does not match the drafter's "
                         f"{tuple(own.weight.shape)}")
    return embedding


def write_weights(path: Path, state: dict, safe_serialization: bool = True) -> None:
    """``state`` as ``model.safetensors`` (default) or ``pytorch_model.bin`` in ``path``, atomically."""
    if safe_serialization:
        from safetensors.torch import save_file

        with atomic_path(path / "model.safetensors") as tmp:
            save_file(state, str(tmp), metadata={"format": "pt"})
    else:
        with atomic_path(path / "pytorch_model.bin") as tmp:
            torch.save(state, tmp)


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Weights from ``model.safetensors`` or ``pytorch_model.bin`` (``weights_only``: no arbitrary unpickling)."""
    for name in WEIGHT_FILES:
        f = path / name
        if f.exists():
            if name.endswith(".safetensors"):
                from safetensors import SafetensorError
                from safetensors.torch import load_file

                try:
                    return load_file(str(f))
                except SafetensorError as e:
                    raise ValueError(f"{f}: truncated or corrupt weight file ({e}); copy, download or train it "
                                     "again") from None
            try:
                return torch.load(f, map_location="cpu", weights_only=True)
            except Exception as e:  # pickle with objects other than tensors
                raise ValueError(f"{f}: not a plain tensor state dict ({type(e).__name__}: {e})") from None
    raise ValueError(f"{path} has neither of {WEIGHT_FILES}")
