"""Tables, plots and the generated results pages, from what ``bench`` wrote.

May import ``eagle_backbone.io`` and ``ldlp.bench``; nothing runs a model here.
"""
