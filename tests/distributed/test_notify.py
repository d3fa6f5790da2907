"""The trainer's liveness for systemd's watchdog (dflash/runtime/notify.py): the sd_notify datagrams a single process
sends, and under torchrun the launcher's aggregate, which stops when one rank hangs."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflash.runtime.notify import Notifier, RankLiveness, parse

ROOT = Path(__file__).resolve().parents[2]


def test_the_supervisors_copy_of_parse_reads_datagrams_alike():
    """module_utils/dflash_supervisor.py runs on its own (standard library only), so it has its own parse."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_dflash_supervisor", ROOT / "module_utils" / "dflash_supervisor.py")
    supervisor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(supervisor)
    for data in (b"", b"READY=1", b"WATCHDOG=1\nSTATUS=step 3\n", b"X=a=b\nno field\r\nY=", "É=\xff".encode("latin-1")):
        assert supervisor.parse_notify(data) == parse(data), data


@pytest.fixture
def supervisor():
    """A NOTIFY_SOCKET as systemd offers one (abstract namespace); returns (address, receive)."""
    name = f"@dflash-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name[1:])
    sock.settimeout(0.05)

    def receive(seconds=0.3):
        got, deadline = [], time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                got.append(parse(sock.recv(4096)))
            except TimeoutError:
                pass
        return got

    yield name, receive
    sock.close()


def test_without_a_socket_nothing_is_sent():
    n = Notifier({})
    assert not n.enabled and n.send(WATCHDOG=1) is False
    n.loading()
    n.step(1)


def test_start_up_allowance_then_ready_with_the_steady_interval_then_pings(supervisor):
    address, receive = supervisor
    n = Notifier({"NOTIFY_SOCKET": address, "DFLASH_WATCHDOG_SEC": "30", "DFLASH_WATCHDOG_START_SEC": "900"})
    n.loading()
    n.step(1)
    n.step(2)
    got = receive()
    assert got[0] == {"WATCHDOG_USEC": "900000000", "STATUS": "loading"}
    assert got[1] == {"READY": "1", "WATCHDOG_USEC": "30000000", "WATCHDOG": "1", "STATUS": "training, step 1"}
    assert got[2] == {"WATCHDOG": "1", "STATUS": "training, step 2"}


def test_the_launcher_pings_only_when_every_step_loop_rank_did(supervisor):
    address, receive = supervisor
    upstream = Notifier({"NOTIFY_SOCKET": address, "DFLASH_WATCHDOG_SEC": "10"})
    liveness = RankLiveness(upstream, expected={1, 2})
    env = liveness.environment()
    ranks = {r: Notifier({**env, "RANK": str(r)}) for r in (1, 2)}
    ranks[1].step(1)
    liveness.poll()
    assert receive(0.1) == []  # rank 2 is not ready yet: nothing is true of the whole job
    ranks[2].step(1)
    time.sleep(0.05)
    liveness.poll()
    assert receive(0.1) == [{"READY": "1", "WATCHDOG_USEC": "10000000", "WATCHDOG": "1", "STATUS": "training, step 1"}]
    ranks[1].step(2)
    time.sleep(0.05)
    liveness.poll()
    assert receive(0.1) == []  # rank 2 hangs: no ping
    ranks[2].step(2)
    time.sleep(0.05)
    liveness.poll()
    assert receive(0.1) == [{"WATCHDOG": "1", "STATUS": "training, step 2"}]
    liveness.close()


def _tiny(tmp_path: Path) -> Path:
    data = yaml.safe_load((ROOT / "configs" / "tiny-cpu.yaml").read_text())
    data["output_dir"] = str(tmp_path / "run")
    data["data"].pop("regenerate", None)
    data["optim"]["max_steps"] = 100000
    data["logging"]["interval"] = 1
    data["runtime"]["num_threads"] = 1
    data["topology"] = {"mode": "colocated", "nproc": 2, "timeout_s": 600}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _workers(parent: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(parent)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.distributed
def test_a_hung_rank_stops_the_jobs_pings(tmp_path, supervisor):
    """`dflash train` with 2 colocated ranks under a NOTIFY_SOCKET: start-up allowance, READY once both ranks
    train, pings while they do; SIGSTOP of one worker (the launcher and the other rank still run) ends them."""
    address, receive = supervisor
    env = {**os.environ, "NOTIFY_SOCKET": address, "DFLASH_WATCHDOG_SEC": "5", "DFLASH_WATCHDOG_START_SEC": "300",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "train", str(_tiny(tmp_path))], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    ranks: list[int] = []  # torchrun starts its workers in sessions of their own: killed one by one below
    try:
        got, deadline = [], time.monotonic() + 240  # bounds only: a loaded machine starts Python slowly
        while not got and time.monotonic() < deadline:
            got += receive(0.5)
        assert got and got[0] == {"WATCHDOG_USEC": "300000000", "STATUS": "loading"}
        while not any(m.get("READY") == "1" for m in got) and time.monotonic() < deadline:
            got += receive(1.0)
        ready = next(m for m in got if m.get("READY") == "1")
        assert ready["WATCHDOG_USEC"] == "5000000"
        pings, deadline = 0, time.monotonic() + 300
        while pings < 2 and time.monotonic() < deadline:  # both ranks step: pings
            pings += sum(m.get("WATCHDOG") == "1" for m in receive(0.5))
        assert pings >= 2
        torchrun = _workers(proc.pid)[0]
        ranks = _workers(torchrun)
        worker = ranks[0]
        os.kill(worker, signal.SIGSTOP)
        receive(1.0)  # a ping already on its way
        assert [m for m in receive(5.0) if m.get("WATCHDOG") == "1"] == []  # one hung rank: no ping at all
        assert proc.poll() is None
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # the stopped one too: nothing is left behind
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
