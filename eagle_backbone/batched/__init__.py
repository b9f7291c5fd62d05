"""Batched speculative decoding: B sequences decode at once, each with its own γ, on preallocated per-slot KV caches.
May import only eagle_backbone core modules (target, drafter, sampling, policy, engine, metrics, io), torch and transformers (bench.py: matplotlib, lazily, for its plot)."""
