"""Conversations in ShareGPT layout, and their rendering with a model's chat template."""

from __future__ import annotations

ROLE_OF = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
           "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}


def to_messages(conversation: list[dict]) -> list[dict]:
    """ShareGPT turns (``from``/``value``) -> chat messages (``role``/``content``)."""
    return [{"role": ROLE_OF[t["from"]], "content": t["value"]} for t in conversation]


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
