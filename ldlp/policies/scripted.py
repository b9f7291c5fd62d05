"""A control, not a policy to deploy: the γ choices another policy made, replayed step by step.

Given each prompt's draft lengths from a run of some policy (``GenerationStats.draft_lengths``), it drafts exactly
those again, at next to no cost of its own. Timed in turns beside the policy that made the choices (the head to
head's ``scripted_twins``), it splits that policy's measured gain into what its choices earn (the twin) and what its
own time costs (the twin's seconds against the policy's): the part of the gap between replay, which prices steps
alone, and the measurement that the policy's own calls explain. Greedy decoding makes the walk the same, so the
choices fit the steps they were made for.
"""

from __future__ import annotations

from eagle_backbone.policy import DraftPolicy, Rows


class ScriptedPolicy(DraftPolicy):
    name = "scripted"

    def __init__(self, scripts: dict[tuple[int, ...], list[int]], max_gamma: int):
        self.scripts, self.max_gamma = scripts, max_gamma  # prompt ids -> γ per step
        self._left: dict[int, list[int]] = {}  # slot -> the rest of its prompt's script

    def begin(self, slot: int, prompt_ids: list[int], max_new_tokens: int | None = None) -> None:
        key = tuple(int(t) for t in prompt_ids)
        if key not in self.scripts:
            raise ValueError("scripted policy: no recorded choices for this prompt (record them on the same prompts)")
        self._left[slot] = list(self.scripts[key])

    def plan(self, rows: Rows) -> list[int]:
        return [self._left[b].pop(0) if self._left[b] else 0 for b in rows.slots]
