"""A byte-level BPE for the embedded models, saved as a Hugging Face tokenizer with a Vicuna chat template."""

from __future__ import annotations

import os
from collections.abc import Iterable

from eagle_backbone.io import atomic_path

# Vicuna v1.1 layout: "{system} USER: {q} ASSISTANT: {a}</s>USER: ...". An explicit system turn
# replaces the default system prompt. The generation prompt ends at "ASSISTANT:" so the first
# answer token carries its leading space, exactly as in training text.
DEFAULT_SYSTEM = "A chat between a user and a Python assistant."
VICUNA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{ messages[0]['content'] + ' ' }}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{{ '" + DEFAULT_SYSTEM + " ' }}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for m in loop_messages -%}"
    "{%- if m['role'] == 'user' -%}{{ 'USER: ' + m['content'] + ' ' }}"
    "{%- else -%}{{ 'ASSISTANT: ' + m['content'] + eos_token }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)
SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike):
    """Train a byte-level BPE on ``texts`` and save it; returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=VICUNA_CHAT_TEMPLATE, **SPECIAL_TOKENS)
    with atomic_path(out_dir) as tmp:
        hf.save_pretrained(str(tmp))
    return hf
