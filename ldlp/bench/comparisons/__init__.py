"""Comparisons: policies of this engine against each other and against the AR baseline. The evaluation of one
policy (``evaluate``, with its ``conversation``, ``categories`` and ``answers``), the head to head in turns
(``headtohead``) and several pooled (``pool``), the load sweep (``load_sweep``, its rows in ``load_aggregate``,
``peer_rows`` and ``step_costs``), open-loop serving (``serving``), and the studies on oracle labels: replay beside
a head to head (``replay_beside``) and the predictors (``predictors``, its rows in ``study_rows``).

May import ``ldlp.bench.harness``, ``eagle_backbone``, ``ldlp.models``, ``ldlp.policies`` and ``ldlp.labels``;
never ``ldlp.bench.peers``, ``ldlp.bench.measurements``, ``training``, ``report``, the pipeline or Lightning.
"""
