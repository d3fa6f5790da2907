"""The restart policy per failure class (module_utils/dflash_failures.py) with real processes on the daemon backend:
out of memory (exit 4) restarted at most once, a data error (3) never, an unknown failure (1) until the burst; the
class in the status and in the failure hook's environment; and the systemd backend's properties for the policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from ansible.module_utils.dflash_failures import DEFAULT_POLICY, PolicyError, codes_with, restart_policy
from ansible.module_utils.dflash_health import failure_class
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_unit_daemon import DaemonBackend
from ansible.module_utils.dflash_unit_spec import parse_environment_file
from ansible.module_utils.dflash_unit_systemd import (
    RECORD_EXIT_SCRIPT,
    record_dropin_text,
    record_exit_script,
    systemd_run_args,
)
from conftest import ROOT, tool
from test_ansible_unit_selfheal import supervisor_gone, wait_for

BURST = 4


@pytest.fixture
def daemon(tmp_path):
    backend = DaemonBackend(LocalHost())
    specs = []

    def make(code, classes=None):
        """A fake trainer that prints one line and exits `code` every time."""
        hook = ["sh", "-c", f'echo "$DFLASH_FAILURE_CLASS|$DFLASH_REASON" > {tmp_path / "hook.out"}']
        restart = {"policy": "on-failure", "delay": 0.2, "burst": BURST, "interval": 600}
        if classes is not None:
            restart["classes"] = restart_policy(classes)
        spec = {"name": "fc-" + tmp_path.name[-20:], "command": ["sh", "-c", f"echo 'run of exit {code}'; exit {code}"],
                "log_path": str(tmp_path / "job.log"), "state_dir": str(tmp_path / "state"), "stop_timeout": 5,
                "working_directory": str(tmp_path), "environment": {"PYTHONPATH": str(ROOT)}, "config_hash": "h1",
                "settle_time": 0, "restart": restart, "on_failure": hook}  # fmt: skip
        specs.append(spec)
        backend.start(spec)
        assert wait_for(lambda: supervisor_gone(spec)), "the supervisor never decided"  # no restart can follow
        return spec, backend.status(spec), open(spec["log_path"]).read().count("run of exit"), tmp_path / "hook.out"

    yield make
    for spec in specs:
        backend.stop({**spec, "stop_timeout": 1})


def test_out_of_memory_is_restarted_exactly_once_then_stays_failed(daemon):
    spec, status, runs, hook = daemon(4)
    assert runs == 2 and status["restarts"] == 1, status
    log = open(spec["log_path"]).read()
    assert log.count("dflash-unit: cuda_oom (exit 4) ended the job again since its launch: not restarted "
                     "(restart policy once)") == 1
    assert status["active_state"] == "failed" and status["exit_status"] == 4
    assert status["failure_class"] == "cuda_oom"
    assert wait_for(hook.exists) and hook.read_text() == "cuda_oom|exit-code: exited 4\n"
    env = parse_environment_file(open(os.path.join(spec["state_dir"], "reason.env")).read())
    assert env == {"DFLASH_REASON": "exit-code: exited 4", "DFLASH_FAILURE_CLASS": "cuda_oom"}


def test_a_data_error_is_never_restarted(daemon):
    spec, status, runs, hook = daemon(3)
    assert runs == 1 and status["restarts"] == 0, status
    assert "dflash-unit: data_error (exit 3) is not restarted (restart policy never)" in open(spec["log_path"]).read()
    assert status["active_state"] == "failed" and status["failure_class"] == "data_error" and not status["crash_loop"]
    assert wait_for(hook.exists) and hook.read_text() == "data_error|exit-code: exited 3\n"


def test_a_gpu_error_is_never_restarted(daemon):
    _spec, status, runs, _hook = daemon(6)
    assert runs == 1 and status["restarts"] == 0 and status["failure_class"] == "gpu_error", status


def test_an_unknown_failure_is_restarted_until_the_burst(daemon):
    _spec, status, runs, hook = daemon(1)
    assert runs == BURST and status["restarts"] == BURST - 1 > 1, status
    assert status["failure_class"] == "unknown" and status["crash_loop"]
    assert wait_for(hook.exists) and hook.read_text() == "unknown|exit-code: exited 1\n"


def test_the_policy_is_set_per_class(daemon):
    """The inventory's policy: out of memory never restarted, a data error always (within the burst)."""
    _spec, status, runs, _hook = daemon(4, {"cuda_oom": "never"})
    assert runs == 1 and status["restarts"] == 0 and status["failure_class"] == "cuda_oom", status


def test_a_data_error_restarted_when_the_policy_says_always(daemon):
    _spec, status, runs, _hook = daemon(3, {"data_error": "always"})
    assert runs == BURST and status["restarts"] == BURST - 1, status


def test_policy_defaults_and_refusals():
    assert restart_policy(None) == DEFAULT_POLICY
    assert codes_with(None, "never") == [2, 3, 6] and codes_with(None, "once") == [4]
    assert codes_with({"cuda_oom": "always", "unknown": "never"}, "never") == [1, 2, 3, 6]
    with pytest.raises(PolicyError, match="unknown failure class 'oom'"):
        restart_policy({"oom": "never"})
    with pytest.raises(PolicyError, match="'twice' is not one of never, once, always"):
        restart_policy({"cuda_oom": "twice"})


def _prevent(spec):
    args = systemd_run_args(spec)
    return next(a for a in args if a.startswith("RestartPreventExitStatus="))


def test_the_systemd_unit_never_restarts_the_never_classes():
    spec = {"name": "j", "command": ["/bin/true"], "log_path": "/var/log/j.log", "state_dir": "/var/lib/dflash-units/j",
            "restart": {"policy": "on-failure", "delay": 5, "burst": 3, "interval": 300}}
    assert _prevent(spec) == "RestartPreventExitStatus=2 3 6"
    spec["restart"]["classes"] = restart_policy({"gpu_error": "always", "collective_timeout": "never"})
    assert _prevent(spec) == "RestartPreventExitStatus=2 3 5"
    spec["restart"]["classes"] = restart_policy({"bad_input": "always"})  # exit 2 is never restarted regardless
    assert _prevent(spec).startswith("RestartPreventExitStatus=2 ")


@pytest.mark.parametrize("code,status,cls", [("exited", "4", "cuda_oom"), ("exited", "5", "collective_timeout"),
                                             ("exited", "1", "unknown"), ("exited", "9", "unknown"),
                                             ("killed", "KILL", "signal"), ("exited", "0", "")])
def test_the_systemd_recorder_gives_the_hook_the_class(tmp_path, code, status, cls):
    """ExecStopPost's script (run as systemd runs it) writes DFLASH_FAILURE_CLASS beside DFLASH_REASON into reason.env,
    the OnFailure hook's EnvironmentFile."""
    (tmp_path / "state").mkdir()
    env = {"EXIT_CODE": code, "EXIT_STATUS": status, "SERVICE_RESULT": "exit-code", "PATH": "/usr/bin:/bin"}
    subprocess.run(["/bin/sh", "-c", RECORD_EXIT_SCRIPT, str(tmp_path / "state")], env=env, check=True)
    got = parse_environment_file((tmp_path / "state" / "reason.env").read_text())
    assert got == {"DFLASH_REASON": f"exit-code: {code} {status}", "DFLASH_FAILURE_CLASS": cls}


def test_the_health_check_reports_the_trainers_class_first():
    """dflash_health's failure_class: the trainer's own (its `failed` heartbeat), else the unit's exit status's."""
    assert failure_class({"failure_class": "unknown"}, {"status": "failed", "failure_class": "cuda_oom"}) == "cuda_oom"
    assert failure_class({"failure_class": "signal"}, {"status": "training"}) == "signal"
    assert failure_class({}, None) is None


def test_the_module_refuses_an_unknown_class_or_policy(ansible_env, tmp_path):
    """dflash_unit's restart_policy, checked before anything starts."""
    args = json.dumps({"name": "fc-policy", "backend": "daemon", "command": ["true"], "log_path": str(tmp_path / "l"),
                       "state_dir": str(tmp_path / "state"), "restart_policy": {"cuda_oom": "twice"}})
    proc = subprocess.run([tool("ansible"), "localhost", "-c", "local", "-i", "localhost,", "-m", "dflash_unit",
                           "-a", args, "-e", f"ansible_python_interpreter={sys.executable}"], cwd=ROOT, env=ansible_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "restart_policy: cuda_oom: 'twice' is not one of never, once, always" in proc.stdout
    assert not (tmp_path / "state").exists()


def test_only_a_policy_other_than_the_defaults_enters_the_launch_hash():
    """An upgrade alone (the defaults) restarts no running job; a changed policy relaunches it with the new one."""
    sys.path.insert(0, str(ROOT / "library"))
    try:
        import dflash_unit as module
    finally:
        sys.path.remove(str(ROOT / "library"))
    params = {"restart": "on-failure", "restart_delay": 10, "restart_burst": 3, "restart_interval": 600, "watchdog": 0,
              "watchdog_start": 0, "on_failure": [], "restart_policy": {}}
    assert "restart_policy" not in module.supervision(params)
    assert "restart_policy" not in module.supervision({**params, "restart_policy": dict(DEFAULT_POLICY)})
    assert module.supervision({**params, "restart_policy": {"cuda_oom": "never"}})["restart_policy"]["cuda_oom"] == "never"


FAKE_SYSTEMCTL = """#!/bin/sh
echo "$*" >> "$FAKE_CALLS"
case "$1" in stop) touch "$FAKE_CALLS.stopping" ;; list-jobs) [ -e "$FAKE_CALLS.stopping" ] && echo "  93 $3 stop running" ;; esac
exit 0
"""


def _end(state, bin_dir, code, status, once="4", unit="j.service"):
    """One end of the unit as systemd reports it to ExecStopPost's script, with the drop-in's arguments."""
    env = {"EXIT_CODE": code, "EXIT_STATUS": status, "SERVICE_RESULT": "exit-code", "FAKE_CALLS": str(bin_dir / "calls")}
    script = record_exit_script(systemctl=str(bin_dir / "systemctl"))  # systemctl by its path: the double's here
    out = subprocess.run(["/bin/sh", "-c", script, str(state), unit, once], env=env, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    calls = (bin_dir / "calls").read_text().splitlines() if (bin_dir / "calls").exists() else []
    return out, calls


def test_the_systemd_recorder_stops_the_unit_at_the_second_end_of_a_once_class(tmp_path):
    """`once` under systemd: the exit recorder counts this launch's ends per exit code (`events`) and, at the second
    end by a `once` code, stops the unit (--no-block: the stop cancels the pending restart) and waits until that stop
    job runs; the first end, other codes and a launch without `once` codes are restarted as usual."""
    state, bin_dir = tmp_path / "state", tmp_path / "bin"
    state.mkdir()
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(FAKE_SYSTEMCTL)
    (bin_dir / "systemctl").chmod(0o755)
    assert _end(state, bin_dir, "exited", "4") == ("", [])  # the first out-of-memory end: restarted
    assert _end(state, bin_dir, "exited", "1")[1] == []  # another class
    assert _end(state, bin_dir, "killed", "KILL")[1] == []
    assert _end(state, bin_dir, "exited", "4", once="")[1] == []  # no `once` code (the policy, or Restart=no)
    (state / "events").write_text("1 exit-code exited 4\n")  # a new launch: one end so far
    out, calls = _end(state, bin_dir, "exited", "4")
    assert out == "dflash-unit: cuda_oom (exit 4) ended the job again since its launch: not restarted (restart policy once)\n"
    assert calls[0] == "stop --no-block j.service" and calls[-1] == "list-jobs --no-legend j.service"
    assert parse_environment_file((state / "reason.env").read_text())["DFLASH_FAILURE_CLASS"] == "cuda_oom"
    # several `once` codes: each counted on its own
    (state / "events").write_text("1 exit-code exited 4\n")
    (bin_dir / "calls").unlink()
    (bin_dir / "calls.stopping").unlink()
    assert _end(state, bin_dir, "exited", "5", once="4 5")[1] == []
    assert _end(state, bin_dir, "exited", "5", once="4 5")[1][0] == "stop --no-block j.service"


def _recorder_args(spec):
    """The drop-in's ExecStopPost= as the words systemd runs: /bin/sh -c CLEAN_RECORDER STATE UNIT ONCE SCRIPT."""
    import shlex

    return shlex.split(record_dropin_text(spec).splitlines()[-1].removeprefix("ExecStopPost=-+"))


def test_the_recorder_drop_in_gives_the_unit_and_the_once_codes():
    spec = {"name": "j", "command": ["/bin/true"], "log_path": "/var/log/j.log", "state_dir": "/var/lib/dflash-units/j",
            "restart": {"policy": "on-failure", "delay": 5, "burst": 3, "interval": 300}}
    assert _recorder_args(spec)[3:6] == ["/var/lib/dflash-units/j", "j.service", "4"]
    spec["restart"]["classes"] = restart_policy({"cuda_oom": "never", "collective_timeout": "once", "unknown": "once"})
    assert _recorder_args(spec)[3:6] == ["/var/lib/dflash-units/j", "j.service", "1 5"]
    spec["restart"] = {"policy": "no"}
    assert _recorder_args(spec)[3:6] == ["/var/lib/dflash-units/j", "j.service", ""]
    assert _recorder_args(spec)[6] == RECORD_EXIT_SCRIPT.replace("%", "%%")
