"""Measuring policies: loaders and runners, evaluate, head to head, pooling, replay, the transformers peer, stats.

May import ``eagle_backbone``, ``ldlp``'s top-level modules and ``ldlp.labels``; never ``training`` or ``report``.
"""
