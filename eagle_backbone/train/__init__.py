"""Training the embedded pair: the small target and draft LM, the EAGLE drafter, and their model card.

May import the decoding core (``eagle_backbone``) and ``eagle_backbone.data``; never ``ldlp``.
"""
