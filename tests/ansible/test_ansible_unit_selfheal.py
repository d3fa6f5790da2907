"""Self-healing of the daemon backend for real on this machine (what systemd's Restart=, StartLimitBurst=,
WatchdogSec= and OnFailure= do for the systemd backend, proven in molecule/selfheal): a killed job restarts
by itself, a hung one is killed by its watchdog, a crash loop stops after the burst and runs the hook, and
the next deploy reports the loop instead of relaunching it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_unit import ensure
from ansible.module_utils.dflash_unit_daemon import DaemonBackend
from ansible.module_utils.dflash_unit_records import is_running
from ansible.module_utils.dflash_unit_spec import UnitError
from conftest import ROOT
from conftest import wait_for as conftest_wait_for

# A trainer stand-in that speaks dflash.runtime.notify: start-up allowance, READY, a ping per step.
PINGING = [sys.executable, "-u", "-c", (
    "import time\nfrom dflash.runtime.notify import Notifier\nn = Notifier()\nn.loading()\ntime.sleep(0.3)\n"
    "for step in range(1, 100000):\n    time.sleep(0.1)\n    n.step(step)\n    print('step', step, flush=True)\n"
)]  # fmt: skip
LOOP = [sys.executable, "-u", "-c", "import time\nwhile True:\n    time.sleep(0.1)"]


def wait_for(predicate, timeout=300.0, interval=0.05):
    return conftest_wait_for(predicate, timeout, interval)


def supervisor_gone(spec):
    """The job's supervisor (the only process that restarts it) has exited: nothing can relaunch the job any more."""
    pid = json.loads(open(os.path.join(spec["state_dir"], "pid")).read())["supervisor_pid"]
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(") ", 1)[1][0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def launch_record(spec):
    return open(os.path.join(spec["state_dir"], "pid")).read()


@pytest.fixture
def daemon(tmp_path):
    backend = DaemonBackend(LocalHost())
    specs = []

    def make(command, **kw):
        spec = {"name": "heal-" + tmp_path.name[-20:], "command": command, "log_path": str(tmp_path / "job.log"),
                "state_dir": str(tmp_path / "state"), "stop_timeout": 5, "working_directory": str(tmp_path),
                "environment": {"PYTHONPATH": str(ROOT)}, "config_hash": "h1", "settle_time": 0,
                "restart": {"policy": "on-failure", "delay": 0.5, "burst": 3, "interval": 60}, **kw}  # fmt: skip
        specs.append(spec)
        return spec

    yield backend, make
    for spec in specs:
        backend.stop({**spec, "stop_timeout": 1})


def test_a_killed_job_restarts_by_itself(daemon):
    backend, make = daemon
    spec = make(LOOP)
    backend.start(spec)
    first = wait_for(lambda: backend.status(spec)["main_pid"])
    os.kill(first, signal.SIGKILL)
    t0 = time.monotonic()
    second = wait_for(lambda: (backend.status(spec)["main_pid"] or first) != first and backend.status(spec)["main_pid"])
    assert second and second != first
    assert time.monotonic() - t0 >= 0.5  # after the restart delay, not at once
    status = backend.status(spec)
    assert status["active_state"] == "active" and status["restarts"] == 1
    assert status["last_exit_reason"] == "signal (killed KILL)" and status["watchdog_kills"] == 0


def test_a_hung_job_is_killed_by_its_watchdog_and_restarted(daemon):
    backend, make = daemon
    # a start-up allowance far longer than the wait below: only the steady interval (1 s) can end the hung job
    spec = make(PINGING, watchdog={"interval": 1, "start_interval": 300})
    backend.start(spec)
    first = wait_for(lambda: backend.status(spec)["main_pid"])
    assert wait_for(lambda: "step 3" in open(spec["log_path"]).read())
    os.kill(first, signal.SIGSTOP)
    t0 = time.monotonic()
    second = wait_for(lambda: (backend.status(spec)["main_pid"] or first) != first and backend.status(spec)["main_pid"],
                      timeout=300)
    took = time.monotonic() - t0
    assert second and second != first, backend.status(spec)
    assert took > 0.8, took  # not before the steady interval (1 s) since its last ping, then the restart delay
    status = backend.status(spec)
    assert status["watchdog_kills"] == 1 and status["last_exit_reason"] == "watchdog (killed KILL)"


def test_the_start_up_allowance_covers_a_slow_start(daemon):
    backend, make = daemon
    slow = [PINGING[0], "-u", "-c", "import time\n" + PINGING[3].replace("time.sleep(0.3)", "time.sleep(2.5)")]
    spec = make(slow, watchdog={"interval": 1, "start_interval": 4})
    backend.start(spec)
    assert wait_for(lambda: "step 5" in open(spec["log_path"]).read(), timeout=300)
    assert backend.status(spec)["watchdog_kills"] == 0 and backend.status(spec)["restarts"] == 0


def test_a_crash_loop_stops_after_the_burst_runs_the_hook_and_is_reported(daemon, tmp_path):
    backend, make = daemon
    hook_out = tmp_path / "hook.out"
    spec = make(["sh", "-c", "echo crashing; exit 1"],  # an unknown failure: restarted (dflash_failures)
                on_failure=["sh", "-c", f'echo "$DFLASH_JOB|$DFLASH_REASON" > {hook_out}'])
    backend.start(spec)
    status = wait_for(lambda: backend.status(spec)["active_state"] == "failed" and backend.status(spec))
    assert status and status["crash_loop"] and status["restarts"] == 2, backend.status(spec)
    assert open(spec["log_path"]).read().count("crashing") == 3  # the burst: 3 starts, then no more
    assert wait_for(hook_out.exists)
    assert hook_out.read_text() == f"{spec['name']}|exit-code: exited 1\n"
    assert status["last_exit_reason"] == "exit-code (exited 1)" and status["exit_status"] == 1
    (tmp_path / "state" / "config_hash").write_text("h1\n")
    assert wait_for(lambda: supervisor_gone(spec))
    before = launch_record(spec)
    with pytest.raises(UnitError, match=r"(?s)crash loop: restarted 2 time\(s\).*exit-code \(exited 1\).*state=restarted.*crashing"):
        ensure(spec, "started", backend, LocalHost())
    # not relaunched blindly: a launch would have written a new record before ensure() returned
    assert launch_record(spec) == before and supervisor_gone(spec)
    assert open(spec["log_path"]).read().count("crashing") == 3
    result = ensure({**spec, "config_hash": "h2"}, "started", backend, LocalHost())  # a fix deployed: relaunch
    assert result["action"] == "started"


def test_bad_input_exit_2_is_never_restarted(daemon):
    backend, make = daemon
    spec = make(["sh", "-c", "echo 'dflash: error: bad'; exit 2"])
    backend.start(spec)
    status = wait_for(lambda: backend.status(spec)["active_state"] == "failed" and backend.status(spec))
    assert wait_for(lambda: supervisor_gone(spec))  # it decided: no restart will follow
    assert status["exit_status"] == 2 and not status["crash_loop"] and backend.status(spec)["restarts"] == 0
    assert open(spec["log_path"]).read().count("dflash: error") == 1


def test_a_stop_during_the_restart_delay_ends_it_for_good(daemon):
    backend, make = daemon
    spec = make(LOOP, restart={"policy": "on-failure", "delay": 3, "burst": 3, "interval": 60})
    backend.start(spec)
    first = wait_for(lambda: backend.status(spec)["main_pid"])
    os.kill(first, signal.SIGKILL)
    assert wait_for(lambda: backend.status(spec)["sub_state"] == "auto-restart")
    assert is_running(backend.status(spec))  # between two runs: a deploy leaves it alone
    before = launch_record(spec)
    backend.stop(spec)
    assert wait_for(lambda: supervisor_gone(spec))  # it ended in the delay: no restart will follow
    assert launch_record(spec) == before
    assert not is_running(backend.status(spec)) and backend.status(spec)["main_pid"] is None


def test_the_health_module_and_ops_status_report_restarts_and_the_last_failure(daemon, tmp_path):
    from ansible.module_utils.dflash_health import check_health

    from dflash.ops.results import ContainerStatus, _apply_unit_fields, _describe

    backend, make = daemon
    spec = make(LOOP)
    backend.start(spec)
    first = wait_for(lambda: backend.status(spec)["main_pid"])
    os.kill(first, signal.SIGKILL)
    assert wait_for(lambda: (backend.status(spec)["main_pid"] or first) != first)
    params = {"name": spec["name"], "log_path": spec["log_path"], "heartbeat_path": str(tmp_path / "heartbeat.json"),
              "gpu_ids": [], "gpu_min_memory_mib": 1024, "timeout": 0, "progress_window": 1, "poll_interval": 0.05,
              "log_lines": 5}  # fmt: skip
    unit = check_health(LocalHost(), params, lambda: {**backend.status(spec), "backend": "daemon"})["unit"]
    assert unit["restarts"] == 1 and unit["watchdog_kills"] == 0 and unit["last_exit_reason"] == "signal (killed KILL)"
    container = ContainerStatus(host="c1", state="training")
    _apply_unit_fields(container, unit)
    assert container.restarts == 1 and not container.crash_loop
    assert "restarted 1x (watchdog 0x), last failure signal (killed KILL)" in _describe(container)
    _apply_unit_fields(container, {**unit, "active_state": "failed", "crash_loop": True, "restarts": 2})
    assert _describe(container).endswith("crash loop, restarts exhausted")
