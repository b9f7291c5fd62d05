"""The decoding core: target, drafters (EAGLE-1, draft LM), candidate generation, sampling and
verification, the engine (S slots at once; batch 1 is one slot), the draft-length policy interface, metrics, loading, I/O, runtime settings and
timing (``timing``: the one interleaved runner every comparison of timings uses).

May import torch, transformers, safetensors and omegaconf; never ``ldlp``. Subpackages: ``data``
(conversations, corpus, tokenizer), ``train`` (the embedded pair), ``batched`` (the engine's compact model on per-slot caches, continuous
batching, the step cost model, the load benchmark).
"""
