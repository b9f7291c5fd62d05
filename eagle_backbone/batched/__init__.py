"""The engine's machinery for many slots: the compact Llama forward on preallocated per-slot KV caches
(``model``), continuous batching (``workload``), the measured step cost model (``cost``) and the load
benchmark (``bench``). The engine itself is :mod:`eagle_backbone.engine`.
May import only eagle_backbone core modules (target, drafter, candidates, sampling, policy, engine, metrics, io,
timing, runtime), torch and transformers (bench.py: matplotlib, lazily, for its plot)."""
