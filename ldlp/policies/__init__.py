"""Draft-length policies, one class and one YAML under ``conf/policy/`` each, all to the protocol of
:mod:`eagle_backbone.policy`: the threshold rules and the LDLP (``threshold``), the cost-driven policies
(``load_aware``), draft trees (``trees``) and the upper bounds (``oracles``).

May import ``eagle_backbone`` and ``ldlp.models``; never ``labels``, ``training``, ``bench``, ``report`` or
the pipeline.
"""
