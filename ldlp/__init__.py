"""The method: oracle labels, the draft-length predictors, the policies that use them, and their measurement.

Packages, in data-flow order: ``labels`` (oracle draft lengths) → ``training`` (fit the predictors) →
``models`` (the LDLP, the acceptance heads, their calibration and checkpoints) → ``policies`` (threshold,
load-aware, trees, oracles) → ``bench`` (time them against static γ) → ``report`` (every table, plot and page);
``pipeline`` runs them all. No two packages import each other (``tests/test_layout.py``).
"""
