"""Peers: other engines and other drafters on the same target, prompts and budgets. vLLM's own AR and EAGLE
(``vllm_peer``, run in a process of its own by ``vllm_worker``), its Dynamic SD schedule (``vllm_schedule``) and
the schedule's tuning on this machine (``vllm_tune``); the drafters in turns, EAGLE-1 against EAGLE-3
(``drafters``). The vLLM peer runs as a contender of the load sweep and of serving, so this imports
``comparisons``; transformers' assisted generation is a runner of the harness (``ldlp.bench.harness.peer``).

May import ``ldlp.bench.comparisons``, ``ldlp.bench.harness``, ``eagle_backbone``, ``ldlp.models``,
``ldlp.policies`` and ``ldlp.labels``; never ``ldlp.bench.measurements``, ``training``, ``report``, the pipeline or
Lightning.
"""
