"""dflash.ops train, status, logs and stop against a real LXC container: molecule's default scenario's.

The real thing: train.yml (through ansible-runner) on a container that runs the tiny CPU job as a systemd
unit; the API must report it training, then stopped with exit status 0 (the trainer checkpoints on SIGTERM).

The container is the one molecule's default scenario made and converged: its verify runs this module as its
last phase (molecule/default/ops.yml) with DFLASH_TEST_LXC_INVENTORY (the scenario's inventory) and
DFLASH_TEST_LXC_CONTAINER (the container) set, and destroys the container afterwards. Provisioning a
container of its own took minutes of the suite's CPU for what the scenario's converge proves already; a
plain pytest run skips the module (`make test` runs it). To run it alone against a converged container:

    DFLASH_TEST_LXC_INVENTORY=INVENTORY DFLASH_TEST_LXC_CONTAINER=NAME pytest tests/ops/test_ops_lxc.py

It never touches the user's deployment (`dflash-local` of inventories/local): it checks what it did itself, that
each of its playbook runs acted on its own container alone, so a user's own deploy of `dflash-local` meanwhile
does not fail it.
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
USER_CONTAINER = "dflash-local"
INVENTORY = os.environ.get("DFLASH_TEST_LXC_INVENTORY", "")
CONTAINER = os.environ.get("DFLASH_TEST_LXC_CONTAINER", "")


def _why_not() -> str | None:
    if not (INVENTORY and CONTAINER):
        return ("runs as the last phase of molecule's default scenario (make test), on its container: set "
                "DFLASH_TEST_LXC_INVENTORY and DFLASH_TEST_LXC_CONTAINER to run it against a converged one")
    if os.geteuid() != 0:
        return "needs root: the inventory attaches LXC containers (run `sudo make test`)"
    if shutil.which("lxc-start") is None:
        return "no LXC on this machine: lxc-start not found (`make host-setup` installs it)"
    if importlib.util.find_spec("lxc") is None:
        return "the Python lxc bindings (community.general.lxc connection) are missing: run `make host-setup`"
    return None


pytestmark = [
    pytest.mark.lxc,
    pytest.mark.slow,
    pytest.mark.skipif(_why_not() is not None, reason=str(_why_not())),
]


def _ours(result):
    """``result`` after asserting that its playbook run acted on this test's container alone: a run that touched the
    user's container (or any other) lists it among its containers. What the user does with their own container
    meanwhile (a `make train` during `make test`) is not this test's doing, so it is not looked at."""
    assert set(result.containers) == {CONTAINER}, (
        f"the test's playbook run acted on {sorted(result.containers)}, not only on its container {CONTAINER}"
    )
    return result


def test_train_status_logs_stop_in_a_real_container(capsys):
    assert CONTAINER != USER_CONTAINER, f"the test container must not be the user's {USER_CONTAINER}"
    trained = _ours(ops.train(INVENTORY, limit=CONTAINER, progress=False))
    assert trained.ok, trained.message
    job = trained.containers[CONTAINER]
    assert job.state in ("training", "finished"), trained.message
    assert job.backend == "systemd" and job.unit_state == "active" and job.pid
    assert job.action in ("none", "started", "restarted") and job.step is not None

    status = _ours(ops.status(INVENTORY, limit=CONTAINER, progress=False))
    assert status.ok, status.message
    now = status.containers[CONTAINER]
    assert now.state == "training" and now.pid == job.pid and now.step >= job.step
    assert any(line.startswith("step ") for line in now.log_tail)

    assert ops_cli.main(["status", "-i", INVENTORY, "-l", CONTAINER, "-q", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["containers"][CONTAINER]["state"] == "training"

    logs = _ours(ops.logs(INVENTORY, 5, limit=CONTAINER))
    assert logs.ok and len(logs.containers[CONTAINER].log_tail) == 5

    stopped = _ours(ops.stop(INVENTORY, limit=CONTAINER, progress=False))
    assert stopped.ok, stopped.message
    done = stopped.containers[CONTAINER]
    assert done.action == "stopped" and done.unit_state == "inactive" and done.state == "stopped"
    # systemd unloads a transient unit that stopped cleanly, and its exit status with it.
    assert done.exit_status in (0, None) and done.pid is None

    after = _ours(ops.status(INVENTORY, limit=CONTAINER, progress=False))
    assert after.ok and after.containers[CONTAINER].state == "stopped" and after.containers[CONTAINER].pid is None
