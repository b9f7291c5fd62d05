"""The target model: any Hugging Face causal LM, plus the feature EAGLE drafts from.

One forward returns next-token logits *and* the feature EAGLE uses: the decoder's last hidden state
after the final norm, i.e. exactly what the LM head sees. The KV cache is a transformers
``DynamicCache`` that :func:`rollback` shortens after rejected drafts.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn


def rollback(cache, length: int) -> None:
    """Shorten a transformers cache to its first ``length`` positions (drop rejected drafts)."""
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot roll a cache of {cache.get_seq_length()} positions forward to {length}")
    if extra == 0:
        return
    # transformers 5.x: crop(-n) removes n positions; earlier releases took the length to keep.
    if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
        cache.crop(-extra)
    else:
        cache.crop(length)


def new_cache(model: nn.Module):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def raise_if_unreadable(path: Path, error: Exception) -> None:
    """One line naming the weight file when ``error`` comes from a truncated or corrupt weight file."""
    from safetensors import SafetensorError

    if isinstance(error, SafetensorError) or "PytorchStreamReader" in str(error):
        files = [f.name for f in sorted(Path(path).glob("*.safetensors"))] or [f.name for f in Path(path).glob("*.bin")]
        name = Path(path) / files[0] if len(files) == 1 else f"{path}/{{{','.join(files)}}}"
        raise ValueError(f"{name}: truncated or corrupt weight file ({type(error).__name__}: {error}); copy, download "
                         "or train it again") from None


def wrong_shapes(path: Path, trust_remote_code: bool = False) -> list[str]:
    """The tensors of a folder's safetensors whose shapes differ from what its config.json builds (read from
    the files' headers and a model on the meta device: no weights are loaded)."""
    try:
        from safetensors import safe_open
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        out = []
        for f in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(f), "pt") as sf:
                for k in sf.keys():
                    shape = tuple(sf.get_slice(k).get_shape())
                    if k in expected and expected[k] != shape:
                        out.append(f"{k} {shape} (config implies {expected[k]})")
        return out or ["(see transformers' load report above)"]
    except Exception:  # the names are a courtesy: the refusal stands without them
        return ["(see transformers' load report above)"]


def check_loading_info(path: Path, info: dict, role: str = "target") -> None:
    """Refuse a transformers load whose report (``output_loading_info=True``) has missing, unexpected or
    mismatched keys: one line naming the folder and the keys."""
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    mismatched = [f"{k[0]} {tuple(k[1])} vs {tuple(k[2])}" if isinstance(k, tuple) and len(k) == 3 else str(k)
                  for k in sorted(info.get("mismatched_keys") or (), key=str)]
    errors = [str(e).replace("\n", " ") for e in info.get("error_msgs") or ()]
    if not (missing or unexpected or mismatched or errors):
        return
    parts = [f"missing keys {missing}" if missing else "", f"unexpected keys {unexpected}" if unexpected else "",
             f"wrong shapes {mismatched}" if mismatched else "", f"errors {errors}" if errors else ""]
    hint = (" (an EAGLE drafter folder? load it with model.drafter_kind=eagle)"
            if any(k.startswith("fc.") for k in unexpected) else "")
    raise ValueError(f"{role} {path}: the weights do not match {Path(path) / 'config.json'}: "
                     + "; ".join(p for p in parts if p) + hint + "; nothing was loaded with random weights")


class TargetModel(nn.Module):
    """A causal LM that returns ``(logits, feature)`` and knows its context length and special ids."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model.eval()
        cfg = model.config
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.embed_tokens = model.get_input_embeddings()
        self.hidden_size = cfg.hidden_size
        self.vocab_size = self.lm_head.weight.shape[0]
        self.max_length = getattr(cfg, "max_position_embeddings", None) or 2048
        eos = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
        eos = eos if eos is not None else cfg.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
                        trust_remote_code: bool = False, attn_implementation: str | None = "sdpa",
                        role: str = "target") -> "TargetModel":
        """Load a local Hugging Face folder (safetensors or ``pytorch_model.bin``, never remote code by default).

        Strict: a checkpoint with missing, unexpected or wrongly shaped weights is refused (transformers
        would initialise the missing ones at random and carry on); an output head tied to the input
        embedding (``tie_word_embeddings``) is not missing. ``role`` names the model in the errors."""
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").exists():
            raise ValueError(f"target folder {path} has no config.json (is the path right?)")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        try:
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                               attn_implementation=attn_implementation,
                                                               output_loading_info=True)
        except Exception as e:
            raise_if_unreadable(path, e)
            if "ignore_mismatched_sizes" in str(e):  # transformers refuses wrong shapes with a multi-line report
                raise ValueError(f"{role} {path}: the weights do not match {path / 'config.json'}: wrong shapes "
                                 f"{wrong_shapes(path, trust_remote_code)}") from None
            raise
        check_loading_info(path, info, role)
        return cls(model.to(device))

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self):
        return new_cache(self.model)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` (B, T) continuing ``cache`` -> logits (B, T, V) and features (B, T, d)."""
        out = self.decoder(input_ids=input_ids, cache=cache, use_cache=cache is not None)
        feature = out.last_hidden_state
        return self.lm_head(feature), feature

    @torch.no_grad()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids)

    @torch.no_grad()
    def reference_greedy(self, prompt_ids, max_new_tokens: int) -> list[int]:
        """The target's own greedy output through transformers' forward and cache, one token per forward,
        independent of the engine: what a lossless greedy run must equal token for token (EOS included
        when generated)."""
        ids = list(prompt_ids)
        cache, new = self.new_cache(), []
        inp = torch.tensor([ids], device=self.device)
        while len(new) < max_new_tokens and len(ids) + len(new) <= self.max_length:
            logits, _ = self(inp, cache)
            new.append(int(logits[0, -1].argmax()))
            if new[-1] in self.eos_token_ids:
                break
            inp = torch.tensor([[new[-1]]], device=self.device)
        return new
