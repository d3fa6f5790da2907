"""The one logger of every dflash command (train, regenerate, eval): plain lines, rank-aware.

Every module logs through `get_logger(__name__)` (the `dflash` logger tree); this module gives that tree its
handler: every line exactly the message (the health check and the tests read these lines: `step N epoch E
loss ...`, `resumed from PATH at step N`, `done: step N`), on the command's log stream: stdout for `train`
(the run's log; stderr carries only a failing command's one-line error), stderr for a command whose stdout
carries its result (`regenerate`: `stream("stderr")`).

Under torchrun only the reporting rank (drafter rank 0) shows INFO lines, so a line is written once per job;
a line that belongs to one rank (a target rank's progress, an injected fault) is logged with
`extra=EVERY_RANK`. Warnings and errors are shown by every rank.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

EVERY_RANK = {"every_rank": True}
_ROOT = "dflash"


class _RankFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.reporter = True  # a single process reports everything

    def filter(self, record: logging.LogRecord) -> bool:
        return self.reporter or record.levelno >= logging.WARNING or getattr(record, "every_rank", False)


STREAMS = ("stdout", "stderr")


class _Stdout(logging.Handler):
    """The log stream (sys.stdout, or sys.stderr after `set_stream`) as it is at each line (pytest swaps it)."""

    stream_name = "stdout"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = getattr(sys, self.stream_name)
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must never stop training
            self.handleError(record)


_FILTER = _RankFilter()

# Loggers of optional libraries that speak at import time of things no dflash path uses. transformers imports
# torchao (drafter.float8) whenever it is installed, and torchao then reports C++ kernels built for another
# torch and a missing Triton; torch warns about torchao's pytree registrations. Their errors still show: a
# run's stderr keeps to dflash's own warnings and its one-line error.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def _install() -> logging.Logger:
    logger = logging.getLogger(_ROOT)
    if not any(isinstance(h, _Stdout) for h in logger.handlers):
        handler = _Stdout()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(_FILTER)
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the CLI's root handler would print every line twice
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    return logger


def set_reporter(reporter: bool) -> None:
    """Under torchrun: whether this rank shows INFO lines (the reporting rank does)."""
    _FILTER.reporter = reporter


def set_stream(name: str) -> str:
    """This process's log stream from now on: "stdout" (the default) or "stderr" (a command whose stdout is its
    result). Returns the previous one."""
    if name not in STREAMS:
        raise ValueError(f"log stream {name!r}: expected one of {STREAMS}")
    previous, _Stdout.stream_name = _Stdout.stream_name, name
    return previous


@contextmanager
def stream(name: str) -> Iterator[None]:
    """The log stream is `name` inside the block (a command run in-process, as the tests run the CLI)."""
    previous = set_stream(name)
    try:
        yield
    finally:
        set_stream(previous)


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` (a `dflash.*` module), with the rank-aware handler installed."""
    _install()
    return logging.getLogger(name)


__all__ = ["EVERY_RANK", "STREAMS", "get_logger", "set_reporter", "set_stream", "stream"]
