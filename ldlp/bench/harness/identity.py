"""The greedy-identity check every benchmark runs: under greedy decoding every output must equal, token for token,
the target's own greedy decoding through transformers (:meth:`~eagle_backbone.target.TargetModel.reference_greedy`,
independent of the engine), or another run taken as the reference (AR's outputs, a dialogue's reference turns).

:class:`GreedyReference` holds the reference sequences, keyed by prompt index (a list) or by id (a dict), and is
the one comparison: :meth:`~GreedyReference.same` per output, :meth:`~GreedyReference.lossless` over runs,
:meth:`~GreedyReference.differing` over keyed outputs, and :meth:`~GreedyReference.difference`, where an output
leaves its reference, whether that is a near-tie of the dtype (:func:`near_tie`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch


def near_tie(target, prompt, ref, got) -> dict:
    """The target's top-2 logit gap at the first position where ``got`` leaves ``ref`` (one forward of
    the reference prefix, as plain decoding computes it), and the dtype's spacing at the top logit."""
    i = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    if i >= len(ref) or i >= len(got):
        return {"position": i, "gap": None, "spacing": None, "near_tie": False, "note": "length differs only"}
    with torch.inference_mode():
        logits, _ = target(torch.tensor([prompt + ref[:i]], device=target.device))
    top = torch.topk(logits[0, -1].float(), 2)
    gap = float(top.values[0] - top.values[1])
    eps = torch.finfo(target.dtype).eps  # 2^-mantissa bits: 2^-7 for bfloat16, 2^-23 for float32
    spacing = 2.0 ** math.floor(math.log2(max(abs(float(top.values[0])), 1e-30))) * eps
    return {"position": i, "ref_token": ref[i], "got_token": got[i], "gap": gap, "spacing": spacing,
            "near_tie": gap <= 2 * spacing}


class GreedyReference:
    """Reference token sequences (``tokens``: one per prompt, or {id: tokens}) that greedy outputs must equal."""

    def __init__(self, tokens: Sequence | Mapping, target=None, prompts: Sequence | None = None):
        self.tokens = tokens
        self.target, self.prompts = target, prompts  # for :meth:`difference`

    @classmethod
    def of_target(cls, target, prompts: Sequence, max_new_tokens: int,
                  log: Callable[[str], None] | None = None) -> GreedyReference:
        """The target's own greedy decoding of each prompt through transformers' forward (untimed: before any clock)."""
        if log is not None:
            log(f"reference: the target's own greedy outputs of {len(prompts)} prompts (transformers' forward)")
        return cls([target.reference_greedy(p, max_new_tokens) for p in prompts], target, prompts)

    def same(self, outputs: Sequence, keys: Sequence | None = None) -> list[bool]:
        """Per output, whether it equals its reference (``keys``: each output's prompt index or id; default 0, 1, …)."""
        keys = range(len(outputs)) if keys is None else keys
        return [list(out) == list(self.tokens[k]) for out, k in zip(outputs, keys)]

    def lossless(self, runs: Sequence[Sequence]) -> bool:
        """Whether every run's outputs (each run: one output per prompt, in order) equal the references."""
        return all(all(self.same(outputs)) for outputs in runs)

    def differing(self, first: Mapping, *others: Mapping) -> list:
        """The ids (those of ``first``, then the references') where any of the keyed outputs is not the reference
        (a missing output or reference counts as a difference)."""
        return [k for k in dict.fromkeys([*first, *self.tokens])
                if any(out.get(k) != self.tokens.get(k) for out in (first, *others))]

    def difference(self, key, got) -> dict:
        """Where ``got`` leaves the reference of prompt ``key``, and whether that is a near-tie (:func:`near_tie`)."""
        return near_tie(self.target, self.prompts[key], self.tokens[key], got)
