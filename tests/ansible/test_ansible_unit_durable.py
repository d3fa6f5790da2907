"""Durable jobs on the systemd backend: the exit recorder as a drop-in (kept across a daemon-reload), the launch
recorded for the boot relaunch, the relaunch script run for real against a fake systemctl/systemd-run, the desired
state a stop records, and the `lost` state."""

from __future__ import annotations

import os
import stat
import subprocess
import time

import pytest
from ansible.module_utils.dflash_health import check_health
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_unit import ensure
from ansible.module_utils.dflash_unit_records import read_desired
from ansible.module_utils.dflash_unit_systemd import (
    RECORD_EXIT_SCRIPT,
    RELAUNCH_SCRIPT,
    SystemdBackend,
    boot_unit_name,
    hook_unit_text,
    record_dropin_text,
    systemd_run_args,
)

SHOW_RUNNING = "LoadState=loaded\nActiveState=active\nSubState=running\nMainPID=77\nExecMainStatus=0\nExecMainCode=0\nResult=success\n"
SHOW_GONE = "LoadState=not-found\nActiveState=inactive\nSubState=dead\nMainPID=0\nExecMainStatus=0\nExecMainCode=0\nResult=success\n"


def _spec(tmp_path, **kw):
    return {"name": "dflash-train", "command": ["/v/bin/python", "-m", "dflash", "train", "/etc/dflash/c.yaml"],
            "log_path": str(tmp_path / "log" / "j.log"), "state_dir": str(tmp_path / "state"), "stop_timeout": 30,
            "config_hash": "h", "settle_time": 0, "user": "dflash", "on_failure": ["/usr/bin/curl", "-d", "secret-token"],
            **kw}  # fmt: skip


class Unit:
    """A scripted systemctl/systemd-run: systemd-run starts the unit, systemctl stop ends it."""

    def __init__(self, fake_host, running=False):
        self.running = running
        self.host = fake_host({
            "systemctl show": lambda h: (0, SHOW_RUNNING if self.running else SHOW_GONE, ""),
            "systemctl stop": lambda h: (setattr(self, "running", False), (0, "", ""))[1],
            "systemd-run": lambda h: (setattr(self, "running", True), (0, "Running as unit: dflash-train.service", ""))[1],
        })  # fmt: skip

    def verbs(self):
        return [c[1] if c[0] == "systemctl" else c[0] for c in self.host.calls]


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_start_records_the_launch_for_the_boot_relaunch(tmp_path, fake_host, systemd_dirs):
    spec = _spec(tmp_path)
    unit = Unit(fake_host)
    SystemdBackend(unit.host).start(spec)
    state = tmp_path / "state"
    # the exact systemd-run argument list that ran, NUL-terminated words
    ran = next(c for c in unit.host.calls if c[0] == "systemd-run")
    assert (state / "launch.argv").read_text().split("\0")[:-1] == ran == systemd_run_args(spec)
    assert (state / "record.conf").read_text() == record_dropin_text(spec)
    assert (state / "on-failure.service").read_text() == hook_unit_text(spec)
    assert (state / "relaunch").read_text() == RELAUNCH_SCRIPT
    for name, mode in (("launch.argv", 0o600), ("record.conf", 0o600), ("on-failure.service", 0o600), ("relaunch", 0o700)):
        assert _mode(state / name) == mode, name
    # the boot unit, enabled as `systemctl enable` does it, runs the script on the state directory
    boot = systemd_dirs["boot_unit_dir"] / boot_unit_name("dflash-train")
    text = boot.read_text()
    assert f'ExecStart=/bin/sh "{state}/relaunch" "{state}" "dflash-train"' in text
    assert "WantedBy=multi-user.target" in text and "Type=oneshot" in text
    wants = systemd_dirs["boot_unit_dir"] / "multi-user.target.wants" / boot_unit_name("dflash-train")
    assert os.readlink(wants) == str(boot)
    # launched in this boot of the container
    assert (systemd_dirs["marker_dir"] / "dflash-train.launched").is_file()


def test_the_exit_recorder_is_a_drop_in_seen_before_the_unit_starts(tmp_path, fake_host, systemd_dirs):
    spec = _spec(tmp_path)
    unit = Unit(fake_host)
    seen = {}
    real_run = unit.host.run

    def run(args, check_rc=False):
        if args[:2] == ["systemctl", "daemon-reload"]:
            seen["dropin_at_reload"] = dropin.is_file()
        return real_run(args, check_rc)

    unit.host.run = run
    dropin = systemd_dirs["runtime_unit_dir"] / "dflash-train.service.d" / "50-dflash-record.conf"
    SystemdBackend(unit.host).start(spec)
    assert dropin.read_text() == record_dropin_text(spec)
    assert seen == {"dropin_at_reload": True}
    verbs = unit.verbs()
    assert verbs.index("daemon-reload") < verbs.index("systemd-run")
    # nothing of the recorder on the transient unit, which systemd 252 loses at a reload
    assert not any(a.startswith("ExecStopPost") for a in next(c for c in unit.host.calls if c[0] == "systemd-run"))
    # a unit-file line: % doubled (a specifier otherwise), ignore its failure, run as root
    line = record_dropin_text(spec).splitlines()[-1]
    assert line.startswith('ExecStopPost=-+/bin/sh -c "') and "date +%%s" in line and (f' "{tmp_path}/state" "dflash-train.service" ' in line)


def test_the_failure_hook_unit_is_root_only(tmp_path, fake_host, systemd_dirs):
    SystemdBackend(Unit(fake_host).host).start(_spec(tmp_path))
    hook = systemd_dirs["runtime_unit_dir"] / "dflash-train-on-failure.service"
    assert "secret-token" in hook.read_text()
    assert _mode(hook) == 0o600 and hook.stat().st_uid == os.getuid()


def test_removing_the_hook_and_removing_the_job(tmp_path, fake_host, systemd_dirs):
    unit = Unit(fake_host)
    backend = SystemdBackend(unit.host)
    backend.start(_spec(tmp_path))
    backend.start(_spec(tmp_path, on_failure=[]))
    assert not (systemd_dirs["runtime_unit_dir"] / "dflash-train-on-failure.service").exists()
    assert not (tmp_path / "state" / "on-failure.service").exists()
    ensure(_spec(tmp_path), "absent", backend, unit.host)
    leftovers = [p for d in systemd_dirs.values() for p in d.rglob("*") if "dflash-train" in p.name]
    assert leftovers == [] and not (tmp_path / "state").exists()


def test_desired_state_running_after_a_launch_stopped_after_a_stop(tmp_path, fake_host):
    unit = Unit(fake_host)
    backend = SystemdBackend(unit.host)
    result = ensure(_spec(tmp_path), "started", backend, unit.host)
    assert result["action"] == "started" and result["desired"] == "running" and not result["lost"]
    # recorded before the stop: a shutdown in the middle of the stop does not bring it back
    real_stop = backend.stop
    backend.stop = lambda spec: (seen.append(read_desired(spec["state_dir"])), real_stop(spec))[1]
    seen = []
    result = ensure(_spec(tmp_path), "stopped", backend, unit.host)
    assert seen == ["stopped"] and result["desired"] == "stopped" and result["changed"]
    # stopping it again changes nothing
    assert not ensure(_spec(tmp_path), "stopped", backend, unit.host)["changed"]


def test_stopping_a_lost_job_records_the_stop(tmp_path, fake_host, systemd_dirs):
    unit = Unit(fake_host)
    backend = SystemdBackend(unit.host)
    ensure(_spec(tmp_path), "started", backend, unit.host)
    unit.running = False
    (systemd_dirs["marker_dir"] / "dflash-train.launched").unlink()  # the container restarted
    assert backend.status(_spec(tmp_path))["lost"]
    result = ensure(_spec(tmp_path), "stopped", backend, unit.host)
    assert (result["action"], result["changed"], result["desired"], result["lost"]) == ("none", True, "stopped", False)


@pytest.mark.parametrize(
    ("desired", "marker", "running", "lost"),
    [
        ("running", False, False, True),  # restarted under it and not relaunched
        ("running", True, False, False),  # relaunched in this boot, then ended: its own state (crashed, ...)
        ("running", False, True, False),
        ("stopped", False, False, False),  # stopped on purpose stays stopped
        (None, False, False, False),  # launched by an earlier release: nothing recorded
    ],
)
def test_lost_is_meant_to_run_not_running_and_not_launched_in_this_boot(tmp_path, fake_host, systemd_dirs, desired,
                                                                        marker, running, lost):
    state = tmp_path / "state"
    state.mkdir()
    if desired:
        (state / "desired").write_text(desired + "\n")
    if marker:
        systemd_dirs["marker_dir"].mkdir()
        (systemd_dirs["marker_dir"] / "dflash-train.launched").write_text("1\n")
    status = SystemdBackend(Unit(fake_host, running=running).host).status(_spec(tmp_path))
    assert status["lost"] is lost


def test_a_job_of_an_earlier_release_becomes_durable_without_a_restart(tmp_path, fake_host, systemd_dirs):
    state = tmp_path / "state"
    state.mkdir()
    (state / "config_hash").write_text("h\n")
    unit = Unit(fake_host, running=True)
    result = ensure(_spec(tmp_path), "started", SystemdBackend(unit.host), unit.host)
    assert (result["action"], result["changed"], result["desired"]) == ("none", True, "running")
    assert "stop" not in unit.verbs() and "systemd-run" not in unit.verbs()
    assert unit.verbs().count("daemon-reload") == 1  # the recorder drop-in takes effect
    assert (systemd_dirs["runtime_unit_dir"] / "dflash-train.service.d" / "50-dflash-record.conf").is_file()
    assert (state / "launch.argv").is_file() and (systemd_dirs["marker_dir"] / "dflash-train.launched").is_file()
    # then a deploy with the same inputs changes nothing
    unit.host.calls.clear()
    result = ensure(_spec(tmp_path), "started", SystemdBackend(unit.host), unit.host)
    assert (result["action"], result["changed"]) == ("none", False) and "daemon-reload" not in unit.verbs()


@pytest.mark.parametrize(
    ("transient_line", "dropin"),
    [
        # systemd 252 writes the recorder of an earlier release so; it is lost at the next reload: add the drop-in
        ('ExecStopPostEx=+"/bin/sh" "-c" "echo \\"$$EXIT_CODE $$EXIT_STATUS\\" > \\"$$0/exit_status\\"" "/s"', True),
        # a newer systemd writes it so and reads it back: a drop-in as well would record every end twice
        ('ExecStopPost=+"/bin/sh" "-c" "echo \\"$$EXIT_CODE $$EXIT_STATUS\\" > \\"$$0/exit_status\\"" "/s"', False),
    ],
)
def test_an_earlier_releases_recorder_is_not_doubled(tmp_path, fake_host, systemd_dirs, transient_line, dropin):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "config_hash").write_text("h\n")
    systemd_dirs["transient_dir"].mkdir()
    (systemd_dirs["transient_dir"] / "dflash-train.service").write_text("[Service]\nExecStopPost=\n" + transient_line + "\n")
    unit = Unit(fake_host, running=True)
    assert ensure(_spec(tmp_path), "started", SystemdBackend(unit.host), unit.host)["changed"]
    path = systemd_dirs["runtime_unit_dir"] / "dflash-train.service.d" / "50-dflash-record.conf"
    assert path.exists() is dropin
    assert (tmp_path / "state" / "launch.argv").is_file()  # durable either way
    assert not ensure(_spec(tmp_path), "started", SystemdBackend(unit.host), unit.host)["changed"]


# --- the relaunch script, run for real --------------------------------------------------------------------------


def _fake_tools(tmp_path, systemd_run_rc=0):
    """systemctl and systemd-run that log their arguments, one NUL-separated line per call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for tool, rc in (("systemctl", 0), ("systemd-run", systemd_run_rc)):
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\nprintf "%s\\0" {tool} "$@" >> "{calls}"\necho >> "{calls}"\nexit {rc}\n')
        script.chmod(0o755)
    return bin_dir, calls


def _recorded_launch(tmp_path, fake_host, systemd_dirs, desired):
    spec = _spec(tmp_path, command=["/v/bin/python", "-m", "dflash", "train", "/etc/dflash/c.yaml", "a b", "x'y"])
    unit = Unit(fake_host)
    backend = SystemdBackend(unit.host)
    ensure(spec, "started", backend, unit.host)
    if desired == "stopped":
        ensure(spec, "stopped", backend, unit.host)
    # the container restarts: /run is empty again
    for directory in (systemd_dirs["runtime_unit_dir"], systemd_dirs["marker_dir"]):
        subprocess.run(["rm", "-rf", str(directory)], check=True)
    (tmp_path / "state" / "events").write_text("1 success exited 0\n")
    return spec


def _run_boot_unit(tmp_path, systemd_dirs, bin_dir):
    """The boot unit's ExecStart, as systemd runs it."""
    text = (systemd_dirs["boot_unit_dir"] / boot_unit_name("dflash-train")).read_text()
    exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    argv = [word.strip('"') for word in exec_start.removeprefix("ExecStart=").split(" ")]
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


def test_the_boot_relaunch_runs_the_recorded_launch(tmp_path, fake_host, systemd_dirs):
    spec = _recorded_launch(tmp_path, fake_host, systemd_dirs, "running")
    bin_dir, calls = _fake_tools(tmp_path)
    proc = _run_boot_unit(tmp_path, systemd_dirs, bin_dir)
    assert proc.returncode == 0, proc.stderr
    runs = [line.split("\0")[:-1] for line in calls.read_text().split("\n") if line]
    assert runs[0] == ["systemctl", "daemon-reload"]
    assert ["systemctl", "reset-failed", "dflash-train.service"] in runs
    assert runs[-1] == systemd_run_args(spec)  # word for word, spaces and quotes included
    # the runtime files are back before the reload, the hook root-only; the marker of this boot is written
    dropin = systemd_dirs["runtime_unit_dir"] / "dflash-train.service.d" / "50-dflash-record.conf"
    hook = systemd_dirs["runtime_unit_dir"] / "dflash-train-on-failure.service"
    assert dropin.read_text() == record_dropin_text(spec) and hook.read_text() == hook_unit_text(spec)
    assert _mode(hook) == 0o600
    assert (systemd_dirs["marker_dir"] / "dflash-train.launched").is_file()
    assert not (tmp_path / "state" / "events").exists()  # a new launch: the ends of the earlier one are not its own


def test_a_job_stopped_on_purpose_is_not_relaunched(tmp_path, fake_host, systemd_dirs):
    _recorded_launch(tmp_path, fake_host, systemd_dirs, "stopped")
    bin_dir, calls = _fake_tools(tmp_path)
    proc = _run_boot_unit(tmp_path, systemd_dirs, bin_dir)
    assert proc.returncode == 0 and "not relaunched" in proc.stdout
    assert not calls.exists() and not (systemd_dirs["marker_dir"] / "dflash-train.launched").exists()


def test_a_failed_boot_relaunch_leaves_no_marker_and_the_job_reads_lost(tmp_path, fake_host, systemd_dirs):
    _recorded_launch(tmp_path, fake_host, systemd_dirs, "running")
    bin_dir, _calls = _fake_tools(tmp_path, systemd_run_rc=1)
    proc = _run_boot_unit(tmp_path, systemd_dirs, bin_dir)
    assert proc.returncode != 0
    assert not (systemd_dirs["marker_dir"] / "dflash-train.launched").exists()
    status = SystemdBackend(Unit(fake_host).host).status(_spec(tmp_path))
    assert status["lost"] and status["desired"] == "running"


def test_the_recorder_script_in_the_drop_in_writes_the_records(tmp_path):
    """The drop-in's command, unquoted as systemd does, records an end in the format the readers parse."""
    (tmp_path / "state").mkdir()
    env = {"EXIT_CODE": "killed", "EXIT_STATUS": "KILL", "SERVICE_RESULT": "signal", "PATH": "/usr/bin:/bin"}
    subprocess.run(["/bin/sh", "-c", RECORD_EXIT_SCRIPT, str(tmp_path / "state")], env=env, check=True)
    assert (tmp_path / "state" / "exit_status").read_text() == "killed KILL\n"
    assert (tmp_path / "state" / "events").read_text().split()[1:] == ["signal", "killed", "KILL"]


# --- status: lost ------------------------------------------------------------------------------------------------


def _params(tmp_path):
    return {"name": "dflash-train", "log_path": str(tmp_path / "job.log"), "heartbeat_path": str(tmp_path / "hb.json"),
            "gpu_ids": [], "gpu_min_memory_mib": 1024, "timeout": 0, "progress_window": 30, "poll_interval": 0.05,
            "log_lines": 5}  # fmt: skip


@pytest.mark.parametrize("exit_status", [0, 143, None])
def test_a_lost_job_reads_lost_never_stopped(tmp_path, exit_status):
    (tmp_path / "job.log").write_text("step 10\n")
    unit = {"load_state": "not-found", "active_state": "inactive", "sub_state": "dead", "main_pid": None,
            "exit_status": exit_status, "result": None, "backend": "systemd", "started_at": time.time() - 60,
            "desired": "running", "lost": True}  # fmt: skip
    result = check_health(LocalHost(), _params(tmp_path), lambda: dict(unit))
    assert result["state"] == "lost" and not result["ok"] and not result["healthy"]
    assert "restarted under the job" in result["diagnosis"] and "dflash-boot-dflash-train" in result["hint"]
    # the same unit stopped on purpose
    stopped = {**unit, "desired": "stopped", "lost": False}
    result = check_health(LocalHost(), _params(tmp_path), lambda: dict(stopped))
    assert result["state"] == "stopped" and result["ok"]


def test_ops_status_exits_1_for_a_lost_job():
    from dflash.ops.results import OK_STATES, ContainerStatus, derive_state

    container = ContainerStatus(host="c1", health_state="lost", healthy=False)
    assert derive_state(container) == "lost" and "lost" not in OK_STATES
