"""Oracle labels: the optimal draft length at every position (``oracle``), their files (``store``), the collector.

May import ``eagle_backbone`` and ``ldlp.models``; never Lightning, ``training``, ``bench`` or ``report``.
"""
