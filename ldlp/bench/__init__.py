"""Measuring policies and the engine, one place for every benchmark: loaders and runners, evaluate, head to
head, pooling, replay, the transformers and vLLM peers, stats; the load sweep (``load_sweep``: its checks and
runs over concurrency and temperature; ``load_aggregate``: the runs as rows, findings and the rows of its page,
which ``ldlp.report.load_sweep`` writes; ``workload``: continuous batching; ``peer_rows``: peer engines' rows),
the engine's own prefill-join and component profile (``engine_profile``), the target's forward costs
(``target``) and the embedded models' card (``model_card``). What every experiment shares: one paired-ratio
interval (``stats.paired_ratio``), one greedy-identity check (``identity``), one engine factory (``engines``)
and one in-turns runner (``eagle_backbone.timing.interleaved``). It measures and returns rows; every page is
rendered in ``ldlp.report``.

May import ``eagle_backbone``, ``ldlp.models``, ``ldlp.policies`` and ``ldlp.labels``; never ``training`` or ``report``.
"""
