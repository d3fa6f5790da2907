"""The ranks' setups end together before their first collective (dflash/runtime/setup_barrier.py).

In-process: "ranks" are threads, each with its own client of one real TCPStore, with short beats and timeouts.
End to end: a real 2-rank job whose rank 0 sets up longer than topology.timeout_s trains; before the barrier,
rank 1's first all-reduce timed out and the job failed at its start.
"""

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from dflash.runtime import failures, setup_barrier
from dflash.runtime.setup_barrier import SetupBarrier, SetupPeerLost
from dflash.training.worker import is_peer_failure

FAST = {"beat_s": 0.05, "poll_s": 0.02, "report_s": 0.3}


@pytest.fixture
def stores():
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)

    def client():
        return dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))

    yield client  # `client` holds the server: it lives until the test's ranks are done with it


def run_rank(barrier: SetupBarrier, setup_s: float, out: dict, key: int) -> None:
    try:
        barrier.begin()
        time.sleep(setup_s)
        out[f"done {key}"] = time.monotonic()  # its setup ends here
        barrier.wait()
        out[key] = time.monotonic()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out[key] = exc


def test_a_rank_whose_setup_is_longer_than_the_timeout_is_waited_for(stores):
    out: dict = {}
    ranks = [threading.Thread(target=run_rank, args=(SetupBarrier(stores(), r, 3, timeout_s=1.0, **FAST), s, out, r))
             for r, s in ((0, 2.5), (1, 0.0), (2, 0.2))]  # rank 0 sets up 2.5x the timeout longer than rank 1
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(30)
    assert all(isinstance(out[r], float) for r in range(3)), out
    # nobody passed before the slowest rank's setup had ended
    assert min(out[r] for r in range(3)) >= out["done 0"]


def test_a_rank_that_stops_beating_during_its_setup_is_named_after_the_timeout(stores):
    peer = SetupBarrier(stores(), 1, 2, timeout_s=0.4, **FAST).begin()
    time.sleep(0.2)
    peer.end()  # it died during its setup: no more beats, never done
    waiting = SetupBarrier(stores(), 0, 2, timeout_s=0.4, **FAST).begin()
    t0 = time.monotonic()
    with pytest.raises(SetupPeerLost, match=r"rank 1 stopped during its setup: no sign of it in the job's store "
                                            r"for \d+s \(timed out after topology.timeout_s=0.4s\)") as err:
        waiting.wait()
    assert time.monotonic() - t0 >= 0.4  # it waited the timeout for a sign of the peer first
    # a lost peer, classed as a collective timeout (exit 5), like a collective that timed out
    assert is_peer_failure(err.value) and failures.classify(err.value) == "collective_timeout"
    assert waiting._thread is not None and not waiting._thread.is_alive()  # its own beats end with the wait


def test_the_waiting_rank_says_whom_it_waits_for(stores, caplog):
    out: dict = {}
    slow = threading.Thread(target=run_rank, args=(SetupBarrier(stores(), 1, 2, timeout_s=5, **FAST), 0.8, out, 1))
    slow.start()
    with caplog.at_level("INFO"):
        SetupBarrier(stores(), 0, 2, timeout_s=5, **FAST).begin().wait()
    slow.join(10)
    assert "rank 0: set up; waiting 0s so far for rank(s) 1 to finish their setup" in caplog.text
    assert "rank 0: every rank set up after" in caplog.text


def test_wait_returns_at_once_when_passed_or_when_there_is_no_barrier(stores, monkeypatch):
    barriers = [SetupBarrier(stores(), r, 2, timeout_s=1, **FAST).begin() for r in range(2)]
    done = threading.Thread(target=barriers[1].wait)
    done.start()
    barriers[0].wait()
    done.join(5)
    barriers[0].store = None  # a second first collective (connect, then wrap) does not even read the store
    barriers[0].wait()
    monkeypatch.setattr(setup_barrier, "_CURRENT", None)
    setup_barrier.wait()  # one process, no process group: nothing to wait for
