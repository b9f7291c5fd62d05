"""Test helpers around the oracle: label a prompt's greedy response in one call."""

from __future__ import annotations

from eagle_backbone.decoder import autoregressive_generate
from eagle_backbone.target import TargetModel
from ldlp.labels.oracle import oracle_labels


def greedy_oracle(target: TargetModel, drafter, prompt_ids, max_new_tokens: int, k_max: int,
                  **kw) -> tuple[list[int], dict]:
    """The target's greedy response to ``prompt_ids`` and its label rows (row ``i - len(prompt_ids)``
    is index ``i``; the engine's step with ``ctx.position = p`` is index ``len(prompt_ids) + p - 1``)."""
    prompt = list(prompt_ids)
    response = autoregressive_generate(target, prompt, max_new_tokens).tokens
    return response, oracle_labels(target, drafter, prompt + response, len(prompt), k_max, **kw)
