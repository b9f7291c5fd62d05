"""The decoding core: target, drafters (EAGLE-1, draft LM), candidate generation, sampling and
verification, the engine, the draft-length policy interface, metrics, loading, I/O and runtime settings.

May import torch, transformers, safetensors and omegaconf; never ``ldlp``. Subpackages: ``data``
(conversations, corpus, tokenizer), ``train`` (the embedded pair), ``batched`` (many sequences at once).
"""
