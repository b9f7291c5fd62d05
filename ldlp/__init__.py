"""The method: draft-length predictors (LDLP, acceptance head), the policies that use them, and what a
predictor costs next to a decoding step (``policy_cost``).

Stages, in data-flow order: ``labels`` (oracle draft lengths) → ``training`` (fit the predictors) →
policies here → ``bench`` (time them against static γ) → ``report`` (tables and pages); ``pipeline``
runs them all. Top-level modules import only ``eagle_backbone`` and each other, never a stage package.
"""
