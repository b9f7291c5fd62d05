"""What every script does first (``start(cfg)``): its torch threads from ``cfg.threads``, set once before
any work; known-harmless third-party notices silenced; a missing model folder stopped with one line;
``cfg.accept_mismatch`` in force (eagle_backbone/errors.py).

``@one_line_errors`` (under ``@hydra.main``) turns the project's own ``ValueError``s (``ConfigError``,
``DataError`` and every ``ValueError`` raised from this repository's code) into one ``error:`` line and exit
status 1; ``HYDRA_FULL_ERROR=1`` keeps the traceback."""

from __future__ import annotations

import functools
import logging
import os
import sys
import warnings
from pathlib import Path

import eagle_backbone.paths  # noqa: F401  (registers ${repo:...} and ${model_folder:...})
from eagle_backbone.errors import accept_mismatches
from eagle_backbone.runtime import check_device, resolve_model_dtype, set_threads

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


def start(cfg, loads_models: bool = True) -> int:
    """Every script's first call; returns the thread count in force. ``loads_models``: the script loads the models
    of ``cfg.model`` (a CUDA device on a machine without one is refused here, in one line); False for scripts that
    only read results (publishing a GPU run's pages on a CPU machine is fine)."""
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
        try:  # model.dtype=auto becomes the dtype the models load in, so every record names the one used
            if loads_models and model.get("device") is not None:
                check_device(model.get("device"))
            resolve_model_dtype(model)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    try:  # a learned file made for another setup: refused, or with accept_mismatch=true taken and recorded
        accept_mismatches(cfg.get("accept_mismatch"))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return set_threads(cfg.get("threads"))


_REPO = Path(__file__).resolve().parent.parent
_OWN = tuple(str(_REPO / d) + os.sep for d in ("eagle_backbone", "ldlp", "scripts"))


def _own_value_error(e: BaseException) -> ValueError | None:
    """The project's own ValueError behind ``e`` (Hydra's instantiation wrapper unwrapped), or None: a
    ConfigError anywhere, or a ValueError raised in this repository's code (not in a library)."""
    from eagle_backbone.errors import ConfigError

    for _ in range(4):  # InstantiationException -> the policy's own error
        if isinstance(e, ConfigError):
            return e
        if isinstance(e, ValueError):
            tb, where = e.__traceback__, None
            while tb is not None:
                where, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
            return e if where and os.path.abspath(where).startswith(_OWN) else None
        if e.__cause__ is None:
            return None
        e = e.__cause__
    return None


def error_line(e: BaseException) -> str:
    """One line for a user: the message's first line, prefixed ``error:``."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return f"error: {first}"


def one_line_errors(main):
    """Decorate a Hydra task function: the project's own ValueErrors end the script with one ``error:`` line
    on stderr and exit status 1 (``HYDRA_FULL_ERROR=1``: the traceback, as Hydra prints it)."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except Exception as e:
            own = _own_value_error(e)
            if own is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(error_line(own), file=sys.stderr, flush=True)
            raise SystemExit(1) from None

    return wrapped
