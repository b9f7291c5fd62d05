"""Training the embedded pair: the small target and draft LM, and the EAGLE drafter (their model card is
measured by ``ldlp.bench.measurements.model_card``).

May import the decoding core (``eagle_backbone``) and ``eagle_backbone.data``; never ``ldlp``.
"""
