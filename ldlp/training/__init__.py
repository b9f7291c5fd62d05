"""Fitting the predictors on oracle labels: the LDLP with Lightning, the acceptance head and baselines with scikit-learn.

May import ``eagle_backbone``, ``ldlp``'s top-level modules and ``ldlp.labels``; never ``bench`` or ``report``.
"""
