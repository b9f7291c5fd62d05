"""The EAGLE-3 drafter (arXiv 2503.01840): a fused low, middle and high target layer, and token prediction.

At position j it reads the token t_{j+1} and a feature g_j, and gives a state s_j and a draft distribution:

    g_j = fc(concat(a_j^(l1), a_j^(l2), a_j^(l3)))   # the target's states entering layers l1 < l2 < l3: Linear(3d -> d)
    x   = concat(input_layernorm(embed(t_{j+1})), hidden_norm(g_j))      # 2d: q, k and v read both halves
    s_j = g_j + o_proj(attention(x));  s_j = s_j + mlp(post_attention_layernorm(s_j))     # one decoder layer
    q(t_{j+2}) = softmax(lm_head(norm(s_j)))         # over the draft vocabulary, mapped to the target's by d2t

From the second draft on the drafter feeds its own state s (pre-norm) as g: no fc. ``norm_before_residual``
(speculators) takes the residual from hidden_norm(g) instead of g. The layers default to EAGLE-3's choice
for an L-layer target, (2, L // 2, L - 3), counted as Hugging Face's ``output_hidden_states`` counts them
(i: the state entering decoder layer i; 0 is the embedding), as vLLM and speculators do.

The draft vocabulary: ``lm_head`` scores ``draft_vocab_size`` tokens, draft token i being target token
``i + d2t[i]``; ``t2d`` marks the target tokens it covers. The full target vocabulary is the default (d2t
all zero). :meth:`full_logits` maps draft logits onto the target's vocabulary (the rest at -inf, so q is
zero there and speculative sampling stays exact).

Checkpoints, both read and written unchanged (:meth:`from_pretrained`, :meth:`save_pretrained`):

* **EAGLE** (SafeAILab's releases): ``config.json`` a Llama config (one layer, ``draft_vocab_size``) and
  ``model.safetensors`` or ``pytorch_model.bin`` with ``fc.weight``, ``midlayer.{hidden_norm,input_layernorm,
  post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
  ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``
  (no embedding: the target's is tied; ``d2t`` and ``t2d`` may be absent for the full vocabulary, and are
  not written then: vLLM refuses them);
* **speculators** (vLLM's): ``config.json`` with ``speculators_model_type: eagle3``, ``speculators_config``,
  ``transformer_layer_config``, ``draft_vocab_size``, ``norm_before_residual``,
  ``eagle_aux_hidden_state_layer_ids``; the same weights with ``layers.0.`` for ``midlayer.`` and
  ``embed_tokens.weight``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from eagle_backbone.drafter import checked_embedding, load_state_dict, write_weights
from eagle_backbone.io import atomic_write_json
from eagle_backbone.llama import rotate

SPECULATORS_VERSION = "0.9.0"  # the schema written (speculators' Eagle3SpeculatorConfig)
_UNSUPPORTED = ("norm_before_fc", "fc_norm", "norm_output")  # speculators variants this drafter does not run
_DROP = ("architectures", "transformers_version", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
         "norm_before_residual", "_name_or_path", "dtype", "torch_dtype", "auto_map")


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layer of an ``num_layers``-layer target (vLLM's and speculators' default)."""
    return (2, num_layers // 2, num_layers - 3)


def portable_verifier(verifier: str | Path | None) -> str | None:
    """speculators' ``verifier.name_or_path`` for the target ``verifier``: a path inside this repository
    relative to its root (``data/embedded/target``: ``vllm serve data/embedded/eagle3`` run from the root
    finds it), anything else (a hub id, a folder elsewhere) as given."""
    if verifier is None:
        return None
    from eagle_backbone.paths import REPO_ROOT

    p = Path(verifier)
    if p.is_absolute():
        try:
            return p.resolve().relative_to(REPO_ROOT).as_posix()
        except ValueError:
            return str(verifier)
    return str(verifier)


class Eagle3Drafter(nn.Module):
    has_own_embedding = True  # False when the checkpoint ships no embedding (tie the target's: loading.py)

    def __init__(self, config, draft_vocab_size: int | None = None, layer_ids=None, norm_before_residual: bool = False,
                 fc_bias: bool = False, num_features: int = 3):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        if not isinstance(config, LlamaConfig):
            config = LlamaConfig(**config)
        config.num_hidden_layers = 1
        if getattr(config, "_attn_implementation", None) is None:
            config._attn_implementation = "sdpa"
        self.config = config
        d, V = config.hidden_size, config.vocab_size
        self.draft_vocab_size = int(draft_vocab_size or V)
        self.layer_ids = tuple(int(i) for i in layer_ids) if layer_ids else None  # None: default_layer_ids(L)
        if self.layer_ids is not None:
            num_features = len(self.layer_ids)
        self.norm_before_residual = bool(norm_before_residual)
        self.embed_tokens = nn.Embedding(V, d, getattr(config, "pad_token_id", None))
        self.embed_tokens.weight.requires_grad_(False)  # the target's, never trained
        self.fc = nn.Linear(num_features * d, d, bias=fc_bias)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        attn, hd = layer.self_attn, layer.self_attn.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        attn.q_proj = nn.Linear(2 * d, config.num_attention_heads * hd, bias=bias)  # q, k, v read [embedding, feature]
        attn.k_proj = nn.Linear(2 * d, config.num_key_value_heads * hd, bias=bias)
        attn.v_proj = nn.Linear(2 * d, config.num_key_value_heads * hd, bias=bias)
        layer.hidden_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.midlayer = layer
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(V, dtype=torch.bool) if self.draft_vocab_size == V
                             else torch.zeros(V, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(config=config)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_features(self) -> int:
        return self.fc.in_features // self.hidden_size

    def aux_layers(self, num_layers: int) -> tuple[int, ...]:
        """The target layers whose entering states this drafter fuses, for an ``num_layers``-layer target."""
        ids = self.layer_ids or default_layer_ids(num_layers)
        if len(ids) != self.num_features or len(set(ids)) != len(ids) or not all(0 <= i < num_layers for i in ids):
            raise ValueError(f"EAGLE-3 layer ids {list(ids)} do not fit a {num_layers}-layer target and an fc of "
                             f"{self.num_features} features (distinct ids in 0..{num_layers - 1})")
        return tuple(ids)

    # ---- the layer's math, shared by training (eagle_backbone/train/eagle3.py) and the engine -----------------
    def mix(self, emb: torch.Tensor, g: torch.Tensor, norm=None):
        """The attention's input concat(input_layernorm(emb), hidden_norm(g)) (…, 2d) and the residual (…, d).
        ``norm(module, x)``: how a norm runs (the engine's fused ``rms_norm``, the same bits); default the module."""
        layer = self.midlayer
        norm = norm or (lambda module, x: module(x))
        gn = norm(layer.hidden_norm, g)
        return torch.cat([norm(layer.input_layernorm, emb), gn], -1), (gn if self.norm_before_residual else g)

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The state after attention's output ``attn_out`` (…, heads·head_dim): o_proj, residual, MLP block."""
        layer = self.midlayer
        x = residual + layer.self_attn.o_proj(attn_out)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def draft_logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(state))

    def full_logits(self, state: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: draft token i at ``i + d2t[i]``, uncovered tokens at -inf."""
        dl = self.draft_logits(state)
        if self.draft_vocab_size == self.vocab_size and not bool(self.d2t.any()):
            return dl
        out = dl.new_full((*dl.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_to_target(), dl)

    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """Restrict the draft vocabulary to the sorted target ids ``draft_ids`` (EAGLE-3: the most frequent)."""
        ids = torch.as_tensor(draft_ids, dtype=torch.long).sort().values
        if ids.numel() != self.draft_vocab_size:
            raise ValueError(f"{ids.numel()} draft ids for a draft vocabulary of {self.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()[ids] = True

    # ---- construction and checkpoints ---------------------------------------------------------------------
    @classmethod
    def from_target_config(cls, target_config, draft_vocab_size: int | None = None, layer_ids=None,
                           norm_before_residual: bool = False) -> Eagle3Drafter:
        """A fresh drafter shaped like ``target_config``'s layers, for training."""
        from transformers import LlamaConfig

        cfg = {k: v for k, v in target_config.to_dict().items() if k not in _DROP}
        cfg.update(num_hidden_layers=1, model_type="llama")
        return cls(LlamaConfig(**cfg), draft_vocab_size, layer_ids or default_layer_ids(target_config.num_hidden_layers),
                   norm_before_residual)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu") -> Eagle3Drafter:
        """Load an EAGLE-3 head in EAGLE's or speculators' layout (told apart by ``speculators_model_type``)."""
        from transformers import LlamaConfig

        path = Path(path)
        if not (path / "config.json").exists():
            raise ValueError(f"EAGLE-3 drafter folder {path} has no config.json")
        raw = json.loads((path / "config.json").read_text())
        speculators = "speculators_model_type" in raw
        if speculators:
            if raw["speculators_model_type"] != "eagle3":
                raise ValueError(f"{path / 'config.json'}: speculators_model_type is {raw['speculators_model_type']!r}, "
                                 "not 'eagle3'")
            on = [k for k in _UNSUPPORTED if raw.get(k)]
            if on:
                raise ValueError(f"{path / 'config.json'}: {', '.join(on)} set; this EAGLE-3 drafter runs the plain "
                                 "EAGLE-3 layer only")
            layer_cfg = dict(raw.get("transformer_layer_config") or {})
            if layer_cfg.get("model_type", "llama") != "llama":
                raise ValueError(f"{path / 'config.json'}: transformer_layer_config.model_type is "
                                 f"{layer_cfg['model_type']!r}; only llama layers run here")
        else:
            layer_cfg = raw
        if layer_cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{path / 'config.json'}: num_hidden_layers is {layer_cfg['num_hidden_layers']}; an "
                             "EAGLE-3 drafter here has exactly one decoder layer")
        try:  # transformers validates the layer's fields (e.g. heads dividing hidden_size): one line, the file named
            cfg = LlamaConfig(**{k: v for k, v in layer_cfg.items() if k not in _DROP})
        except Exception as e:  # noqa: BLE001 (huggingface_hub's StrictDataclassClassValidationError is no ValueError)
            why = [line.strip() for line in str(e).splitlines() if line.strip()][-1].removeprefix("ValueError: ")
            raise ValueError(f"{path / 'config.json'}: not a Llama layer config: {why}") from None
        state = load_state_dict(path)
        if speculators:
            state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
        V = cfg.vocab_size
        draft_vocab = int(raw.get("draft_vocab_size") or V)
        fc = state.get("fc.weight")
        model = cls(cfg, draft_vocab, raw.get("eagle_aux_hidden_state_layer_ids"), raw.get("norm_before_residual", False),
                    fc_bias="fc.bias" in state,
                    num_features=fc.shape[1] // cfg.hidden_size if fc is not None and fc.dim() == 2 else 3)
        expected = {k: v for k, v in model.state_dict().items() if not k.startswith("rotary_emb.")}
        optional = {"embed_tokens.weight"} | ({"d2t", "t2d"} if draft_vocab == V else set())  # tied / identity
        missing = [k for k in expected if k not in state and k not in optional]
        unexpected = [k for k in state if k not in expected]
        wrong = [f"{k} {tuple(state[k].shape)} (config says {tuple(expected[k].shape)})"
                 for k in state if k in expected and state[k].shape != expected[k].shape]
        if missing or unexpected or wrong:
            layout = "speculators" if speculators else "EAGLE"
            raise ValueError(f"{path}: checkpoint does not match an EAGLE-3 drafter ({layout} layout) for "
                             f"{path / 'config.json'}; missing keys {missing}, unexpected keys {unexpected}, "
                             f"wrong shapes {wrong}")
        if "d2t" in state:  # draft token i is target token i + d2t[i]: a map past the vocabulary fails only mid-decode
            targets = torch.arange(draft_vocab) + state["d2t"].long()
            bad = ((targets < 0) | (targets >= V)).nonzero()
            if len(bad):
                i = int(bad[0])
                raise ValueError(f"{path}: d2t maps draft token {i} to target token {int(targets[i])}, outside the "
                                 f"vocabulary 0..{V - 1} (vocab_size of {path / 'config.json'})")
            if targets.unique().numel() != draft_vocab:
                raise ValueError(f"{path}: d2t maps two draft tokens to one target token; each draft token needs "
                                 "its own")
        if "t2d" in state:
            state["t2d"] = state["t2d"].bool()
        model.load_state_dict(state, strict=False)
        model.has_own_embedding = "embed_tokens.weight" in state
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return model.to(device=device, dtype=dtype).eval()

    def save_pretrained(self, path: str | Path, layout: str = "speculators", dtype: torch.dtype | None = None,
                        verifier: str | None = None, speculative_tokens: int = 6, safe_serialization: bool = True) -> None:
        """Write the head in ``layout`` speculators (vLLM serves it as is) or eagle (SafeAILab's).

        ``verifier``: the target, written as speculators' ``verifier.name_or_path`` (what ``vllm serve <head>``
        loads as the target); a path inside this repository is written relative to its root
        (:func:`portable_verifier`), so the folder does not name the machine it was trained on. A head over
        the full target vocabulary (identity map) is written without ``d2t`` and ``t2d``: vLLM's EAGLE-3 model
        has no map parameter then and refuses a checkpoint that ships one; both loaders take it as identity."""
        if layout not in ("speculators", "eagle"):
            raise ValueError(f"layout must be 'speculators' or 'eagle', got {layout!r}")
        path = Path(path)
        layer = {k: v for k, v in self.config.to_dict().items()
                 if k not in _DROP and k not in ("_attn_implementation_autoset",)}
        layer.update(num_hidden_layers=1, model_type="llama", tie_word_embeddings=False)
        state = {k: v.detach().to(dtype or v.dtype) if v.is_floating_point() else v.detach()
                 for k, v in self.state_dict().items() if not k.startswith("rotary_emb.")}
        if self.draft_vocab_size == self.vocab_size and not bool(self.d2t.any()):
            state.pop("d2t")
            state.pop("t2d")
        if layout == "eagle":
            cfg = dict(layer, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=self.draft_vocab_size)
            if self.layer_ids:
                cfg["eagle_aux_hidden_state_layer_ids"] = list(self.layer_ids)
            state.pop("embed_tokens.weight")  # EAGLE's releases tie the target's embedding
        else:
            layer["architectures"] = ["LlamaForCausalLM"]
            cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                   "speculators_version": SPECULATORS_VERSION,
                   "speculators_config": {
                       "algorithm": "eagle3", "default_proposal_method": "greedy",
                       "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                             "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                       "verifier": {"name_or_path": portable_verifier(verifier),
                                    "architectures": ["LlamaForCausalLM"]}},
                   "transformer_layer_config": layer, "draft_vocab_size": self.draft_vocab_size,
                   "norm_before_residual": self.norm_before_residual, "target_hidden_size": None,
                   "eagle_aux_hidden_state_layer_ids": list(self.layer_ids) if self.layer_ids else None,
                   "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
                   "has_no_defaults_at_init": False}
            state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in state.items()}
        state = {k: v.contiguous() for k, v in state.items()}
        atomic_write_json(path / "config.json", cfg, newline=False, sort_keys=True)
        write_weights(path, state, safe_serialization)

    def tie_embedding(self, embedding: nn.Embedding) -> None:
        """Use the target's embedding (checkpoints without ``embed_tokens.weight``)."""
        self.embed_tokens = checked_embedding(embedding, self.embed_tokens)


class BatchedEagle3Drafter:
    """An :class:`Eagle3Drafter` run on a :class:`~eagle_backbone.ragged.SlotCache` over ragged batches (one
    layer), as :class:`~eagle_backbone.llama.BatchedEagleDrafter` runs EAGLE-1's."""

    def __init__(self, drafter: Eagle3Drafter, capacity: int, attn: str = "eager", linear: str = "auto"):
        from eagle_backbone.linear import Projection
        from eagle_backbone.llama import DecoderLayer, RotaryTable

        if attn not in ("eager", "sdpa"):
            raise ValueError(f"attn must be 'eager' or 'sdpa', got {attn!r}")
        self.drafter, self.attn, self.capacity = drafter, attn, capacity
        # the layer's projections (q, k, v read the 2d-wide input) and fc as the engine runs linears
        self.layer, self.fc = DecoderLayer(drafter.midlayer, linear), Projection(drafter.fc, linear)
        # the LM head as the engine runs linears (F.linear on one bfloat16 row cost twice the packed matmul), and
        # the draft-to-target map read once: a full vocabulary's logits are the head's own
        self.head = Projection(drafter.lm_head, linear)
        self.identity_vocab = drafter.draft_vocab_size == drafter.vocab_size and not bool(drafter.d2t.any())
        self.draft_ids = None if self.identity_vocab else drafter.draft_to_target()
        w = drafter.fc.weight
        self.dtype, self.device = w.dtype, w.device
        self.rope = RotaryTable(drafter.rotary_emb, capacity, self.dtype, self.device)
        a = drafter.midlayer.self_attn
        self.kv_heads, self.head_dim = a.k_proj.weight.shape[0] // a.head_dim, a.head_dim

    def new_cache(self, slots: int):
        from eagle_backbone.ragged import SlotCache

        return SlotCache(1, slots, self.capacity, self.kv_heads, self.head_dim, self.dtype, self.device)

    def __call__(self, tokens, features, batch, cache):
        """True pairs: tokens (N,) and the target's fused layers (N, k·d) -> states (N, d)."""
        return self.draft(tokens, self.fc(features.to(self.dtype)), batch, cache)

    def draft(self, tokens, states, batch, cache):
        """Draft pairs: tokens (N,) and the drafter's own states (N, d) -> the next states (N, d)."""
        from eagle_backbone.llama import attend, rms_norm

        d, L = self.drafter, self.layer
        x, residual = d.mix(d.embed_tokens(tokens).to(self.dtype), states.to(self.dtype), norm=rms_norm)
        N = x.shape[0]
        q, k, v = L.attention_inputs(x, *self.rope(batch.rope_pos))
        # Eagle3Drafter.finish on the engine's linears: o_proj, the residual, the MLP block
        return L.mlp(residual + L.o(attend(cache, 0, q, k, v, batch, L.scaling, self.attn).reshape(N, -1)))

    def logits(self, h):
        """Logits over the target's vocabulary (draft tokens mapped by d2t; uncovered tokens at -inf):
        Eagle3Drafter.full_logits on the engine's linear and norm."""
        from eagle_backbone.llama import rms_norm

        dl = self.head(rms_norm(self.drafter.norm, h.to(self.dtype)))
        if self.identity_vocab:
            return dl
        out = dl.new_full((*dl.shape[:-1], self.drafter.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_ids, dl)
