"""dflash.ops.train, then status, logs and stop, against the local LXC container (inventories/local).

The real thing: train.yml creates/starts the container, provisions it and launches
the tiny CPU run as a systemd unit inside it; the API must report it training,
then stopped with exit status 0 (the trainer checkpoints on SIGTERM).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from dflash import ops
from dflash.ops import cli as ops_cli

ROOT = Path(__file__).resolve().parents[2]
INVENTORY = ROOT / "inventories" / "local"
CONTAINER = "dflash-local"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the local inventory creates and attaches LXC containers (run `sudo make test`)"
    if shutil.which("lxc-start") is None:
        return "no LXC on this machine: lxc-start not found (`make host-setup` installs it)"
    if importlib.util.find_spec("lxc") is None:
        return "the Python lxc bindings (community.general.lxc connection) are missing: run `make host-setup`"
    return None


pytestmark = [
    pytest.mark.lxc,
    pytest.mark.slow,
    pytest.mark.skipif(_why_not() is not None, reason=str(_why_not())),
    # A first train.yml builds the container's rootfs and installs torch in it.
    pytest.mark.timeout(3600),
]


def test_train_status_logs_stop_in_the_local_container(capsys):
    trained = ops.train(INVENTORY, progress=False)
    assert trained.ok, trained.message
    job = trained.containers[CONTAINER]
    assert job.state in ("training", "finished"), trained.message
    assert job.backend == "systemd" and job.unit_state == "active" and job.pid
    assert job.action in ("none", "started", "restarted") and job.step is not None

    status = ops.status(INVENTORY, progress=False)
    assert status.ok, status.message
    now = status.containers[CONTAINER]
    assert now.state == "training" and now.pid == job.pid and now.step >= job.step
    assert any(line.startswith("step ") for line in now.log_tail)

    assert ops_cli.main(["status", "-i", str(INVENTORY), "-q", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["containers"][CONTAINER]["state"] == "training"

    logs = ops.logs(INVENTORY, 5)
    assert logs.ok and len(logs.containers[CONTAINER].log_tail) == 5

    stopped = ops.stop(INVENTORY, progress=False)
    assert stopped.ok, stopped.message
    done = stopped.containers[CONTAINER]
    assert done.action == "stopped" and done.unit_state == "inactive" and done.state == "stopped"
    # systemd unloads a transient unit that stopped cleanly, and its exit status with it.
    assert done.exit_status in (0, None) and done.pid is None

    after = ops.status(INVENTORY, progress=False)
    assert after.ok and after.containers[CONTAINER].state == "stopped" and after.containers[CONTAINER].pid is None
