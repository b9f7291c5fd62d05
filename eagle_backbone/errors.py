"""The project's own error types: a bad setting or input, named in one line (what, where, what to do).

Scripts print these as one ``error:`` line (``scripts/_setup.py``), the traceback only with
``HYDRA_FULL_ERROR=1``.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting or input the run cannot use; the message names the key, file or stage and what to do."""


class MissingCheckpoint(ConfigError):
    """A policy's checkpoint that this clone has not trained (or fetched) yet: a benchmark may skip that
    contender, saying so, where any other error must stop the run."""


class MissingInput(FileNotFoundError, ConfigError):
    """An input file the run needs is not there (a data file, a generated corpus): still a FileNotFoundError
    to callers, and one ``error:`` line from a script."""
