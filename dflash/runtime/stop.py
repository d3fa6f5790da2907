"""Stop and shutdown of every dflash process kind: the one module that installs SIGTERM/SIGINT handlers.

A stop signal never kills a dflash process mid-work; what it does depends on the process kind:

* any process, first thing at start-up (`install()` without `announce`): the signal is remembered while
  the process imports and loads, and the handler installed later takes it over (`requested`);
* a training process or the launcher (`install(announce)`): the signal asks for a stop, `announce(signum)`
  says so once; the trainer stops at the next step boundary (data-parallel ranks agree on it in their
  per-step all-reduce), the launcher passes it on to its ranks;
* a target rank (`hold()`): the signal is absorbed; the drafter ranks decide when to stop and tell it
  (STOP credits, runtime/transfer.py);
* work that a stop may cut short (an eval) calls `check()` between its pieces: it raises `Interrupted` once a
  stop is requested, and the caller skips the rest (a checkpoint never waits for an eval);
* work that a stop ends at once (`raising()`: a regenerate rank, whose shard in flight is simply redone by the
  rerun): the signal raises `Stopped` in the main thread, except inside `shielded()` (a shard file being
  written), which a stop never cuts: it is raised when the write is done;
* `finished()`: the work is done; a late signal must not turn a clean exit into death by signal (CPython
  restores the default handlers while the interpreter shuts down).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
    """A stop signal ended work run under `raising()` (a BaseException: no `except Exception` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class StopRequest:
    """This process's stop state; installed as the handler of SIGNALS."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.announce: Callable[[int], None] | None = None
        self.raising = False  # inside `raising()`
        self.shield = 0  # depth of `shielded()` blocks
        self.raised = False  # `Stopped` was raised for this request (once)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __call__(self, signum: int, _frame) -> None:
        if self.signum is None:
            self.signum = signum
            if self.announce is not None:
                self.announce(signum)
        if self.raising and not self.shield:
            self.raise_stopped()

    def raise_stopped(self) -> None:
        if not self.raised:
            self.raised = True
            raise Stopped(self.signum)


_STOP = StopRequest()


def _installed() -> bool:
    return any(signal.getsignal(s) is _STOP for s in SIGNALS)


def install(announce: Callable[[int], None] | None = None) -> StopRequest:
    """Catch stop signals from now on. A signal already caught by an earlier `install()` of this process
    stays requested (start-up latch -> trainer); after `finished()` the state starts afresh."""
    if not _installed():
        _STOP.signum = None
        _STOP.raised = False
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


@contextmanager
def raising(announce: Callable[[int], None] | None = None) -> Iterator[StopRequest]:
    """Work that a stop ends at once: inside the block a stop signal raises `Stopped` in the main thread (a stop
    already requested, e.g. caught by the start-up `install()`, raises on entry), except inside `shielded()`.
    The handlers in place before are restored on exit (a command run in-process, as the tests run the CLI)."""
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    request = install(announce)
    request.raising, request.shield = True, 0
    try:
        if request.requested:
            request.raise_stopped()
        yield request
    finally:
        request.raising = False
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


@contextmanager
def shielded() -> Iterator[None]:
    """A write a stop must never cut (a regenerate shard file): under `raising()`, a stop that arrives inside
    the block is raised as `Stopped` once the block has finished."""
    _STOP.shield += 1
    try:
        yield
    finally:
        _STOP.shield -= 1
    if _STOP.raising and not _STOP.shield and _STOP.requested:
        _STOP.raise_stopped()


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


__all__ = ["SIGNALS", "StopRequest", "Stopped", "finished", "hold", "install", "raising", "requested", "shielded"]
