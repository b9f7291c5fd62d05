"""The decoding core: target, drafters (EAGLE-1, EAGLE-3, draft LM), the compact Llama forward on per-slot KV caches
(``llama``, ``ragged``), candidate generation (``candidates``: the interface; ``drafter_kinds``: the drafter kinds by
name), sampling and verification, the engine (S slots at once,
``batched_engine``, its phases' records in ``step_records``, its prefill scheduling in ``prefill``, its tree
phases in ``tree_step``; batch 1 is one slot, ``decoder``; ``engine`` re-exports the public names), the
draft-length policy protocol (``policy``), step costs (``cost``: the profiled table and its profiler;
``step_cost``: the online model fitted to the engine's timed steps, and the one least-squares solve), metrics, loading,
I/O, runtime settings and timing (``timing``: the one interleaved runner every comparison of timings uses,
and the engine's clocks).

May import torch, transformers, safetensors and omegaconf; never ``ldlp``. No module here imports matplotlib
or writes Markdown: benchmarks and workloads live in ``ldlp.bench``, pages and plots in ``ldlp.report``. Subpackages:
``data`` (conversations, corpus, tokenizer), ``train`` (the embedded pair) and ``kinds`` (the drafter kinds, one
file each: EAGLE-1, EAGLE-3, the draft LM); each imports the core, and the core imports none of them (the registry,
``drafter_kinds``, imports the kinds' modules by name at run time).
"""
