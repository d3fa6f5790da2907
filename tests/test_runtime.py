"""The runtime every multi-rank command shares: a stop that ends regenerate's work at once but never cuts a
shard write (dflash/runtime/stop.py), the one torchrun launcher (dflash/runtime/torchrun.py), the command's log stream
(dflash/logs.py)."""

import os
import signal
import sys
import threading
import time

import pytest

from dflash import logs
from dflash.runtime import stop, torchrun

pytestmark = pytest.mark.usefixtures("fresh_signal_handlers")  # tests/conftest.py


def test_under_raising_a_stop_ends_the_work_at_once():
    done = []
    with pytest.raises(stop.Stopped) as stopped, stop.raising():
        os.kill(os.getpid(), signal.SIGTERM)
        done.append("after the signal")  # never reached
    assert stopped.value.signum == signal.SIGTERM and done == []
    assert all(signal.getsignal(s) is signal.SIG_DFL for s in stop.SIGNALS)  # the handlers before are back


def test_a_stop_never_cuts_a_shielded_write_and_is_raised_after_it():
    written = []
    with pytest.raises(stop.Stopped), stop.raising():
        with stop.shielded():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing
            written.append("shard 3")  # the write goes on to its end
        written.append("shard 4")  # never started
    assert written == ["shard 3"] and stop._STOP.signum == signal.SIGINT


def test_a_stop_during_start_up_raises_when_the_work_begins():
    stop.install()  # the command's first thing: the start-up latch
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(stop.Stopped), stop.raising():
        pytest.fail("the work must not start after a stop")


def test_stopped_passes_through_except_exception():
    with pytest.raises(stop.Stopped), stop.raising():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        except Exception:  # noqa: BLE001 - a backend's own error handling must not swallow a stop
            pytest.fail("Stopped was caught as an Exception")


def test_without_a_signal_the_work_runs_through():
    with stop.raising(), stop.shielded():
        pass
    assert not stop._STOP.requested


def test_the_torchrun_command():
    assert torchrun.command(2, ["regenerate", "in.jsonl"]) == [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0", "--standalone",
        "-m", "dflash", "regenerate", "in.jsonl"]
    cmd = torchrun.command(4, ["train", "run.yaml"], ["--nnodes", "2"])
    assert "--standalone" not in cmd and cmd[7:9] == ["--nnodes", "2"] and cmd[-2:] == ["train", "run.yaml"]


def test_rank_env(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert torchrun.rank_env() == (0, 1) and not torchrun.under_torchrun()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert torchrun.rank_env() == (3, 4) and torchrun.under_torchrun()


WORKER = """
import pathlib, signal, sys, time
time.sleep(float(sys.argv[1]))  # start-up before the handler is in place
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
out = pathlib.Path(sys.argv[2])
out.write_text("ready")
while not got:
    time.sleep(0.01)
out.write_text(f"stopped by {got[0]}")
"""
# torchrun's stand-in: starts the workers, exits with the worst of their exits; it never gets the signal itself
FAKE_TORCHRUN = """
import subprocess, sys
workers = [subprocess.Popen([sys.executable, "-c", sys.argv[1], delay, out]) for delay, out in
           zip(sys.argv[2::2], sys.argv[3::2])]
sys.exit(max(w.wait() for w in workers))
"""


def test_the_launcher_passes_a_stop_to_each_worker_once_its_handler_is_installed(tmp_path, capsys):
    early, late = tmp_path / "early", tmp_path / "late"
    cmd = [sys.executable, "-c", FAKE_TORCHRUN, WORKER, "0", str(early), "3", str(late)]

    def stop_once_the_first_is_ready() -> None:
        deadline = time.monotonic() + 120
        while not early.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # the late worker has no handler yet: it must not die of it

    threading.Thread(target=stop_once_the_first_is_ready, daemon=True).start()
    polled = []
    rc = torchrun.run(cmd, 120, what="2 ranks", stop_note="stopping the ranks", poll=polled.append)
    assert rc == 0
    assert early.read_text() == late.read_text() == f"stopped by {signal.SIGTERM}"
    assert 2 in polled  # poll() saw both workers
    out = capsys.readouterr().out
    assert "dflash: starting 2 ranks: " in out and f"dflash: signal {signal.SIGTERM}: stopping the ranks" in out
    assert all(signal.getsignal(s) is signal.SIG_IGN for s in stop.SIGNALS)  # finished: a late signal is ignored


def test_a_launch_whose_workers_fail_returns_torchruns_exit(tmp_path):
    cmd = [sys.executable, "-c", "import sys; sys.exit(3)"]
    assert torchrun.run(cmd, 10) == 3


def test_the_log_stream_of_a_command(capsys):
    log = logs.get_logger("dflash.test_runtime")
    with logs.stream("stderr"):
        log.info("on stderr")
    log.info("on stdout")
    said = capsys.readouterr()
    assert said.err == "on stderr\n" and said.out == "on stdout\n"
    with pytest.raises(ValueError, match="log stream 'stdin'"):
        logs.set_stream("stdin")
