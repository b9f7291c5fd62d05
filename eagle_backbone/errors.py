"""The project's own error types: a bad setting or input, named in one line (what, where, what to do).

Scripts print these as one ``error:`` line (``scripts/_setup.py``), the traceback only with
``HYDRA_FULL_ERROR=1``.

A learned file made for another setup than the one it would drive (:func:`mismatch`) is refused the same way,
unless the run sets ``accept_mismatch=true``: then it is a warning, and the run's results record it
(:func:`accepted_mismatches`).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A setting or input the run cannot use; the message names the key, file or stage and what to do."""


class MissingCheckpoint(ConfigError):
    """A policy's checkpoint that this clone has not trained (or fetched) yet: a benchmark may skip that
    contender, saying so, where any other error must stop the run."""


class MissingInput(FileNotFoundError, ConfigError):
    """An input file the run needs is not there (a data file, a generated corpus): still a FileNotFoundError
    to callers, and one ``error:`` line from a script."""


class Mismatch(ConfigError):
    """A learned file (a step-cost model, a tuned policy file...) made for another setup than the one it would
    drive; the message names the file and both sides."""


_ACCEPT = {"on": False}
_ACCEPTED: list[str] = []


def accept_mismatches(accept) -> None:
    """The run's ``accept_mismatch`` setting (``scripts/_setup.py`` sets it first, from the config; None: false):
    whether :func:`mismatch` warns and records instead of refusing. Forgets what an earlier run of this process
    accepted (a Hydra multirun runs several)."""
    if accept is None:
        accept = False
    if not isinstance(accept, bool):  # a YAML 'maybe' is a string: not true
        raise ConfigError(f"accept_mismatch must be true or false, got {accept!r}")
    _ACCEPT["on"] = accept
    _ACCEPTED.clear()


def mismatch(message: str) -> None:
    """A learned file made for another setup (``message``: one line naming the file and both sides): refused
    (:class:`Mismatch`), or under ``accept_mismatch=true`` a warning, recorded for the run's results."""
    if not _ACCEPT["on"]:
        raise Mismatch(f"{message}; accept_mismatch=true runs it anyway, recorded in the results")
    if message not in _ACCEPTED:
        log.warning("accept_mismatch=true: %s", message)
        _ACCEPTED.append(message)


def accepted_mismatches() -> list[str]:
    """The mismatches this run accepted (``accept_mismatch=true``), each its one-line message, in order."""
    return list(_ACCEPTED)
