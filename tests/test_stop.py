"""dflash/runtime/stop.py: the one owner of stop signals (start-up latch, trainer, target ranks, shutdown)."""

import os
import signal

import pytest

from dflash.runtime import stop

pytestmark = pytest.mark.usefixtures("fresh_signal_handlers")  # tests/conftest.py


def test_a_signal_during_start_up_is_kept_by_the_trainers_handler():
    stop.install()  # the launcher, first thing
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested()
    said = []
    request = stop.install(said.append)  # the trainer, after loading: the request carries over
    assert request.requested and request.signum == signal.SIGTERM and said == []
    os.kill(os.getpid(), signal.SIGINT)
    assert said == [] and request.signum == signal.SIGTERM  # announced once, the first signal kept


def test_the_trainer_announces_the_first_signal_once():
    said = []
    stop.install(said.append)
    assert not stop.requested()
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
    assert said == [signal.SIGINT] and stop.requested()


def test_after_finished_signals_are_ignored_and_a_new_run_starts_afresh():
    stop.install()
    os.kill(os.getpid(), signal.SIGTERM)
    stop.finished()
    assert all(signal.getsignal(s) is signal.SIG_IGN for s in stop.SIGNALS)
    os.kill(os.getpid(), signal.SIGTERM)  # ignored: the test process lives on
    assert not stop.requested()
    assert not stop.install().requested  # a later run in this interpreter does not inherit the old request


def test_target_ranks_absorb_signals_with_a_handler():
    stop.hold()
    handlers = [signal.getsignal(s) for s in stop.SIGNALS]
    assert all(callable(h) for h in handlers)  # a handler, so the launcher sees the rank ready for its signal
    os.kill(os.getpid(), signal.SIGTERM)
    assert not stop.requested()
