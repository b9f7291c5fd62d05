"""Tables, plots and the generated results pages, from what ``bench`` wrote.

May import ``eagle_backbone``, ``ldlp.labels``, ``ldlp.models``, ``ldlp.policies`` and ``ldlp.bench``; never
``training`` or the pipeline. Nothing here runs a model.
"""
