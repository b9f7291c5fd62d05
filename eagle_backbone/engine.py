"""The engine's public names, importable from here as they were when the engine was one module
(``from eagle_backbone.engine import ...``): :class:`BatchedSpeculativeEngine` (S slots at once;
:mod:`eagle_backbone.batched_engine`, whose docstring gives the step), :class:`SpeculativeDecoder` and
:func:`autoregressive_generate` (one sequence at a time; :mod:`eagle_backbone.decoder`) and
:class:`GenerationOutput` (:mod:`eagle_backbone.step_records`).

The engine's modules: ``batched_engine`` (the step and its phases), ``step_records`` (what the phases pass
on), ``prefill`` (prefill scheduling), ``tree_step`` (the phases for draft trees), ``decoder`` (batch 1),
and its clocks in ``timing``. The project's own code imports from those (``ldlp.bench.measurements.at_ref`` reads
another commit's engine through this module's name, so keep it).
"""

from __future__ import annotations

from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.decoder import SpeculativeDecoder, autoregressive_generate
from eagle_backbone.step_records import GenerationOutput

__all__ = ["BatchedSpeculativeEngine", "GenerationOutput", "SpeculativeDecoder", "autoregressive_generate"]
