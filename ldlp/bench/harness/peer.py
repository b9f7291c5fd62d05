"""The peer: transformers' own assisted generation on the same target, draft LM and prompts.

``target.generate(input_ids, assistant_model=draft_lm, ...)`` with the assistant's generation config set
to transformers' heuristic schedule or to its confidence threshold. Its schedule state is reset before
every prompt (as ``"heuristic_transient"`` does), so a result does not depend on the prompts' order.

Counters come from forward hooks: target forwards, assistant forwards (one drafted token each) and the
seconds spent inside each model. Accepted drafts = new tokens - target forwards (each target forward
emits its accepted drafts plus one token of its own).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from eagle_backbone.metrics import GenerationStats
from eagle_backbone.runtime import Clock

SCHEDULES = ("heuristic", "constant")


class PeerSpec:
    """What a ``peer`` config (conf/peer/) builds instead of a draft-length policy: another implementation of
    speculative decoding, which the evaluation runs in place of this engine (on the same target, draft LM
    and prompts, next to the same AR baseline). The evaluation tells the two apart by ``kind``
    (:func:`is_peer`), never by class; a peer declares the ``engine`` it stands for and :meth:`check`s
    that the model and the sampling suit it."""

    kind = "peer"
    engine = "peer"
    name = "peer"
    adaptive = True  # the peer chooses its own draft lengths: no static γ to report

    def check(self, drafter_kind: str, greedy: bool, label: str) -> None:
        """Raise a ValueError when the peer cannot run with this drafter kind or sampling."""


def is_peer(obj) -> bool:
    """Whether ``obj`` (what a ``policy`` config built) is a :class:`PeerSpec` rather than a policy."""
    return getattr(obj, "kind", None) == PeerSpec.kind


class TransformersAssisted(PeerSpec):
    """The peer transformers' assisted generation (``peer=hf_heuristic`` or ``peer=hf_confidence``, conf/peer/):
    a standalone draft LM proposes, with transformers' heuristic schedule or its confidence threshold."""

    engine = "transformers"
    name = "transformers"

    def __init__(self, schedule: str = "heuristic", num_assistant_tokens: int = 5,
                 confidence_threshold: float | None = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"transformers assisted generation: schedule must be one of {SCHEDULES}, got {schedule!r}")
        if not isinstance(num_assistant_tokens, int) or num_assistant_tokens < 1:
            raise ValueError(f"num_assistant_tokens must be an integer >= 1, got {num_assistant_tokens!r}")
        if confidence_threshold is not None and not 0 <= confidence_threshold <= 1:
            raise ValueError(f"confidence_threshold must be in [0, 1] or null, got {confidence_threshold!r}")
        self.schedule, self.num_assistant_tokens = schedule, num_assistant_tokens
        self.confidence_threshold = confidence_threshold

    def check(self, drafter_kind: str, greedy: bool, label: str) -> None:
        from eagle_backbone.drafter_kinds import get_kind

        if not get_kind(drafter_kind).causal_lm:
            raise ValueError(f"policy={label} runs transformers' assisted generation, which needs a standalone "
                             f"draft LM (model=embedded_draft_lm), not model.drafter_kind={drafter_kind}")
        if not greedy:
            raise ValueError(f"policy={label}: the transformers peer is compared under greedy decoding only "
                             "(generation.temperature=0)")


class _ForwardMeter:
    """Counts forward calls of a module and the seconds spent in them (pre/post hooks)."""

    def __init__(self, module: torch.nn.Module, clock: Clock):
        self.calls, self.seconds, self._t0, self.clock = 0, 0.0, 0.0, clock
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, module, args):
        self._t0 = self.clock()

    def _post(self, module, args, output):
        self.calls += 1
        self.seconds += self.clock() - self._t0

    def remove(self):
        for h in self._handles:
            h.remove()


@contextmanager
def _metered(target_model, draft_model, clock: Clock):
    meters = _ForwardMeter(target_model, clock), _ForwardMeter(draft_model, clock)
    try:
        yield meters
    finally:
        for m in meters:
            m.remove()


def _configure_assistant(draft_model, spec: TransformersAssisted) -> None:
    g = draft_model.generation_config
    g.num_assistant_tokens = spec.num_assistant_tokens
    g.num_assistant_tokens_schedule = spec.schedule
    # transformers reads a falsy threshold as "off"; its ROC update retunes it during generation, so reset it too
    g.assistant_confidence_threshold = spec.confidence_threshold or 0.0


@torch.inference_mode()
def hf_generate(target_model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: set[int],
                assistant_model=None, spec: TransformersAssisted | None = None) -> tuple[list[int], GenerationStats]:
    """Greedy ``generate`` of a Hugging Face causal LM, with or without an assistant; new tokens and stats.

    Without an assistant this is the transformers autoregressive baseline."""
    device = next(target_model.parameters()).device
    input_ids = torch.tensor([prompt_ids], device=device)
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                  attention_mask=torch.ones_like(input_ids), eos_token_id=sorted(eos_token_ids) or None,
                  pad_token_id=(sorted(eos_token_ids) or [0])[0], temperature=None, top_p=None, top_k=None)
    draft = assistant_model if assistant_model is not None else target_model
    if assistant_model is not None:
        _configure_assistant(assistant_model, spec or TransformersAssisted())
        kwargs["assistant_model"] = assistant_model
    clock = Clock(device)
    with _metered(target_model, draft, clock) as (t_meter, d_meter):
        t0 = clock()
        out = target_model.generate(input_ids, **kwargs)
        wall = clock() - t0
    new = out[0, len(prompt_ids):].tolist()
    for i, t in enumerate(new):  # generate pads nothing for batch size 1, but cut at EOS to be sure
        if t in eos_token_ids:
            new = new[: i + 1]
            break
    stats = GenerationStats(new_tokens=len(new), wall_s=wall, target_forwards=t_meter.calls, target_s=t_meter.seconds)
    if assistant_model is not None:
        stats.drafted_tokens = d_meter.calls
        stats.accepted_tokens = max(0, min(stats.drafted_tokens, len(new) - t_meter.calls))
        stats.draft_s = d_meter.seconds
    return new, stats
