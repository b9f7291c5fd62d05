"""Conversations in and prompts out: readers of chat-data formats, the embedded corpus, the tokenizer.

May import only the standard library, ``datasets``, ``tokenizers`` and ``transformers``; nothing else of the project.
"""
