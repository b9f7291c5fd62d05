"""Every page and plot: tables, plots and the generated results pages from what ``bench`` wrote, and the pages
of the label collections (``labels.py``) and trained predictors (``training.py``) from the reports their stages
return. The scripts (or the pipeline) that run a stage write its page with these; no other package renders one.

May import ``eagle_backbone``, ``ldlp.labels``, ``ldlp.models``, ``ldlp.policies`` and ``ldlp.bench``; never
``training`` or the pipeline. Nothing here runs a model.
"""
