"""Draft-length policies: static γ and the adaptive rules compared against it.

Each policy is one class here and one YAML file under ``conf/policy/`` (built with
``hydra.utils.instantiate``), written to the batched protocol of :mod:`eagle_backbone.policy`: ``plan``
gives each running row its depth cap, and threshold rules are device masks in ``stop`` (``go_while``).
None of them reads the host inside a step.

* :class:`StaticPolicy`      a fixed γ (EAGLE's default).
* :class:`LDLPPolicy`        the trained Lightweight Draft Length Predictor (AdaEAGLE), one forward for
                             all rows right after verification (``plans_ahead``).
* :class:`DDDPolicy`         stop when the draft's cumulative log-probability falls below a threshold
                             (Dynamic Depth Decoding).
* :class:`LDLPDDDPolicy`     AdaEAGLE-DDD: stop only once the LDLP length is passed *and* the DDD rule fires.
* :class:`ConfidencePolicy`  stop when the drafter's top probability falls below a threshold
                             (transformers' ``assistant_confidence_threshold``, DISCO-like).
* :class:`EntropyPolicy`     stop when the drafter's entropy exceeds a threshold (AdaEDL / SVIP-like).
* :class:`AcceptancePolicy`  stop when a trained head, reading the drafter's state, says the next draft is
                             unlikely to be kept (SpecDec++-like; :mod:`ldlp.models.acceptance`).
* :class:`HeuristicPolicy`   transformers' schedule: γ += 2 after a fully accepted draft, else γ = max(1, γ - 1).

The upper bounds (the oracle, the batched oracle) are in :mod:`ldlp.policies.oracles`, the cost-driven
policies in :mod:`ldlp.policies.load_aware`, trees in :mod:`ldlp.policies.trees`."""

from __future__ import annotations

import copy
import math
from functools import lru_cache
from pathlib import Path

import torch

from eagle_backbone.errors import mismatch
from eagle_backbone.policy import GO, STOP, Depth, DraftPolicy, EngineView, Rows, go_while, int_at_least
from ldlp.models.acceptance import MIN_LOG_P

__all__ = ["LDLPPolicy", "DDDPolicy", "LDLPDDDPolicy", "ConfidencePolicy", "EntropyPolicy", "AcceptancePolicy",
           "HeuristicPolicy"]


class _PerSlotState:
    """A device tensor of one value per engine slot (the rows of a step index it by their slots), grown on use."""

    def __init__(self, fill: float = 0.0, dtype=torch.float64):
        self.fill, self.dtype = fill, dtype
        self.t: torch.Tensor | None = None

    def at(self, slots: list[int], device) -> torch.Tensor:
        n = max(slots) + 1
        if self.t is None or self.t.shape[0] < n or self.t.device != torch.device(device):
            old, self.t = self.t, torch.full((max(n, 8),), self.fill, dtype=self.dtype, device=device)
            if old is not None and old.device == self.t.device:
                self.t[: old.shape[0]] = old
        return self.t


@lru_cache(maxsize=8)
def load_ldlp(path: str):
    """One predictor per checkpoint folder per process (a multirun evaluates many policies in one process)."""
    from ldlp.models.predictor import LDLP

    return LDLP.from_pretrained(path)


class LDLPPolicy(DraftPolicy):
    """γ = the LDLP's prediction from the last accepted token's embedding and its target feature: one predictor
    forward for all rows, right after verification, read with the step's accept counts."""

    name = "ldlp"
    plans_ahead = True

    def __init__(self, path: str, max_gamma: int | None = None, offset: int = 0, threshold: float | None = None):
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"ldlp policy: policy.path={path} has no config.json; train the predictor first "
                             "(`python scripts/collect_oracle.py` then `python scripts/train_ldlp.py +experiment=tiny`)")
        self.path = str(path)
        self.model = load_ldlp(self.path)
        if threshold is not None:
            # the distribution head drafts the largest k with P(accepted length >= k) >= threshold: a lower
            # threshold drafts more (worth it when a draft step is cheap next to a target forward)
            if self.model.config.head != "distribution":
                raise ValueError(f"ldlp policy: threshold applies to the distribution head only; {path} has a "
                                 f"{self.model.config.head!r} head (set policy.threshold=null)")
            if not 0 < threshold < 1:
                raise ValueError(f"ldlp policy: threshold must be in (0, 1), got {threshold!r}")
            self.model = copy.deepcopy(self.model)  # the cached model stays as saved
            self.model.config.threshold = float(threshold)
        self.max_gamma = None if max_gamma is None else int_at_least(self.name, "max_gamma", max_gamma, 1)
        if not isinstance(offset, int) or isinstance(offset, bool):
            raise ValueError(f"ldlp policy: offset must be an integer, got {offset!r}")
        self.offset = offset  # added to the prediction (AdaEAGLE drafts the predicted length; +1 hedges)
        self._cpu = None  # the one-row numpy path (_one_row_cpu), per model object

    def bind(self, view: EngineView) -> None:
        d, target = self.model.config.feature_dim, view.target
        if d != target.hidden_size:
            raise ValueError(f"ldlp policy: {self.path}/config.json has input_dim={self.model.config.input_dim} "
                             f"(features of size {d}) but the target's embeddings and features have size "
                             f"{target.hidden_size}: it was trained for another target; train one for this target "
                             "(python scripts/train_ldlp.py) or point policy.path at it")

    def predict(self, embeddings: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """(R,) predicted lengths on the device, offset and capped."""
        n = (self.model.predict_length(embeddings.float(), features.float()).to(torch.long) + self.offset).clamp_min(0)
        return n if self.max_gamma is None else n.clamp_max(self.max_gamma)

    def plan(self, rows: Rows) -> torch.Tensor | list[int]:
        if len(rows) == 1 and rows.features.device.type == "cpu" and not self.model.training:
            return [self._one_row_cpu(rows)]
        return self.predict(rows.embeddings, rows.features)

    def _one_row_cpu(self, rows: Rows) -> int:
        """The same prediction in numpy (:class:`~ldlp.models.predictor.NumpyLDLP`): a dozen torch ops on cold
        caches cost 2.3% of a step here, this 1.2% (the policy's own time in a head to head, float32)."""
        if self._cpu is None or self._cpu.ldlp is not self.model:
            self._cpu = self.model.numpy_decoder()
        n = max(self._cpu.length(**self._cpu.ef_inputs(rows)) + self.offset, 0)
        return n if self.max_gamma is None else min(n, self.max_gamma)


class DDDPolicy(DraftPolicy):
    """Draft while the cumulative log-probability of the draft stays at or above ``threshold``."""

    name = "ddd"
    reads_drafts = True

    def __init__(self, threshold: float = -1.0, max_gamma: int = 8):
        if not threshold <= 0:
            raise ValueError(f"ddd policy: threshold is a log-probability and must be <= 0, got {threshold!r}")
        self.threshold = float(threshold)
        self.max_gamma = int_at_least(self.name, "max_gamma", max_gamma, 1)


    def stop(self, d: Depth) -> torch.Tensor:
        return go_while(d.logp >= self.threshold)


class LDLPDDDPolicy(DraftPolicy):
    """AdaEAGLE-DDD: keep drafting until both the LDLP length is reached and the DDD rule says stop."""

    name = "ldlp_ddd"
    reads_drafts = True
    plans_ahead = True  # the LDLP length is predicted right after verification and kept on the device

    def __init__(self, path: str, threshold: float = -1.0, max_gamma: int = 8, offset: int = 0,
                 ldlp_threshold: float | None = None):
        self.ldlp = LDLPPolicy(path, max_gamma=max_gamma, offset=offset, threshold=ldlp_threshold)
        self.ddd = DDDPolicy(threshold, max_gamma)
        self.max_gamma = max_gamma
        self._length = _PerSlotState(0, torch.long)

    def bind(self, view: EngineView) -> None:
        self.ldlp.bind(view)

    def plan(self, rows: Rows) -> list[int]:
        lengths = self._length.at(rows.slots, rows.features.device)
        lengths[torch.as_tensor(rows.slots, device=lengths.device)] = torch.as_tensor(self.ldlp.plan(rows),
                                                                                     device=lengths.device)
        return super().plan(rows)  # every row drafts to the cap; stop() decides

    def stop(self, d: Depth) -> torch.Tensor:
        lengths = self._length.t[d.slots]
        return go_while((d.depth < lengths) | (d.logp >= self.ddd.threshold))


class ConfidencePolicy(DraftPolicy):
    """Draft while the drafter's top probability is at or above ``threshold``."""

    name = "confidence"
    reads_drafts = True

    def __init__(self, threshold: float = 0.4, max_gamma: int = 8):
        if not 0 <= threshold <= 1:
            raise ValueError(f"confidence policy: threshold is a probability in [0, 1], got {threshold!r}")
        self.threshold = float(threshold)
        self.max_gamma = int_at_least(self.name, "max_gamma", max_gamma, 1)


    def stop(self, d: Depth) -> torch.Tensor:
        return go_while(d.probs.max(-1).values.double() >= self.threshold)


class EntropyPolicy(DraftPolicy):
    """Draft while the entropy (nats) of the drafter's distribution is at or below ``threshold``."""

    name = "entropy"
    reads_drafts = True

    def __init__(self, threshold: float = 1.0, max_gamma: int = 8):
        if not threshold >= 0:
            raise ValueError(f"entropy policy: threshold is an entropy in nats and must be >= 0, got {threshold!r}")
        self.threshold = float(threshold)
        self.max_gamma = int_at_least(self.name, "max_gamma", max_gamma, 1)


    @staticmethod
    def entropy(probs: torch.Tensor) -> torch.Tensor:
        """(..., V) distributions -> (...,) entropies in nats (float64; 0·log 0 = 0)."""
        p = probs.double()
        return -(p * torch.log(p.clamp_min(1e-300))).sum(-1)

    def stop(self, d: Depth) -> torch.Tensor:
        return go_while(self.entropy(d.probs) <= self.threshold)


@lru_cache(maxsize=8)
def _load_acceptance_head(path: str):
    from ldlp.models.acceptance import AcceptanceHead

    return AcceptanceHead.from_pretrained(path)


class AcceptancePolicy(DraftPolicy):
    """Draft token m+1 while the acceptance head's P(drafts 1..m+1 all kept) is at or above ``threshold``.

    The head reads the drafter state behind each draft, so it needs an EAGLE drafter. The probability is
    the whole draft's, so a threshold compares the chance that one more drafted token pays off against its
    cost: lower it when drafting is cheap next to a target pass.
    """

    name = "acceptance"
    reads_drafts = True

    def __init__(self, path: str, threshold: float = 0.3, max_gamma: int = 8):
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"acceptance policy: policy.path={path} has no config.json; train the head first "
                             "(`python scripts/collect_oracle.py` then `python scripts/train_acceptance.py`)")
        if not 0 <= threshold <= 1:
            raise ValueError(f"acceptance policy: threshold is a probability in [0, 1], got {threshold!r}")
        self.path = str(path)
        self.head = _load_acceptance_head(str(path))
        self.threshold = float(threshold)
        self.max_gamma = int_at_least(self.name, "max_gamma", max_gamma, 1)
        self._cum = None  # per row of the step: the sum of its chain's clipped log-probabilities
        self._one = False  # this step is one row on a CPU: decided on the host (_one_row_cpu)
        self._host_codes = True  # the engine reads the stop codes on the host (early_exit): reading floats is free

    def bind(self, view: EngineView) -> None:
        candidates = view.candidates
        drafter = getattr(candidates, "drafter", None)
        width = getattr(drafter, "hidden_size", None)
        if width is None:
            raise ValueError(f"acceptance policy: {self.path} reads the EAGLE drafter's states, and "
                             f"{type(candidates).__name__} offers none: use an EAGLE drafter (model.drafter_kind=eagle)")
        kind, theirs = (self.head.config.meta or {}).get("drafter_kind"), getattr(candidates, "kind", None)
        if kind is not None and theirs is not None and kind != theirs:  # same width, states of another meaning
            mismatch(f"acceptance policy: {self.path} was trained on {kind} drafter states and this pair's drafter is "
                     f"{theirs}: train one on its labels (python scripts/train_acceptance.py) or point policy.path at it")
        if self.head.config.hidden_size != width:
            raise ValueError(f"acceptance policy: {self.path}/config.json has hidden_size="
                             f"{self.head.config.hidden_size} but this drafter's states have size {width}: the head "
                             "was trained for another drafter; train one for it (python scripts/train_acceptance.py) "
                             "or point policy.path at it")
        # an engine that keeps the codes on the device (as on a GPU) gets them as masks: no read of ours either
        self._host_codes = bool(view.early_exit)

    def stop(self, d: Depth) -> torch.Tensor:
        if d.states is None:
            raise ValueError("acceptance policy: no drafter state to read. It needs an EAGLE drafter (a standalone "
                             "draft LM offers none) or, in replay, oracle rows collected with store_draft_states=true")
        if d.depth == 1:  # every row of the step that drafts at all drafts depth 1: the step's mode is set here
            self._one = len(d.rows) == 1 and d.probs.device.type == "cpu" and self._host_codes
            self._cum = 0.0 if self._one else torch.zeros(max(d.rows) + 1, dtype=torch.float64, device=d.probs.device)
        if self._one:
            return [self._one_row_cpu(d)]
        p = d.probs.gather(1, d.tokens[:, None])[:, 0].double()
        log_p = torch.where(p > 1e-6, torch.log(p), torch.full_like(p, MIN_LOG_P))  # as clip_log_p
        idx = torch.as_tensor(d.rows, device=p.device)
        self._cum[idx] += log_p
        stats = torch.stack([log_p, self._cum[idx], torch.full_like(log_p, d.depth)], -1)
        return go_while(self.head(d.states, stats) >= self.threshold)

    def _one_row_cpu(self, d: Depth) -> int:
        """One row on a CPU, on host floats and the head's dot product (:meth:`AcceptanceHead.probability`): the
        dozen torch ops of the batched rule cost ~100 µs a depth on cold caches, 3.1% of a step here; this 0.9%."""
        p = float(d.probs[0, int(d.tokens[0])])
        log_p = math.log(p) if p > 1e-6 else MIN_LOG_P  # as clip_log_p
        self._cum += log_p
        return GO if self.head.probability(d.states[0], log_p, self._cum, d.depth) >= self.threshold else STOP


class HeuristicPolicy(DraftPolicy):
    """transformers' ``num_assistant_tokens_schedule="heuristic"``, reset at every generation
    (``"heuristic_transient"``) so that results do not depend on the order of the prompts: each slot's γ grows
    by 2 after a step whose drafts were all kept and shrinks by 1 otherwise. It decides on host counts alone, so
    it costs no read."""

    name = "heuristic"

    def __init__(self, initial_gamma: int = 5, max_gamma: int | None = None):
        self.initial_gamma = int_at_least(self.name, "initial_gamma", initial_gamma, 1)
        self.max_gamma = None if max_gamma is None else int_at_least(self.name, "max_gamma", max_gamma, 1)
        if self.max_gamma is not None and self.initial_gamma > self.max_gamma:  # it would draft past max_gamma
            raise ValueError(f"{self.name} policy: initial_gamma={self.initial_gamma} is above "
                             f"max_gamma={self.max_gamma}; lower it or raise max_gamma")
        self._gamma: dict[int, int] = {}  # slot -> its γ

    def begin(self, slot: int, prompt_ids, max_new_tokens: int | None = None) -> None:
        self._gamma[slot] = self.initial_gamma

    def plan(self, rows: Rows) -> list[int]:
        return [self._gamma.get(b, self.initial_gamma) for b in rows.slots]

    def observe(self, rows: Rows, drafted: list[int], accepted: list[int], extra: dict | None = None) -> None:
        for b, n, a in zip(rows.slots, drafted, accepted):
            g = self._gamma.get(b, self.initial_gamma)
            g = g + 2 if n > 0 and a == n else max(1, g - 1)
            self._gamma[b] = g if self.max_gamma is None else min(g, self.max_gamma)
