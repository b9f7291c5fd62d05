"""Fitting the predictors on oracle labels: the LDLP with Lightning, the acceptance head and baselines with scikit-learn.

May import ``eagle_backbone``, ``ldlp.models`` and ``ldlp.labels``; never ``policies``, ``bench`` or ``report``.
"""
