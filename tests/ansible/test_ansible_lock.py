"""The per-job deploy lock: exclusive, re-entrant for its owner, waits for another owner, breaks a stale lock,
releases only its own; two processes really contend for it."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import pytest
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_lock import LockBusy, LockError, acquire, read_lock, release


def test_acquire_release_and_reentry(tmp_path):
    path = str(tmp_path / "run" / "job.deploy.lock")
    assert acquire(path, "a", "play A", 5, 3600, LocalHost())[0]
    assert read_lock(path)["holder"] == "play A"
    assert acquire(path, "a", "play A", 5, 3600, LocalHost())[0] is False  # already ours
    assert release(path, "b") == (False, read_lock(path))  # not b's: left alone
    assert release(path, "a") == (True, None) and not os.path.exists(path)
    assert release(path, "a") == (False, None)


def test_another_owner_waits_then_fails_naming_the_holder(tmp_path, fake_host):
    path = str(tmp_path / "job.deploy.lock")
    acquire(path, "a", "ansible on ctl1", 5, 3600, LocalHost())
    host = fake_host()
    with pytest.raises(LockError) as err:
        acquire(path, "b", "ansible on ctl2", 30, 3600, host)
    assert host.clock >= 30
    assert f"deploy lock {path} is held by ansible on ctl1" in str(err.value)
    assert f"remove {path}" in str(err.value)


def test_a_stale_lock_is_broken(tmp_path):
    path = tmp_path / "job.deploy.lock"
    path.write_text(json.dumps({"owner": "killed", "holder": "a killed deploy", "since": time.time() - 7200}))
    changed, _, broken = acquire(str(path), "b", "play B", 5, 3600, LocalHost())
    assert changed and broken["holder"] == "a killed deploy" and read_lock(str(path))["owner"] == "b"


def _hold(path, owner, hold_s, log):
    acquire(path, owner, owner, 30, 3600, LocalHost())
    with open(log, "a") as handle:
        handle.write(f"{owner} in {time.time()}\n")
    time.sleep(hold_s)
    with open(log, "a") as handle:
        handle.write(f"{owner} out {time.time()}\n")
    release(path, owner)


def test_two_processes_never_hold_it_at_once(tmp_path):
    path, log = str(tmp_path / "job.deploy.lock"), str(tmp_path / "log")
    procs = [multiprocessing.Process(target=_hold, args=(path, f"p{i}", 0.5, log)) for i in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
    events = [line.split() for line in open(log).read().splitlines()]
    assert len(events) == 6
    # in/out strictly alternate: each holder leaves before the next enters.
    assert [e[1] for e in events] == ["in", "out"] * 3
    assert all(events[i][0] == events[i + 1][0] for i in range(0, 6, 2))


def test_without_waiting_another_owners_lock_is_reported_and_a_gone_holders_lock_taken_over(tmp_path):
    path = str(tmp_path / "job.deploy.lock")
    acquire(path, "a", "play A", 5, 3600, LocalHost(), controller={"host": "ctl", "pid": 1})
    with pytest.raises(LockBusy) as busy:
        acquire(path, "b", "play B", 5, 3600, LocalHost(), wait=False)
    assert busy.value.held["owner"] == "a" and busy.value.held["controller"] == {"host": "ctl", "pid": 1}
    # a take-over names the owner it breaks: another owner's lock (here a's, not "c") is waited for
    with pytest.raises(LockBusy):
        acquire(path, "b", "play B", 5, 3600, LocalHost(), wait=False, take_over="c")
    changed, _, broken = acquire(path, "b", "play B", 5, 3600, LocalHost(), wait=False, take_over="a")
    assert changed and broken["owner"] == "a" and read_lock(path)["owner"] == "b"


# --- the action plugin (playbooks/action_plugins/dflash_lock.py): a real play on localhost ----------------------


def _play(tmp_path, lock, timeout):
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    task = {"name": "Take the lock", "dflash_lock": {"path": str(lock), "owner": "new", "holder": "the new deploy",
                                                     "timeout": timeout}, "register": "taken"}  # fmt: skip
    show = {"name": "Show", "ansible.builtin.debug": {"msg": "RESULT {{ taken.taken_over.owner | default('none') }}"}}
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{"name": "Play", "hosts": "localhost", "connection": "local",
                                         "gather_facts": False, "tasks": [task, show]}]))  # fmt: skip
    env = {**os.environ, "ANSIBLE_CONFIG": str(root / "ansible.cfg"), "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": str(tmp_path / ".ansible-tmp")}  # fmt: skip
    return subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", str(playbook)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip


def _controller(pid):
    import socket

    with open(f"/proc/{pid}/stat") as handle:
        start = handle.read().rsplit(")", 1)[1].split()[19]
    with open("/proc/sys/kernel/random/boot_id") as handle:
        boot = handle.read().strip()
    return {"host": socket.gethostname(), "boot_id": boot, "pid": pid, "start": start}


def test_a_lock_whose_deploy_was_killed_is_taken_over_saying_so(tmp_path):
    import subprocess

    killed = subprocess.Popen(["sleep", "60"])
    record = {"owner": "killed", "holder": "a deploy from ctl started 10:00Z", "since": time.time() - 30,
              "controller": _controller(killed.pid)}  # fmt: skip
    killed.kill()
    killed.wait()
    lock = tmp_path / "job.deploy.lock"
    lock.write_text(json.dumps(record))
    start = time.monotonic()
    proc = _play(tmp_path, lock, 600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - start < 120  # taken at once, not after the 600 s wait
    line = next(x for x in proc.stdout.splitlines() if x.startswith("[localhost] "))
    assert f"the deploy lock {lock} was left by a deploy from ctl started 10:00Z (pid {killed.pid} " in line, line
    assert f"its process {killed.pid} " in line and "no longer runs" in line and "taking the lock over" in line
    assert "RESULT killed" in proc.stdout
    held = read_lock(str(lock))
    assert held["owner"] == "new" and held["controller"]["pid"] != killed.pid  # the new deploy's own process
    assert "stale lock" not in proc.stdout + proc.stderr  # taken over as gone, not broken as old


def test_a_lock_held_by_a_running_deploy_is_waited_for_saying_who_holds_it(tmp_path):
    lock = tmp_path / "job.deploy.lock"
    lock.write_text(json.dumps({"owner": "alive", "holder": "a deploy from ctl started 10:00Z", "since": time.time(),
                                "controller": _controller(os.getpid())}))  # fmt: skip
    proc = _play(tmp_path, lock, 2)
    assert proc.returncode != 0
    line = next(x for x in proc.stdout.splitlines() if x.startswith("[localhost] "))
    assert f"waiting for the deploy lock {lock}: held by a deploy from ctl started 10:00Z (pid {os.getpid()} " in line
    assert "waiting up to 2s" in line, line
    assert "is held by a deploy from ctl started 10:00Z" in proc.stdout + proc.stderr  # the module's failure after 2 s
    assert read_lock(str(lock))["owner"] == "alive"
