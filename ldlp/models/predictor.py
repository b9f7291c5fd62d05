"""The Lightweight Draft Length Predictor (LDLP): picks γ before each drafting phase.

It reads the pair the drafter reads next, ``[e; f]``: the target's input embedding ``e`` of the last
accepted token and the target feature ``f`` at the position that produced it, and returns how many
draft tokens are worth proposing. AdaEAGLE's model is a three-layer MLP with residual connections
and one scalar output; here the head is a choice:

* ``regression``     one scalar ŷ, trained with the asymmetric L1 loss; γ = clamp(round(ŷ), 0, k_max).
* ``classification`` k_max + 1 logits over the accepted length 0..k_max (cross-entropy); γ = argmax.
* ``distribution``   the survival curve S_k = P(accepted length >= k), k = 1..k_max, built as a product
                     of continuation probabilities q_j = P(L >= j | L >= j-1) so that it can only fall
                     with k (a discrete-time survival model, trained by the likelihood of the label);
                     γ = the largest k with S_k >= ``threshold`` (0 when S_1 < threshold). With
                     threshold 0.5 that is the median of the predicted length distribution.

Inputs are standardised inside the model (``input_mean`` / ``input_std`` buffers, fitted on the
training rows), so the saved checkpoint is self-contained: ``model.safetensors`` + ``config.json``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy.special import expit
from torch import nn

from eagle_backbone.io import atomic_path, atomic_write_json
from ldlp.models.features import GROUP_NAMES, GROUPS

HEADS = ("regression", "classification", "distribution")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def save_folder(out_dir: str | Path, config: dict, state: dict) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (float32), each atomically (:mod:`eagle_backbone.io`);
    the weights go last, so their presence marks a complete folder."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    atomic_write_json(out / CONFIG_FILE, config)
    with atomic_path(out / WEIGHTS_FILE) as tmp:
        save_file({k: v.detach().float().cpu().contiguous() for k, v in state.items()}, str(tmp),
                  metadata={"format": "pt"})
    return out


def read_folder(path: str | Path, what: str, how: str) -> tuple[dict, dict]:
    """(config, tensors) of a folder written by :func:`save_folder`; a clear error when it is not one.
    ``what`` names the kind ("an LDLP checkpoint"), ``how`` the command that makes one."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ValueError(f"{path} is not {what}: it needs {CONFIG_FILE} and {WEIGHTS_FILE} (train one with `{how}`)")
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / CONFIG_FILE}: not valid JSON ({e})") from None
    from safetensors import SafetensorError

    try:
        return raw, load_file(str(path / WEIGHTS_FILE))
    except SafetensorError as e:
        raise ValueError(f"{path / WEIGHTS_FILE}: truncated or corrupt weight file ({e}); train it again with "
                         f"`{how}`") from None


def check_state(path: str | Path, state: dict, expected: dict, implied_by: str = CONFIG_FILE) -> None:
    """Refuse weights whose keys or shapes differ from the model ``config.json`` builds, or that hold a NaN or an
    infinity (a diverged fit would predict NaN and silently stop or max out drafting): one line naming the file,
    the missing and unexpected keys and the wrong shapes, or the keys that are not finite."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [f"{k} {tuple(v.shape)} (config implies {tuple(expected[k].shape)})" for k, v in state.items()
             if k in expected and v.shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise ValueError(f"{Path(path) / WEIGHTS_FILE} does not match {implied_by}: missing keys {missing}, "
                         f"unexpected keys {unexpected}, wrong shapes {wrong}")
    bad = sorted(k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
    if bad:
        raise ValueError(f"{Path(path) / WEIGHTS_FILE}: keys {bad} hold a NaN or an infinity; train it again")


def _versions(tensors) -> tuple:
    """In-place change counters (an inference tensor, made by a copy under inference mode, never changes)."""
    return tuple(-1 if t.is_inference() else t._version for t in tensors)


@dataclass
class LDLPConfig:
    input_dim: int  # the width of the inputs: 2 * d for [e; f], plus the other groups' widths
    hidden_dim: int = 256
    k_max: int = 8  # the longest draft the labels know about (oracle k_max)
    head: str = "regression"
    num_layers: int = 3  # input projection, (num_layers - 2) residual blocks, output layer
    dropout: float = 0.0
    threshold: float = 0.5  # distribution head: γ = max{k : P(L >= k) >= threshold}
    meta: dict = field(default_factory=dict)  # provenance (target, oracle dir, metrics): not used by the model
    # what it reads, in order: groups of ldlp.models.features.step_features. AdaEAGLE's LDLP reads ["ef"] alone;
    # with more groups it reads step_features vectors (survival_tensor; policy=learned)
    inputs: list = field(default_factory=lambda: ["ef"])

    def __post_init__(self):
        if self.head not in HEADS:
            raise ValueError(f"LDLPConfig.head must be one of {HEADS}, got {self.head!r}")
        unknown = [g for g in self.inputs if g not in GROUPS]
        if unknown or "ef" not in self.inputs:
            raise ValueError(f"LDLPConfig.inputs must name groups of {list(GROUPS)} and include 'ef', got {self.inputs}")
        if self.input_dim <= self.extra_dim or (self.input_dim - self.extra_dim) % 2:
            raise ValueError(f"LDLPConfig.input_dim must be 2 * d (embedding + feature) + {self.extra_dim} (the "
                             f"groups {self.inputs}), got {self.input_dim}")
        if self.k_max < 1:
            raise ValueError(f"LDLPConfig.k_max must be >= 1, got {self.k_max}")
        if self.num_layers < 2:
            raise ValueError(f"LDLPConfig.num_layers must be >= 2, got {self.num_layers}")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"LDLPConfig.threshold must be in (0, 1), got {self.threshold}")

    @property
    def extra_dim(self) -> int:
        """The width of the groups other than ``ef``."""
        return sum(len(GROUP_NAMES[g]) for g in self.inputs if g != "ef")

    @property
    def feature_dim(self) -> int:
        return (self.input_dim - self.extra_dim) // 2

    @property
    def output_dim(self) -> int:
        return {"regression": 1, "classification": self.k_max + 1, "distribution": self.k_max}[self.head]

    @classmethod
    def from_dict(cls, d: dict, where: str = "LDLP config") -> "LDLPConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        if "input_dim" not in d:
            raise ValueError(f"{where}: missing key 'input_dim'")
        return cls(**d)


class ResidualBlock(nn.Module):
    def __init__(self, dim: int, dropout: float):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.dropout(F.silu(self.linear(h)))


class LDLP(nn.Module):
    """``forward(x)`` maps (B, 2d) inputs to (B, output_dim) raw outputs; ``predict_length`` gives γ."""

    def __init__(self, config: LDLPConfig):
        super().__init__()
        self.config = config
        c = config
        self.register_buffer("input_mean", torch.zeros(c.input_dim))
        self.register_buffer("input_std", torch.ones(c.input_dim))
        self.input = nn.Linear(c.input_dim, c.hidden_dim)
        self.blocks = nn.ModuleList(ResidualBlock(c.hidden_dim, c.dropout) for _ in range(c.num_layers - 2))
        self.output = nn.Linear(c.hidden_dim, c.output_dim)
        if c.head == "regression":
            # start near the typical label instead of 0, so early training is not all under-prediction
            nn.init.constant_(self.output.bias, c.k_max / 2)
        self._decoding = None  # folded weights for the batch-1 path, see _decoding_weights

    def train(self, mode: bool = True):
        self._decoding = None
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):  # .to(), .cuda(), .float(), ...: weights move, rebuild
        self._decoding = None
        return super()._apply(fn, *args, **kwargs)

    # -- the network -------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.input((x - self.input_mean) / self.input_std))
        for block in self.blocks:
            h = block(h)
        return self.output(h)

    @torch.no_grad()
    def set_normalization(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Standardise inputs with statistics of the training rows (std floored to avoid division by ~0)."""
        self.input_mean.copy_(mean)
        self.input_std.copy_(std.clamp_min(1e-6))

    # -- from raw outputs to lengths ------------------------------------------------------------------

    def survival_from_output(self, out: torch.Tensor) -> torch.Tensor:
        """(B, k_max) P(L >= k) for k = 1..k_max, from the classification or distribution head's output."""
        head = self.config.head
        if head == "distribution":
            return torch.cumsum(F.logsigmoid(out), dim=-1).exp()
        if head == "classification":
            p = out.softmax(-1)  # (B, k_max + 1) over L = 0..k_max
            return p.flip(-1).cumsum(-1).flip(-1)[..., 1:]
        raise ValueError("survival(): the regression head predicts a number, not a distribution; "
                         "use ldlp.head=classification or distribution")

    def length_from_output(self, out: torch.Tensor) -> torch.Tensor:
        """(B, output_dim) raw outputs -> (B,) int64 γ in 0..k_max."""
        c = self.config
        if c.head == "regression":
            return out[..., 0].round().clamp(0, c.k_max).long()
        if c.head == "classification":
            return out.argmax(-1)
        # S_k falls with k, so "largest k with S_k >= threshold" is the count of such k
        return (self.survival_from_output(out) >= c.threshold).sum(-1)

    # -- decoding-time API ---------------------------------------------------------------------------

    def _inputs(self, embedding: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        if self.config.inputs != ["ef"]:
            raise ValueError(f"this LDLP reads {self.config.inputs}, not [e; f] alone: ask it with survival_of("
                             "step_features vectors) (policy=learned)")
        d = self.config.feature_dim
        if embedding.shape[-1] != d or feature.shape[-1] != d:
            raise ValueError(f"LDLP expects embedding and feature of size {d} (input_dim "
                             f"{self.config.input_dim} = 2 * {d}), got embedding {tuple(embedding.shape)} and "
                             f"feature {tuple(feature.shape)}: was it trained for another target model?")
        w = self.input.weight
        return torch.cat([embedding, feature], dim=-1).to(device=w.device, dtype=w.dtype)

    @torch.no_grad()
    def _decoding_weights(self):
        """The eval-mode network with the input standardisation folded into the first layer, as plain
        tensors: the batch-1 path then costs a handful of matrix-vector products and no autograd.
        Rebuilt whenever a weight changes in place (tensor versions), moves, or the mode changes."""
        if self._decoding is not None and self._decoding[0] == _versions(self._decoding[1]):
            return self._decoding[2]
        state = list(self.state_dict(keep_vars=True).values())
        w1 = self.input.weight / self.input_std
        b1 = self.input.bias - w1 @ self.input_mean
        blocks = [(b.linear.weight.detach(), b.linear.bias.detach()) for b in self.blocks]
        log_threshold = math.log(self.config.threshold)
        weights = (w1, b1, blocks, self.output.weight.detach(), self.output.bias.detach(), log_threshold)
        self._decoding = (_versions(state), state, weights)
        return weights

    def _output_one(self, x: torch.Tensor) -> torch.Tensor:
        """The network on one input vector, by the folded weights (no autograd, a few matrix-vector products)."""
        w1, b1, blocks, w_out, b_out, _ = self._decoding_weights()
        if x.dtype != w1.dtype or x.device != w1.device:
            x = x.to(device=w1.device, dtype=w1.dtype)
        h = F.silu(torch.addmv(b1, w1, x))
        for w, b in blocks:
            h = h + F.silu(torch.addmv(b, w, h))
        return torch.addmv(b_out, w_out, h)

    def _predict_one(self, embedding: torch.Tensor, feature: torch.Tensor) -> int:
        d = self.config.feature_dim
        if embedding.shape[0] != d or feature.shape[0] != d or self.config.inputs != ["ef"]:
            self._inputs(embedding, feature)  # raises the size error
        log_threshold = self._decoding_weights()[-1]
        out = self._output_one(torch.cat((embedding, feature)))
        head = self.config.head
        if head == "regression":
            return min(max(round(out.item()), 0), self.config.k_max)
        if head == "classification":
            return int(out.argmax())
        return int((torch.cumsum(F.logsigmoid(out), 0) >= log_threshold).sum())

    def numpy_decoder(self) -> NumpyLDLP:
        """A numpy snapshot of the eval-mode network for one-row decisions on a CPU (:class:`NumpyLDLP`)."""
        return NumpyLDLP(self)

    def predict_length(self, embedding: torch.Tensor, feature: torch.Tensor) -> int | torch.Tensor:
        """γ for one position ((d,) inputs -> int) or a batch ((B, d) inputs -> (B,) LongTensor).

        The one-position call is the decoding-time path (the ``ldlp`` policy, every step): in eval mode it
        runs on folded plain-tensor weights without autograd, a few tens of microseconds on a CPU.
        """
        if embedding.dim() == 1 and not self.training:
            return self._predict_one(embedding, feature)
        with torch.inference_mode():
            x = self._inputs(embedding, feature)
            if x.dim() == 1:
                return int(self.length_from_output(self(x[None]))[0])
            return self.length_from_output(self(x))

    @torch.inference_mode()
    def survival(self, embedding: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """(B, k_max) P(accepted length >= k), k = 1..k_max ((k_max,) for unbatched inputs)."""
        x = self._inputs(embedding, feature)
        s = self.survival_from_output(self(x if x.dim() > 1 else x[None]))
        return s if x.dim() > 1 else s[0]

    @torch.inference_mode()
    def survival_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """(n, k_max) P(accepted length >= k), k = 1..k_max, on the model's device, from (n, input_dim) feature
        vectors of the groups ``config.inputs`` (:func:`ldlp.models.features.step_features`). One row in eval mode
        takes the folded-weight path."""
        if x.shape[-1] != self.config.input_dim:
            raise ValueError(f"LDLP reads {self.config.input_dim} inputs ({self.config.inputs}), got {x.shape[-1]}")
        if len(x) == 1 and not self.training:
            return self.survival_from_output(self._output_one(x[0])[None])
        w = self.input.weight
        return self.survival_from_output(self(x.to(device=w.device, dtype=w.dtype)))

    def survival_of(self, x) -> np.ndarray:
        """:meth:`survival_tensor` of numpy rows, as numpy (the study's models share this call)."""
        return self.survival_tensor(torch.as_tensor(np.asarray(x, dtype=np.float32))).float().cpu().numpy()

    # -- checkpoints ---------------------------------------------------------------------------------

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (each atomically)."""
        return save_folder(out_dir, asdict(self.config), self.state_dict())

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> "LDLP":
        """Load a folder written by :meth:`save_pretrained`; the model comes back in eval mode."""
        path = Path(path)
        raw, state = read_folder(path, "an LDLP checkpoint", "python scripts/train_ldlp.py")
        model = cls(LDLPConfig.from_dict(raw, where=str(path / CONFIG_FILE)))
        c = model.config
        check_state(path, state, model.state_dict(), f"{CONFIG_FILE} (input_dim={c.input_dim}, hidden_dim="
                    f"{c.hidden_dim}, head={c.head!r}, k_max={c.k_max})")
        model.load_state_dict(state)
        return model.to(device=device, dtype=dtype).eval()


# -- losses (shared by the trainer and the tests) ------------------------------------------------------


def asymmetric_l1(pred: torch.Tensor, label: torch.Tensor, under_weight: float) -> torch.Tensor:
    """Mean of λ·|ŷ - y| where ŷ < y (under-prediction wastes a target pass) and |ŷ - y| otherwise.

    This is the pinball (quantile) loss for the quantile λ / (1 + λ) of the accepted length.
    """
    diff = pred - label.to(pred.dtype)
    return torch.where(diff < 0, -under_weight * diff, diff).mean()


def survival_nll(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of accepted length ``label`` (0..k_max) under the distribution head.

    ``out`` (B, k_max) are logits of the continuation probabilities q_k = P(L >= k | L >= k-1), so
    log P(L = y) = sum_{k<=y} log q_k + log(1 - q_{y+1}) (the last term absent when y = k_max).
    """
    k_max = out.shape[-1]
    k = torch.arange(1, k_max + 1, device=out.device)
    y = label[:, None]
    survived = (k <= y).to(out.dtype)  # the label reached step k
    stopped = (k == y + 1).to(out.dtype)  # the first step the label did not reach
    ll = survived * F.logsigmoid(out) + stopped * F.logsigmoid(-out)
    return -ll.sum(-1).mean()


def ldlp_loss(model: LDLP, out: torch.Tensor, label: torch.Tensor, under_weight: float) -> torch.Tensor:
    head = model.config.head
    if head == "regression":
        return asymmetric_l1(out[:, 0], label, under_weight)
    if head == "classification":
        return F.cross_entropy(out, label)
    return survival_nll(out, label)


class NumpyLDLP:
    """An LDLP's folded network (:meth:`LDLP._decoding_weights`) as numpy arrays, for one row on a CPU: right after
    the target's forward the caches are cold and each torch op pays its dispatch (about 10 µs), so a decision of
    a dozen torch ops cost 3% of a step; these few matrix-vector products cost a fraction of that. For a model on
    ``[e; f]`` alone the first layer's ``[e]`` half and its bias are kept per token on first sight (``W_e e + b``,
    at most the vocabulary's rows), so a step reads one row instead of the token's embedding and a (hidden x d)
    block. A snapshot: the policy holding it rebuilds it when its model object changes, not on in-place edits."""

    def __init__(self, ldlp: LDLP):
        self.ldlp, self.config = ldlp, ldlp.config
        w1, b1, blocks, w_out, b_out, self.log_threshold = ldlp._decoding_weights()
        d = ldlp.config.feature_dim
        self.w1, self.b1 = w1.numpy(force=True), b1.numpy(force=True)
        self.w1_e, self.w1_f = np.ascontiguousarray(self.w1[:, :d]), np.ascontiguousarray(self.w1[:, d:])
        self.blocks = [(w.numpy(force=True), b.numpy(force=True)) for w, b in blocks]
        self.w_out, self.b_out = w_out.numpy(force=True), b_out.numpy(force=True)
        self.by_token: dict[int, np.ndarray] = {}
        self.embed = None

    def _first_layer(self, x=None, token=None, feature=None) -> np.ndarray:
        if token is None:
            return self.w1 @ np.asarray(x, dtype=np.float32) + self.b1
        tok, embed = token
        if embed is not self.embed and embed != self.embed:  # another target's embeddings: start again
            self.by_token, self.embed = {}, embed
        row = self.by_token.get(tok)
        if row is None:
            e = embed(torch.tensor([tok], device=feature.device))[0].detach().float().numpy()  # once per token
            row = self.by_token[tok] = self.w1_e @ e + self.b1
        return row + self.w1_f @ feature.detach().float().numpy().reshape(-1)

    @staticmethod
    def ef_inputs(rows) -> dict:
        """The ``[e; f]`` inputs of a step's one row (an :class:`~eagle_backbone.policy.Rows` on a CPU): its last
        token id, from the host list where the engine has one, else from the CPU tensor's memory (planning ahead;
        as the feature is, by numpy: no device transfer, so no read the engine would wait for), and its feature.
        The first layer's half for the token then comes from the per-token cache."""
        tok = rows.last_ids[0] if rows.last_ids is not None else rows.last_tokens.numpy()[0]
        return {"token": (int(tok), rows.embed), "feature": rows.features}

    def output(self, x=None, token=None, feature=None) -> np.ndarray:
        """The head's raw outputs for one row: ``x`` a feature vector of ``config.inputs``, or for ``[e; f]``
        ``token=(id, embed)`` (the target's embedding function) and ``feature`` (the target feature, (d,) or (1, d))."""
        z = self._first_layer(x, token, feature)
        h = z * expit(z)  # SiLU
        for w, b in self.blocks:
            z = w @ h + b
            h = h + z * expit(z)
        return (self.w_out @ h + self.b_out).astype(np.float64)

    def survival(self, **inputs) -> np.ndarray:
        """(k_max,) S_k = P(accepted length >= k) of a distribution head (Π sigmoid)."""
        return np.exp(np.cumsum(-np.logaddexp(0.0, -self.output(**inputs))))

    def length(self, **inputs) -> int:
        """γ as :meth:`LDLP.predict_length` gives it, for one row."""
        out = self.output(**inputs)
        head = self.config.head
        if head == "regression":
            return min(max(round(float(out[0])), 0), self.config.k_max)
        if head == "classification":
            return int(out.argmax())
        return int((np.cumsum(-np.logaddexp(0.0, -out)) >= self.log_threshold).sum())
