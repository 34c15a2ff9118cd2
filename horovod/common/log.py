"""Runtime logging in upstream's line format: ``[time: L file:line] message``.

TRACE/DEBUG/INFO go to stdout, WARNING and above to stderr, as upstream does.

Must not touch: the root logger or other libraries' logging, any layer above it.
"""

from __future__ import annotations

import logging
import sys

TRACE = 5
logging.addLevelName(TRACE, "TRACE")
_LEVELS = {
    "TRACE": TRACE,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}

logger = logging.getLogger("horovod")


class _Formatter(logging.Formatter):
    def __init__(self, hide_time: bool) -> None:
        super().__init__()
        self.hide_time = hide_time

    def format(self, record: logging.LogRecord) -> str:
        letter = record.levelname[0] if record.levelname != "CRITICAL" else "F"
        where = f"{record.filename}:{record.lineno}"
        if self.hide_time:
            head = f"[{letter} {where}]"
        else:
            head = f"[{self.formatTime(record, '%Y-%m-%d %H:%M:%S')}.{int(record.msecs * 1000):06d}: {letter} {where}]"
        text = f"{head} {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _MaxLevel(logging.Filter):
    def __init__(self, below: int) -> None:
        super().__init__()
        self.below = below

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.below


def configure(level: str = "WARNING", hide_time: bool = False) -> None:
    """(Re)configure the ``horovod`` logger; called by ``hvd.init()`` from the Config."""
    for h in list(logger.handlers):
        if getattr(h, "_horovod", False):
            logger.removeHandler(h)
    out = logging.StreamHandler(sys.stdout)
    out.addFilter(_MaxLevel(logging.WARNING))
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    for h in (out, err):
        h.setFormatter(_Formatter(hide_time))
        h._horovod = True  # type: ignore[attr-defined]
        logger.addHandler(h)
    logger.setLevel(_LEVELS.get(level.upper(), logging.WARNING))
    logger.propagate = False
