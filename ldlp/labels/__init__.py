"""Oracle labels: the optimal draft length at every position (``oracle``), their files (``store``), the collector.

A collector returns its report and writes it as ``report.json``; its page is rendered by ``ldlp.report.labels``.

May import ``eagle_backbone`` and ``ldlp.models``; never Lightning, ``training``, ``bench`` or ``report``.
"""
