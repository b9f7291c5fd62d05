"""Measuring policies and the engine, one place for every benchmark: loaders and runners, evaluate, head to
head, pooling, replay, the transformers and vLLM peers, stats; the load sweep (``load_sweep``: sweeps over
concurrency, its Markdown page, findings and plots; ``workload``: continuous batching; ``peer_rows``: peer
engines' rows on its page), the target's forward costs (``target``) and the embedded models' card
(``model_card``).

May import ``eagle_backbone``, ``ldlp.models``, ``ldlp.policies`` and ``ldlp.labels``; never ``training`` or ``report``.
"""
