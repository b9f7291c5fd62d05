"""The acceptance head: when to stop drafting, read from the drafter's own state (SpecDec++-like).

Threshold rules (DDD, confidence, entropy) stop on the drafter's probabilities alone, which predict
only weakly whether the target keeps the next draft; the state the drafter's LM head reads carries
more (``metrics.md`` of ``python scripts/train_acceptance.py`` compares the two on validation rows).
After drafting token ``m`` the head estimates

    q_m = P(the target accepts drafts 1 .. m+1 | what the drafter has seen up to step m)

which is exactly what deciding to draft token ``m+1`` is about: its cost is paid now, and it is worth it
when it is likely to be kept. (SpecDec++ predicts each token's own acceptance and multiplies along the
chain; predicting the decision's quantity directly is simpler and replayed better in our trials on the
embedded labels.)

Inputs at step ``m``: the drafter state ``h_m`` (d), ``log p_m`` (the drafter's probability of the token
it drafted), ``sum_{j<=m} log p_j`` (DDD's statistic) and ``m``. Model: logistic regression, fitted by
scikit-learn on the oracle rows (:func:`ldlp.training.acceptance.examples` makes one example per row and step whose outcome the
labels know); the standardisation is folded into the weights, so a decision is one dot product.
Saved as ``config.json`` + ``model.safetensors``; :class:`ldlp.policies.threshold.AcceptancePolicy` drafts while
``q_m >= threshold``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar, Self

import numpy as np
import torch
from torch import nn

from ldlp.models.predictor import CONFIG_FILE, check_state, read_folder, save_folder

STAT_NAMES = ("log_p", "cum_log_p", "step")  # the inputs after the drafter state, in order
MIN_LOG_P = math.log(1e-6)  # log-probabilities are clipped here (a sampled token can be very unlikely)


def clip_log_p(p: float) -> float:
    """The head's ``log p`` input for a drafted token of drafter probability ``p``."""
    return math.log(p) if p > 1e-6 else MIN_LOG_P


class _HeadConfig:
    """``from_dict`` of the heads' config dataclasses: the ``kind`` must be the class's own (its field's
    default), no unknown keys."""

    what: ClassVar[str]  # what the config describes ("an acceptance head"), for errors

    @classmethod
    def from_dict(cls, d: dict, where: str) -> Self:
        if d.get("kind") != cls.kind:
            raise ValueError(f"{where}: kind={d.get('kind')!r}, not {cls.what}")
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(f"{where}: {e}") from None


@dataclass
class AcceptanceHeadConfig(_HeadConfig):
    hidden_size: int  # d, the drafter state's width
    k_max: int  # trained on steps 1 .. k_max - 1 (the labels' horizon)
    C: float = 0.05  # inverse L2 strength of the logistic regression
    kind: str = "acceptance_head"
    meta: dict = field(default_factory=dict)  # provenance (oracle collection, allow_partial): not used by the model
    what: ClassVar[str] = "an acceptance head"


class _LogisticHead(nn.Module):
    """A logistic regression on [drafter state (d), stats] with the standardisation folded into
    ``state_weight`` (d), ``stat_weight`` (one per stat) and ``bias``: fitted by scikit-learn, saved as
    ``config.json`` + ``model.safetensors``. A subclass names its config class, its stats and, for the error
    on a missing folder, the script that trains one."""

    config_class: type[_HeadConfig]
    stat_names: tuple[str, ...]
    script: str  # the script that trains one

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.state_weight = nn.Parameter(torch.zeros(config.hidden_size), requires_grad=False)
        self.stat_weight = nn.Parameter(torch.zeros(len(self.stat_names)), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(()), requires_grad=False)

    @classmethod
    def from_sklearn(cls, pipeline, config) -> Self:
        """From a fitted ``StandardScaler -> LogisticRegression`` pipeline on [state, stats] columns."""
        scaler, clf = pipeline[0], pipeline[-1]
        scale = np.where(scaler.scale_ > 0, scaler.scale_, 1.0)
        w = clf.coef_[0] / scale
        b = float(clf.intercept_[0] - (w * scaler.mean_).sum())
        head = cls(config)
        d = config.hidden_size
        with torch.no_grad():
            head.state_weight.copy_(torch.from_numpy(w[:d]))
            head.stat_weight.copy_(torch.from_numpy(w[d:]))
            head.bias.fill_(b)
        return head.eval()

    def save_pretrained(self, out_dir: str | Path) -> Path:
        return save_folder(out_dir, asdict(self.config), self.state_dict())

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Self:
        path = Path(path)
        raw, state = read_folder(path, cls.config_class.what, cls.script)
        head = cls(cls.config_class.from_dict(raw, str(path / CONFIG_FILE)))
        check_state(path, state, head.state_dict(), f"{CONFIG_FILE} (hidden_size={head.config.hidden_size})")
        head.load_state_dict(state)
        return head.eval()


class AcceptanceHead(_LogisticHead):
    """q = sigmoid(w_h . h + w_s . [log p, cum log p, step] + b), standardisation folded in."""

    config_class = AcceptanceHeadConfig
    stat_names = STAT_NAMES
    script = "python scripts/train_acceptance.py"

    def __init__(self, config: AcceptanceHeadConfig):
        super().__init__(config)
        self._scalars: tuple[float, ...] | None = None

    def logit(self, state: torch.Tensor, log_p: float, cum_log_p: float, step: int) -> float:
        """One decision (the drafting loop's path): a dot product, no autograd. ``log_p`` and
        ``cum_log_p`` as :func:`clip_log_p` makes them (the sum of the clipped values)."""
        if self._scalars is None:  # the weights are frozen once fitted or loaded: read them once
            self._scalars = (*self.stat_weight.tolist(), float(self.bias))
        w_log_p, w_cum, w_step, bias = self._scalars
        dot = float(torch.dot(state.to(self.state_weight.dtype), self.state_weight))
        return dot + w_log_p * log_p + w_cum * cum_log_p + w_step * step + bias

    def load_state_dict(self, *args, **kwargs):
        self._scalars = None
        return super().load_state_dict(*args, **kwargs)

    def probability(self, state: torch.Tensor, log_p: float, cum_log_p: float, step: int) -> float:
        z = self.logit(state, log_p, cum_log_p, step)
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def forward(self, states: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        """Batched probabilities: ``states`` (n, d), ``stats`` (n, 3) as :func:`examples` builds them."""
        z = states.float() @ self.state_weight + stats.float() @ self.stat_weight + self.bias
        return torch.sigmoid(z)


# ---- per-position acceptance: P(draft i kept | drafts 1..i-1 kept), greedy or sampled -------------------

PROB_FEATURE_NAMES = ("log_top1", "entropy", "sum_sq")  # computed from the drafter's distribution q
DRAFT_STAT_NAMES = (*PROB_FEATURE_NAMES, "depth")  # the inputs after the drafter state, in order


def prob_features(probs: torch.Tensor) -> torch.Tensor:
    """(n, V) drafter distributions -> (n, 3) float32: log of the top-1 probability (clipped at
    ``MIN_LOG_P``), entropy, and ``sum q^2`` (the chance two draws agree). Tensor ops only: the collector
    stores these and :class:`DraftAcceptanceHead` recomputes them, so both read one definition."""
    q = probs.float()
    top1 = q.max(dim=-1).values
    log_top1 = torch.log(top1.clamp_min(math.exp(MIN_LOG_P)))
    entropy = -(q * torch.log(q.clamp_min(1e-30))).sum(-1)
    sum_sq = (q * q).sum(-1)
    return torch.stack([log_top1, entropy, sum_sq], dim=-1)


@dataclass
class DraftAcceptanceHeadConfig(_HeadConfig):
    hidden_size: int  # d, the drafter state's width
    temperature: float  # the sampling temperature its labels were collected at (0 = greedy)
    k_max: int  # trained on depths 1 .. k_max
    C: float = 0.05  # inverse L2 strength of the logistic regression
    kind: str = "draft_acceptance"
    meta: dict = field(default_factory=dict)  # provenance (label folders, metrics): not used by the model
    what: ClassVar[str] = "a draft acceptance head"


class DraftAcceptanceHead(_LogisticHead):
    """a_i = P(draft i, drawn from ``probs``, is kept | drafts 1..i-1 were kept), batched on the device.

    ``head(states (n, d), probs (n, V), depth (n,) or int) -> (n,) float32``: a logistic regression on the
    drafter state that produced ``probs`` and on :func:`prob_features` of ``probs`` and the depth, the
    standardisation folded into the weights. Tensor ops only (no host read), so one call scores every
    batch row at once. Greedy heads (temperature 0) estimate P(drafter argmax == target argmax); sampled
    heads estimate ``beta = sum_x min(p(x), q(x))``, the speculative-sampling acceptance probability.
    """

    config_class = DraftAcceptanceHeadConfig
    stat_names = DRAFT_STAT_NAMES
    script = "python scripts/train_draft_acceptance.py"

    def __init__(self, config: DraftAcceptanceHeadConfig):
        super().__init__(config)
        self.temperature = float(config.temperature)

    def logit_from_stats(self, states: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        """Logits from ``states`` (n, d) and ``stats`` (n, 4) = [prob_features, depth]."""
        return states.float() @ self.state_weight + stats.float() @ self.stat_weight + self.bias

    def logit(self, states: torch.Tensor, probs: torch.Tensor, depth) -> torch.Tensor:
        feats = prob_features(probs)
        # a host int becomes a fill on the device (no host-to-device copy, which would wait for the stream)
        depth = (depth.to(feats.device, torch.float32).expand(feats.shape[0]) if isinstance(depth, torch.Tensor)
                 else feats.new_full((feats.shape[0],), float(depth)))
        return self.logit_from_stats(states, torch.cat([feats, depth[:, None]], dim=1))

    def forward(self, states: torch.Tensor, probs: torch.Tensor, depth) -> torch.Tensor:
        return torch.sigmoid(self.logit(states, probs, depth))
