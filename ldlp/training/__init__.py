"""Fitting the predictors on oracle labels: the LDLP with Lightning, the acceptance head and baselines with scikit-learn.

A fit returns its metrics and writes them as ``metrics.json``; their page is rendered by ``ldlp.report.training``.

May import ``eagle_backbone``, ``ldlp.models`` and ``ldlp.labels``; never ``policies``, ``bench`` or ``report``.
"""
