"""The method's trained models and what they cost: the LDLP (``predictor``), the acceptance heads
(``acceptance``), the online calibration of their probabilities (``calibration``), and a predictor's cost next
to a decoding step (``policy_cost``). Their checkpoints are folders of ``config.json`` + safetensors.

May import ``eagle_backbone`` only; never another ``ldlp`` package (labels, training, policies, bench, report
and the pipeline import these, not the reverse).
"""
