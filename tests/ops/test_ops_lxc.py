"""dflash.ops.train, then status, logs and stop, against a local LXC container of the test's own.

The real thing: train.yml creates/starts the container, provisions it and launches
the tiny CPU run as a systemd unit inside it; the API must report it training,
then stopped with exit status 0 (the trainer checkpoints on SIGTERM).

The test never touches the user's deployment (`dflash-local` of inventories/local): it writes an inventory
for its own container and job (same group_vars), destroys that container at the end, and checks that
`dflash-local` is in the state it found it (container state, and its job's unit state and MainPID: not
started, stopped or restarted).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dflash import ops
from dflash.ops import cli as ops_cli

ROOT = Path(__file__).resolve().parents[2]
USER_CONTAINER = "dflash-local"
CONTAINER = "dflash-ops-test"


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


def _lxc_state(name: str) -> str:
    """`RUNNING`, `STOPPED`, or `absent`."""
    proc = subprocess.run(["lxc-info", "-n", name, "-s"], capture_output=True, text=True)
    return proc.stdout.split()[-1] if proc.returncode == 0 and proc.stdout.split() else "absent"


def _user_job_fingerprint() -> tuple:
    """The user's container state, its job's unit (state and MainPID: a restart changes it) and, when nothing
    runs, its heartbeat (content), as far as they exist."""
    heartbeat = Path(f"/var/lib/lxc/{USER_CONTAINER}/rootfs/var/lib/dflash/runs/dflash-tiny/heartbeat.json")
    state = _lxc_state(USER_CONTAINER)
    unit = None
    if state == "RUNNING":
        proc = subprocess.run(["lxc-attach", "-n", USER_CONTAINER, "--clear-env", "--", "systemctl", "show",
                               "dflash-tiny.service", "-p", "ActiveState", "-p", "MainPID"],
                              capture_output=True, text=True)  # fmt: skip
        unit = proc.stdout.strip()
    # a running job's heartbeat advances by itself: compare it only when the container is stopped
    beat = heartbeat.read_text() if heartbeat.is_file() and state != "RUNNING" else None
    return state, unit, beat


@pytest.fixture
def inventory(tmp_path):
    """inventories/local with the test's own container and job name."""
    inv = tmp_path / "inventory"
    inv.mkdir()
    hosts = yaml.safe_load((ROOT / "inventories" / "local" / "hosts.yml").read_text())
    containers = hosts["all"]["children"]["dflash_containers"]["hosts"]
    spec = containers.pop(USER_CONTAINER)
    containers[CONTAINER] = {**spec, "ansible_host": CONTAINER, "dflash_job_name": "dflash-ops-test",
                             # a pause after each step: the job only has to show progress (molecule/default)
                             "dflash_job_config": {"logging": {"interval": 1}, "runtime": {"step_pause_s": 0.5}}}
    (inv / "hosts.yml").write_text(yaml.safe_dump(hosts))
    shutil.copytree(ROOT / "inventories" / "local" / "group_vars", inv / "group_vars")
    before = _user_job_fingerprint()
    yield inv
    subprocess.run(["lxc-stop", "-n", CONTAINER, "-k"], capture_output=True)
    subprocess.run(["lxc-destroy", "-n", CONTAINER, "-f"], capture_output=True)
    assert _lxc_state(CONTAINER) == "absent"
    assert _user_job_fingerprint() == before, "the test changed the user's dflash-local container or job"


def test_train_status_logs_stop_in_a_container_of_its_own(inventory, capsys):
    INVENTORY = inventory
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
