"""What every script does first (``start(cfg)``): its torch threads from ``cfg.threads``, set once before
any work; known-harmless third-party notices silenced; a missing model folder stopped with one line."""

from __future__ import annotations

import logging
import warnings

import eagle_backbone.paths  # noqa: F401  (registers ${repo:...} and ${model_folder:...})
from eagle_backbone.runtime import set_threads

# (logger, start of the message): notices that say nothing about this run
_HARMLESS = (
    # Lightning advertises its cloud services when a Trainer starts
    ("lightning.fabric.utilities.rank_zero", "💡 Tip:"),
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip:"),
    # transformers' own assisted generation (the peer rows) calls the assistant's generate with a
    # generation_config and explicit arguments, and then warns about it itself
    ("transformers.generation.utils", "Passing `generation_config` together with generation-related arguments"),
)


class _Drop(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_third_party() -> None:
    # torch deprecates LeafSpec, which Lightning's own pytree helper still builds (nothing to fix here)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    try:  # transformers draws a "Loading weights" bar for every model a stage loads
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    for name, prefix in _HARMLESS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_Drop(prefix))


def start(cfg) -> int:
    """Every script's first call; returns the thread count in force."""
    from omegaconf.errors import InterpolationResolutionError

    quiet_third_party()
    model = cfg.get("model")
    if model is not None and hasattr(model, "get"):
        for key in ("target", "tokenizer", "drafter"):
            try:
                model.get(key)
            except InterpolationResolutionError as e:  # e.g. VICUNA_PATH unset: say so in one line
                why = str(e.__cause__ or e).split(" raised while resolving interpolation: ")[-1].splitlines()[0]
                raise SystemExit(f"error: model.{key}: {why}") from None
    return set_threads(cfg.get("threads"))
