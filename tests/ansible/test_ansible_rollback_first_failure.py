"""A launch a deploy can roll back: its start window ends at its first failure (not after the restart burst), and
its failure hook is held meanwhile (the deploy's rollback answers a failed start, not the pager)."""

from __future__ import annotations

import shlex
import subprocess
import time

import pytest
from ansible.module_utils.dflash_health import check_health
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_supervisor import hook_held
from ansible.module_utils.dflash_unit_daemon import DaemonBackend
from ansible.module_utils.dflash_unit_records import HOOK_HOLD_FILE, set_hook_hold
from ansible.module_utils.dflash_unit_systemd import hook_unit_text


def _params(tmp_path, **kw):
    (tmp_path / "job.log").write_text("loading the target\n")
    return {"name": "job", "log_path": str(tmp_path / "job.log"), "heartbeat_path": str(tmp_path / "heartbeat.json"),
            "gpu_ids": [], "gpu_min_memory_mib": 1024, "timeout": 300, "progress_window": 120, "poll_interval": 5,
            "log_lines": 5, **kw}  # fmt: skip


# The unit between two starts of its restart burst: systemd's `activating (auto-restart)`, one restart counted.
RESTARTING = {"load_state": "loaded", "active_state": "activating", "sub_state": "auto-restart", "main_pid": None,
              "exit_status": 1, "result": "exit-code", "restarts": 1, "last_exit_reason": "exit-code (exited 1)",
              "backend": "systemd"}  # fmt: skip


def test_the_start_window_of_a_launch_that_can_roll_back_ends_at_its_first_failure(tmp_path, fake_host):
    host = fake_host()
    unit = {**RESTARTING, "started_at": time.time() - 3}
    result = check_health(host, _params(tmp_path, first_failure=True), lambda: dict(unit))
    assert not result["healthy"] and result["state"] == "failed-to-start"
    assert host.clock < 5  # at once: not after the progress window, nor the restart burst
    assert "the launch ended (exit-code (exited 1)) and its restart policy restarts it" in result["diagnosis"]


@pytest.mark.parametrize("unit", [
    {**RESTARTING, "restarts": 0},  # systemd counts the restart only once its delay is over
    {**RESTARTING, "restarts": 0, "sub_state": "running", "main_pid": 1, "last_exit_reason": "exit-code (exited 1)"},
])
def test_the_first_end_counts_before_its_restart_does(tmp_path, fake_host, unit):
    host = fake_host()
    result = check_health(host, _params(tmp_path, first_failure=True), lambda: {**unit, "started_at": time.time() - 3})
    assert result["state"] == "failed-to-start" and host.clock < 5, result["diagnosis"]


def test_without_a_rollback_the_restart_burst_is_waited_out(tmp_path, fake_host):
    host = fake_host()
    unit = {**RESTARTING, "started_at": time.time() - 3}
    result = check_health(host, _params(tmp_path, timeout=30), lambda: dict(unit))
    assert host.clock >= 30 and result["state"] != "failed-to-start"  # it may yet heal: the policy restarts it


def _condition(text):
    [line] = [x for x in text.splitlines() if x.startswith("ExecCondition=")]
    # systemd's own escapes: %% is a literal %
    return shlex.split(line.removeprefix("ExecCondition=").replace("%%", "%"))


@pytest.mark.parametrize(("hold", "runs"), [(600, False), (-600, True), (None, True), ("garbage", True)])
def test_the_systemd_failure_hook_does_not_run_while_a_deploy_holds_it(tmp_path, hold, runs):
    spec = {"name": "j", "command": ["/bin/true"], "log_path": str(tmp_path / "j.log"), "state_dir": str(tmp_path),
            "on_failure": ["/usr/local/bin/page"]}  # fmt: skip
    if hold == "garbage":
        (tmp_path / HOOK_HOLD_FILE).write_text("not a time\n")
    elif hold is not None:
        (tmp_path / HOOK_HOLD_FILE).write_text(f"{int(time.time() + hold)}\n")
    proc = subprocess.run(_condition(hook_unit_text(spec)), capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    # ExecCondition=: exit 0 runs ExecStart= (the hook), 1 skips the unit
    assert proc.returncode == (0 if runs else 1), proc.stdout + proc.stderr
    assert ("failure hook not run: a deploy checks this launch" in proc.stdout) == (not runs)


def test_set_hook_hold_writes_a_deadline_and_lifts_it(tmp_path):
    set_hook_hold(LocalHost(), str(tmp_path), 60)
    assert hook_held(str(tmp_path)) and not hook_held(str(tmp_path), now=time.time() + 61)
    set_hook_hold(LocalHost(), str(tmp_path), 0)
    assert not (tmp_path / HOOK_HOLD_FILE).exists() and not hook_held(str(tmp_path))


@pytest.mark.parametrize("held", [True, False])
def test_the_daemons_failure_hook_does_not_run_while_a_deploy_holds_it(tmp_path, held):
    backend = DaemonBackend(LocalHost())
    marker = tmp_path / "PAGED"
    spec = {"name": "hold-" + tmp_path.name[-20:], "command": ["/bin/sh", "-c", "exit 1"],
            "log_path": str(tmp_path / "job.log"), "state_dir": str(tmp_path / "state"), "stop_timeout": 5,
            "working_directory": str(tmp_path), "on_failure": ["/bin/touch", str(marker)],
            "restart": {"policy": "on-failure", "delay": 0, "burst": 1, "interval": 60}}  # fmt: skip
    (tmp_path / "state").mkdir(mode=0o700)
    if held:
        set_hook_hold(LocalHost(), spec["state_dir"], 600)
    backend.start(spec)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (tmp_path / "state" / "failed").exists():
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        backend.stop({**spec, "stop_timeout": 1})
    assert (tmp_path / "state" / "failed").exists(), (tmp_path / "job.log").read_text()
    assert marker.exists() == (not held), (tmp_path / "job.log").read_text()
    assert ("failure hook not run" in (tmp_path / "job.log").read_text()) == held

