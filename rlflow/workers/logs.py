"""The ``rlflow`` logger of a process, the driver's and each worker's: its level (``logging.level``)
and a plain handler when the application configured none.

Every rlflow module logs to ``logging.getLogger(__name__)``, under the ``rlflow`` logger. The
driver (:class:`~rlflow.trainer.Trainer`) and every worker call :func:`configure_logging` with the
run's level; Ray forwards a worker's stdout to the driver, so its messages show there too.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["LOG_LEVELS", "configure_logging"]

LOG_LEVELS = ("debug", "info", "warning", "error")


class _StdoutHandler(logging.StreamHandler):
    """Writes each message as it is to the ``sys.stdout`` of the moment (a notebook's or a test's capture
    replaces it), where the metrics' console line goes too."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # no stream of its own: the property reads sys.stdout
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):  # noqa: D102 - StreamHandler's attribute
        return sys.stdout


def configure_logging(level: str) -> None:
    """Sets the ``rlflow`` logger's level; gives it a plain handler printing to stdout unless logging
    is configured (a handler on ``rlflow`` or on the root logger: the application's configuration wins).

    Args:
        level: one of :data:`LOG_LEVELS`.

    >>> configure_logging("warning"); logging.getLogger("rlflow").level == logging.WARNING
    True
    """
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r}; expected one of {list(LOG_LEVELS)}")
    logger = logging.getLogger("rlflow")
    logger.setLevel(level.upper())
    ours = [h for h in logger.handlers if isinstance(h, _StdoutHandler)]
    if _configured_elsewhere(logger):
        for handler in ours:  # configured after an earlier run installed ours: no message twice
            logger.removeHandler(handler)
    elif not ours:
        logger.addHandler(_StdoutHandler())


def _configured_elsewhere(logger: logging.Logger) -> bool:
    """Whether a record of ``logger`` reaches a handler that is not ours (as ``Logger.hasHandlers`` walks)."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, _StdoutHandler) for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False
