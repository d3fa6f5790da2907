"""dflash_unit decisions without processes: hash, plan, systemd command line and state parsing, sequence order."""

from __future__ import annotations

import pytest
from ansible.module_utils.dflash_unit import ensure, resolve_backend
from ansible.module_utils.dflash_unit_spec import UnitError, config_hash, parse_environment_file, plan_action
from ansible.module_utils.dflash_unit_systemd import (
    CLEAN_RECORDER,
    RECORD_EXIT_SCRIPT,
    parse_systemctl_show,
    record_dropin_text,
    systemd_run_args,
)

BASE = {"command": ["/opt/dflash/venv/bin/python", "-m", "dflash", "train", "/etc/dflash/j.yaml"],
        "environment": {"PYTHONPATH": "/opt/dflash/current"}, "environment_file_text": "A=1\n",
        "config_text": "output_dir: /r\n", "working_directory": "/r", "user": "dflash"}  # fmt: skip


def test_hash_is_stable_and_order_insensitive_for_environment():
    a = config_hash(**BASE)
    b = config_hash(**{**BASE, "environment": dict(reversed(list({"X": "1", **BASE["environment"]}.items())))})
    assert a == config_hash(**BASE)
    assert b == config_hash(**{**BASE, "environment": {**BASE["environment"], "X": "1"}})


@pytest.mark.parametrize(
    "change",
    [
        {"command": BASE["command"] + ["optim.lr=1e-4"]},
        {"environment": {"PYTHONPATH": "/elsewhere"}},
        {"environment_file_text": "A=2\n"},
        {"config_text": "output_dir: /r\nseed: 1\n"},
        {"working_directory": "/other"},
        {"user": "root"},
    ],
)
def test_every_input_changes_the_hash(change):
    assert config_hash(**{**BASE, **change}) != config_hash(**BASE)


@pytest.mark.parametrize(
    ("state", "running", "present", "same_hash", "expected"),
    [
        ("started", True, True, True, "none"),
        ("started", True, True, False, "restarted"),
        ("started", False, True, True, "started"),  # crashed with the same config: relaunch
        ("started", False, False, False, "started"),
        ("restarted", True, True, True, "restarted"),
        ("restarted", False, True, True, "started"),
        ("stopped", True, True, True, "stopped"),
        ("stopped", False, True, True, "none"),
        ("absent", False, True, True, "removed"),
        ("absent", True, True, True, "removed"),
        ("absent", False, False, True, "none"),
    ],
)
def test_plan(state, running, present, same_hash, expected):
    assert plan_action(state, running, present, "h1", "h1" if same_hash else "h0") == expected


def test_plan_rejects_unknown_state():
    with pytest.raises(UnitError, match="unknown state"):
        plan_action("running", True, True, "a", "a")


def test_environment_file_syntax():
    text = '# comment\n; also\n\nA=1\nB="two words"\nC=\'x=y\'\nexport D=4\nnot a line\n E = 5 \n'
    assert parse_environment_file(text) == {"A": "1", "B": "two words", "C": "x=y", "D": "4", "E": "5"}


def test_systemd_run_command_line():
    spec = {
        "name": "dflash-train", "command": ["/v/bin/python", "-m", "dflash", "train", "/etc/dflash/c.yaml"],
        "log_path": "/var/log/dflash/j.log", "stop_timeout": 120, "environment_file": "/etc/dflash/j.env",
        "working_directory": "/var/lib/dflash/runs/j", "user": "dflash", "state_dir": "/var/lib/dflash-units/dflash-train",
        "environment": {"PYTHONPATH": "/opt/dflash/current", "A": "b c"},
        "restart": {"policy": "on-failure", "delay": 5, "burst": 3, "interval": 300},
        "watchdog": {"interval": 60, "start_interval": 900}, "on_failure": ["/usr/bin/curl", "-d", "x"],
    }  # fmt: skip
    assert systemd_run_args(spec) == [
        "systemd-run", "--unit=dflash-train.service", "--description=dflash job dflash-train",
        "-p", "Type=exec", "-p", "KillMode=mixed", "-p", "TimeoutStopSec=120s",
        "-p", "StandardOutput=append:/var/log/dflash/j.log", "-p", "StandardError=append:/var/log/dflash/j.log",
        "-p", "Restart=on-failure", "-p", "RestartSec=5s", "-p", "StartLimitBurst=3", "-p", "StartLimitIntervalSec=300s",
        "-p", "RestartPreventExitStatus=2 3 6",  # bad_input, data_error, gpu_error (dflash_failures.DEFAULT_POLICY)
        "-p", "WatchdogSec=900s", "-p", "NotifyAccess=main",
        "-p", "OnFailure=dflash-train-on-failure.service",
        "-p", "EnvironmentFile=/etc/dflash/j.env",
        "-p", "EnvironmentFile=/var/lib/dflash-units/dflash-train/environment",
        "-p", "WorkingDirectory=/var/lib/dflash/runs/j", "-p", "User=dflash",
        "--", "/v/bin/python", "-m", "dflash", "train", "/etc/dflash/c.yaml",
    ]  # fmt: skip
    assert "--collect" not in systemd_run_args(spec)
    # the exit recorder is a drop-in, not a property of the transient unit (systemd 252 loses that at a reload)
    assert not any(word.startswith("ExecStopPost") for word in systemd_run_args(spec))
    quoted = [word.replace("\\", "\\\\").replace('"', '\\"') for word in (CLEAN_RECORDER, RECORD_EXIT_SCRIPT.replace("%", "%%"))]
    assert record_dropin_text(spec).splitlines()[1:] == [
        "[Service]",
        # in root's environment (CLEAN_RECORDER runs the script under env -i): the state directory ($0), the unit ($1),
        # the exit codes restarted at most once ($2: cuda_oom's) and the script ($3)
        f'ExecStopPost=-+/bin/sh -c "{quoted[0]}" "/var/lib/dflash-units/dflash-train" "dflash-train.service" "4" "{quoted[1]}"',
    ]
    # no environment value on the command line (it is world-readable in /proc)
    assert not any("b c" in word or "/opt/dflash/current" in word for word in systemd_run_args(spec))


def test_systemctl_show_running():
    s = parse_systemctl_show("LoadState=loaded\nActiveState=active\nSubState=running\nMainPID=4242\nExecMainStatus=0\nExecMainCode=0\nResult=success\n")
    assert (s["active_state"], s["sub_state"], s["main_pid"], s["exit_status"]) == ("active", "running", 4242, None)


def test_systemctl_show_failed_keeps_exit_status():
    s = parse_systemctl_show("LoadState=loaded\nActiveState=failed\nSubState=failed\nMainPID=0\nExecMainStatus=2\nExecMainCode=1\nResult=exit-code\n")
    assert (s["active_state"], s["main_pid"], s["exit_status"], s["result"]) == ("failed", None, 2, "exit-code")


def test_systemctl_show_killed_by_signal_and_unknown_unit():
    s = parse_systemctl_show("LoadState=loaded\nActiveState=failed\nSubState=failed\nMainPID=0\nExecMainStatus=9\nExecMainCode=2\nResult=signal\n")
    assert s["exit_status"] == 137
    s = parse_systemctl_show("LoadState=not-found\nActiveState=inactive\nSubState=dead\nMainPID=0\nExecMainStatus=0\nExecMainCode=0\n")
    assert (s["load_state"], s["exit_status"], s["main_pid"]) == ("not-found", None, None)


def test_backend_detection(tmp_path):
    run_dir, comm = tmp_path / "run-systemd-system", tmp_path / "comm"
    comm.write_text("systemd\n")
    assert resolve_backend("auto", str(run_dir), str(comm)) == "daemon"  # no /run/systemd/system
    run_dir.mkdir()
    assert resolve_backend("auto", str(run_dir), str(comm)) == "systemd"
    comm.write_text("bash\n")  # systemd installed but not PID 1 (a plain container, the GPU machine)
    assert resolve_backend("auto", str(run_dir), str(comm)) == "daemon"
    assert resolve_backend("systemd", str(tmp_path / "x"), str(comm)) == "systemd"
    with pytest.raises(UnitError):
        resolve_backend("upstart")


class RecordingBackend:
    name = "fake"

    def __init__(self, running, log):
        self.running, self.log = running, log

    def status(self, spec):
        return {"load_state": "loaded", "active_state": "active" if self.running else "inactive", "sub_state": "x",
                "main_pid": 1 if self.running else None, "exit_status": None, "result": None}  # fmt: skip

    def present(self, spec, status):
        return True

    def stop(self, spec):
        self.log.append("stop")
        self.running = False

    def start(self, spec):
        self.log.append("start")
        self.running = True

    def remove(self, spec):
        self.log.append("remove")


def _spec(tmp_path, **kw):
    return {"name": "j", "state_dir": str(tmp_path / "state"), "config_hash": "new", "gpu_ids": [0, 1],
            "gpu_release_timeout": 10, "gpu_release_threshold_mib": 1024, "working_directory": str(tmp_path / "run"),
            "settle_time": 0, **kw}  # fmt: skip


def _gpu_answer(used_per_call):
    calls = iter(used_per_call)

    def answer(host):
        used = next(calls)
        host_log.append(f"gpu {used}")
        return 0, "".join(f"{i}, GPU-{i}, NVIDIA H200, 580.159.04, 143771, {u}, 0, Disabled\n" for i, u in enumerate(used)), ""

    host_log = []
    answer.log = host_log
    return answer


def test_restart_sequence_order_and_hash_update(tmp_path, fake_host):
    log = []
    gpu = _gpu_answer([(70000, 70000), (30000, 10), (10, 10)])
    host = fake_host({"--query-gpu": lambda h: (log.append("gpu"), gpu(h))[1]})
    # The trainer's kernel cache in the run directory must outlive a restart (a warm start compiles nothing).
    kernel = tmp_path / "run" / "compile-cache" / "torch-x" / "inductor" / "kernel.py"
    kernel.parent.mkdir(parents=True)
    kernel.write_text("cached\n")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "config_hash").write_text("old\n")
    backend = RecordingBackend(running=True, log=log)
    real_start = backend.start
    backend.start = lambda spec: (log.append(f"cache kept={kernel.is_file()}"), real_start(spec))
    result = ensure(_spec(tmp_path), "started", backend, host)
    assert result["action"] == "restarted" and result["changed"]
    assert result["previous_hash"] == "old" and result["config_hash"] == "new"
    # stop, then GPUs polled until released, then start with the kernel cache still there.
    assert log == ["stop", "gpu", "gpu", "gpu", "cache kept=True", "start"]
    assert result["gpu_release"]["released"] and kernel.read_text() == "cached\n"
    assert (tmp_path / "state" / "config_hash").read_text() == "new\n"


def test_same_hash_and_running_is_no_change(tmp_path, fake_host):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "config_hash").write_text("new\n")
    (tmp_path / "state" / "desired").write_text("running\n")
    log = []
    result = ensure(_spec(tmp_path), "started", RecordingBackend(True, log), fake_host())
    assert (result["action"], result["changed"], log) == ("none", False, [])


def test_check_mode_changes_nothing(tmp_path, fake_host):
    log = []
    result = ensure(_spec(tmp_path), "started", RecordingBackend(True, log), fake_host(), check_mode=True)
    assert result["action"] == "restarted" and result["changed"] and log == []
    assert not (tmp_path / "state" / "config_hash").exists()


def test_gpus_that_never_release_fail_before_start(tmp_path, fake_host):
    host = fake_host({"--query-gpu": (0, "0, GPU-0, NVIDIA H200, 580.159.04, 143771, 50000, 0, Disabled\n1, GPU-1, NVIDIA H200, 580.159.04, 143771, 0, 0, Disabled\n", "")})
    log = []
    with pytest.raises(UnitError, match=r"did not release.*GPU 0: 50000 MiB.*gpu_release_timeout"):
        ensure(_spec(tmp_path), "restarted", RecordingBackend(True, log), host)
    assert log == ["stop"]  # never started on busy GPUs
    assert host.clock >= 10


def test_gpu_wait_is_skipped_without_nvidia_smi(tmp_path, fake_host):
    log = []
    result = ensure(_spec(tmp_path), "started", RecordingBackend(False, log), fake_host(which={}))
    assert result["action"] == "started" and log == ["stop", "start"]
    assert result["gpu_release"]["skipped"] == "nvidia-smi not found"


# --- the systemd backend against a scripted systemctl/systemd-run -------------------------------------------

SHOW_RUNNING = "LoadState=loaded\nActiveState=active\nSubState=running\nMainPID=77\nExecMainStatus=0\nExecMainCode=0\nResult=success\n"
SHOW_GONE = "LoadState=not-found\nActiveState=inactive\nSubState=dead\nMainPID=0\nExecMainStatus=0\nExecMainCode=0\nResult=success\n"
SHOW_FAILED = "LoadState=loaded\nActiveState=failed\nSubState=failed\nMainPID=0\nExecMainStatus=2\nExecMainCode=1\nResult=exit-code\n"


def _systemd_spec(tmp_path):
    return {"name": "dflash-train", "command": ["/v/bin/python", "-m", "dflash", "train", "/c.yaml"], "log_path": str(tmp_path / "log" / "j.log"),
            "state_dir": str(tmp_path / "state"), "stop_timeout": 30, "config_hash": "h", "settle_time": 0}  # fmt: skip


def test_systemd_start_resets_a_failed_unit_then_runs(tmp_path, fake_host):
    from ansible.module_utils.dflash_unit_systemd import SystemdBackend

    host = fake_host({"systemctl show": (0, SHOW_FAILED, "")})
    backend = SystemdBackend(host)
    assert backend.status(_systemd_spec(tmp_path))["exit_status"] == 2
    backend.start(_systemd_spec(tmp_path))
    # the recorder drop-in is on disk before the reload that makes systemd see it, then the failed unit is reset
    assert host.calls[1:3] == [["systemctl", "daemon-reload"], ["systemctl", "reset-failed", "dflash-train.service"]]
    assert host.calls[3][:2] == ["systemd-run", "--unit=dflash-train.service"]
    assert (tmp_path / "log").is_dir()  # systemd does not create the log's directory


def test_systemd_start_failure_names_the_unit_and_stderr(tmp_path, fake_host):
    from ansible.module_utils.dflash_unit_systemd import SystemdBackend

    host = fake_host({"systemd-run": (1, "", "Failed to start transient service unit: Unit dflash-train.service already exists.")})
    with pytest.raises(UnitError, match=r"systemd-run could not start dflash-train.service \(exit 1\): Failed to start transient"):
        SystemdBackend(host).start(_systemd_spec(tmp_path))


def test_systemd_stop_waits_and_keeps_the_exit_status_of_an_unloaded_unit(tmp_path, fake_host):
    from ansible.module_utils.dflash_unit_systemd import SystemdBackend

    shows = iter([SHOW_RUNNING, SHOW_RUNNING, "LoadState=loaded\nActiveState=deactivating\nSubState=stop-sigterm\nMainPID=77\n",
                  "LoadState=loaded\nActiveState=inactive\nSubState=dead\nMainPID=0\nExecMainStatus=0\nExecMainCode=1\n"])  # fmt: skip
    host = fake_host({"systemctl show": lambda h: (0, next(shows, SHOW_GONE), "")})
    backend = SystemdBackend(host)
    status = backend.stop(_systemd_spec(tmp_path))
    assert ["systemctl", "stop", "dflash-train.service"] in host.calls
    assert status["active_state"] == "inactive" and status["exit_status"] == 0
    # Once systemd unloads the transient unit, the recorded status is still reported.
    assert backend.status(_systemd_spec(tmp_path))["exit_status"] == 0


def test_systemd_restart_sequence_in_order(tmp_path, fake_host):
    from ansible.module_utils.dflash_unit_systemd import SystemdBackend

    running = {"value": True}

    def show(h):
        return 0, (SHOW_RUNNING if running["value"] else SHOW_GONE), ""

    def stop(h):
        running["value"] = False
        return 0, "", ""

    def run(h):
        running["value"] = True
        return 0, "Running as unit: dflash-train.service", ""

    host = fake_host({"systemctl show": show, "systemctl stop": stop, "systemd-run": run})
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "config_hash").write_text("old\n")
    result = ensure(_systemd_spec(tmp_path), "started", SystemdBackend(host), host)
    verbs = [c[1] if c[0] == "systemctl" else c[0] for c in host.calls]
    assert result["action"] == "restarted" and result["backend"] == "systemd"
    stop_at, start_at = verbs.index("stop"), verbs.index("systemd-run")
    assert stop_at < verbs.index("reset-failed") < start_at
    assert result["active_state"] == "active" and result["main_pid"] == 77


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0\n", 0), ("2", 2), ("exited 3\n", 3), ("killed TERM\n", 143), ("killed KILL", 137), ("dumped SEGV", 139),
     ("killed 9", 137), ("killed BOGUS", None), ("", None), ("garbage here", None)],
)  # fmt: skip
def test_exit_status_files_of_both_backends(text, expected):
    from ansible.module_utils.dflash_unit_records import parse_exit_status

    assert parse_exit_status(text) == expected


def test_systemd_state_dir_must_be_safe_for_the_command_line(tmp_path, fake_host):
    from ansible.module_utils.dflash_unit_systemd import SystemdBackend

    for bad in ("a b", "x'y", "x;touch /tmp/pwned", "x`id`", "x$y", "x%n", "x>y"):
        with pytest.raises(UnitError, match="must be an absolute path of letters"):
            ensure({**_systemd_spec(tmp_path), "state_dir": str(tmp_path / bad)}, "started",
                   SystemdBackend(fake_host()), fake_host())
