"""Oracle labels: the optimal draft length at every position (``oracle``), their files (``store``), the collector.

May import ``eagle_backbone`` and ``ldlp``'s top-level modules; never Lightning, ``training``, ``bench`` or ``report``.
"""
