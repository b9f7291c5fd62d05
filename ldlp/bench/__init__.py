"""Measuring policies and the engine, one place for every benchmark, in sub-packages by the kind of experiment:

* ``harness``: what every experiment shares: one engine factory (``engines``), one greedy-identity check
  (``identity``), one paired-ratio interval (``stats.paired_ratio``), the runners behind one signature
  (``runners``; transformers' generation, the AR baseline and the assisted peer, in ``peer``), the loaders, the
  contender parser (``contender``), continuous batching (``workload``), replay on oracle labels and its tuner
  (``replay``) and the resident-memory sampler (``memory``); the in-turns runner is
  ``eagle_backbone.timing.interleaved``;
* ``comparisons``: policies of this engine against each other: evaluate (with its questions, categories and
  answer files), head to head and pooling, the load sweep (``load_sweep``: its checks and runs over concurrency
  and temperature; ``load_aggregate``: the runs as rows, findings and the rows of its page, which
  ``ldlp.report.load_sweep`` writes; ``peer_rows``: peer engines' rows; ``step_costs``: the cost model's
  accuracy), open-loop serving, and the studies on oracle labels (replay beside a head to head, the predictors);
* ``peers``: other engines and drafters on the same target: vLLM (the peer, its worker, the Dynamic SD schedule
  and its tuning) and the drafters in turns (EAGLE-1 against EAGLE-3);
* ``measurements``: the engine and the models themselves: the engine against an earlier commit's (``at_ref``),
  the attention routes, the prefill join and component profile (``engine_profile``), the target's forward costs
  (``target``), tree ranks and the embedded models' card (``model_card``).

The harness imports no other sub-package; ``comparisons`` and ``measurements`` import the harness only; ``peers``
imports the harness and ``comparisons`` (the vLLM peer runs as a contender of the load sweep and of serving). It
measures and returns rows; every page is rendered in ``ldlp.report``.

May import ``eagle_backbone``, ``ldlp.models``, ``ldlp.policies`` and ``ldlp.labels``; never ``training`` or ``report``.
"""
