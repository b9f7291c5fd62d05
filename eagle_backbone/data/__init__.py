"""Conversations in and prompts out: readers of chat-data formats, the embedded corpus, the tokenizer.

May import only the standard library, ``datasets``, ``tokenizers``, ``transformers``, ``eagle_backbone.io`` and ``eagle_backbone.paths``; nothing else of the project.
"""
