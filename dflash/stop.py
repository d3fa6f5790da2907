"""Stop and shutdown of every dflash process kind: the one module that installs SIGTERM/SIGINT handlers.

A stop signal never kills a dflash process mid-work; what it does depends on the process kind:

* any process, first thing at start-up (`install()` without `announce`): the signal is remembered while
  the process imports and loads, and the handler installed later takes it over (`requested`);
* a training process or the launcher (`install(announce)`): the signal asks for a stop, `announce(signum)`
  says so once; the trainer stops at the next step boundary (data-parallel ranks agree on it in their
  per-step all-reduce), the launcher passes it on to its ranks;
* a target rank (`hold()`): the signal is absorbed; the drafter ranks decide when to stop and tell it
  (STOP credits, distributed/transfer.py);
* work that a stop may cut short (an eval) calls `check()` between its pieces: it raises `Interrupted` once a
  stop is requested, and the caller skips the rest (a checkpoint never waits for an eval);
* `finished()`: the work is done; a late signal must not turn a clean exit into death by signal (CPython
  restores the default handlers while the interpreter shuts down).
"""

from __future__ import annotations

import signal
from collections.abc import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """This process's stop state; installed as the handler of SIGNALS."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.announce: Callable[[int], None] | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __call__(self, signum: int, _frame) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        if self.announce is not None:
            self.announce(signum)


_STOP = StopRequest()


def _installed() -> bool:
    return any(signal.getsignal(s) is _STOP for s in SIGNALS)


def install(announce: Callable[[int], None] | None = None) -> StopRequest:
    """Catch stop signals from now on. A signal already caught by an earlier `install()` of this process
    stays requested (start-up latch -> trainer); after `finished()` the state starts afresh."""
    if not _installed():
        _STOP.signum = None
    _STOP.announce = announce
    for s in SIGNALS:
        signal.signal(s, _STOP)
    return _STOP


def requested() -> bool:
    """Whether a stop signal arrived since the last `install()` started the state afresh."""
    return _installed() and _STOP.requested


class Interrupted(Exception):
    """A stop request cut the work under way short (raised by `check()`)."""


def check() -> None:
    """Raise `Interrupted` if a stop has been requested (a stop point inside work that may end early)."""
    if requested():
        raise Interrupted(f"signal {_STOP.signum}")


def _absorb(_signum, _frame) -> None:
    """A target rank's handler: nothing to do (and a handler, so the launcher sees it is ready)."""


def hold() -> None:
    """Target ranks: stop signals are absorbed; the drafter ranks tell this rank when to stop."""
    for s in SIGNALS:
        signal.signal(s, _absorb)


def finished() -> None:
    """The work is done (or failed): ignore stop signals for the rest of this process's life."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)


__all__ = ["SIGNALS", "StopRequest", "finished", "hold", "install", "requested"]
