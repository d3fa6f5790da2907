"""The per-job deploy lock: exclusive, re-entrant for its owner, waits for another owner, breaks a stale lock,
releases only its own; two processes really contend for it."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import pytest
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_lock import LockError, acquire, read_lock, release


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
