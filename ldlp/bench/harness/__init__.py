"""What every experiment shares: the engine factory (``engines``), the greedy-identity check (``identity``), the
paired-ratio interval and the other statistics (``stats``), the runners behind one signature (``runners``;
transformers' own generation, the AR baseline and the assisted peer, in ``peer``), the loaders of pairs, prompts and
policies (``loaders``), the contender parser (``contender``), continuous batching (``workload``), replay on oracle
labels and its tuner (``replay``), and the resident-memory sampler (``memory``).

May import ``eagle_backbone``, ``ldlp.models``, ``ldlp.policies`` and ``ldlp.labels``; never the other sub-packages
(``ldlp.bench.comparisons``, ``ldlp.bench.peers``, ``ldlp.bench.measurements``), ``training``, ``report``, the
pipeline or Lightning.
"""
