"""Engine measurements: the engine and the models themselves, not a policy. This engine against an earlier
commit's (``at_ref``), the attention routes and kernels at real prompt lengths (``attention``), the prefill join
and the per-component profile (``engine_profile``), the target's forward costs and batch invariance (``target``),
how often the target keeps each drafter choice in a tree (``tree_ranks``), and the embedded models' card
(``model_card``).

May import ``ldlp.bench.harness``, ``eagle_backbone``, ``ldlp.models``, ``ldlp.policies`` and ``ldlp.labels``;
never ``ldlp.bench.comparisons``, ``ldlp.bench.peers``, ``training``, ``report``, the pipeline or Lightning.
"""
