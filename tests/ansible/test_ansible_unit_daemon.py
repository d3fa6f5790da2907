"""The daemon backend for real on this machine: detach, status, process-group stop, exit status, restart."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import textwrap
import time

import pytest
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_unit import ensure
from ansible.module_utils.dflash_unit_daemon import DaemonBackend
from ansible.module_utils.dflash_unit_procs import job_processes
from conftest import ROOT, wait_for

LOOP = [sys.executable, "-u", "-c", "import time\nfor i in range(100000):\n    print('step', i, flush=True)\n    time.sleep(0.05)"]


@pytest.fixture
def daemon(tmp_path):
    backend = DaemonBackend(LocalHost())
    specs = []

    def make(command, **kw):
        spec = {"name": "t-" + tmp_path.name[-20:], "command": command, "log_path": str(tmp_path / "log" / "job.log"),
                "state_dir": str(tmp_path / "state"), "stop_timeout": 5, "working_directory": str(tmp_path), **kw}  # fmt: skip
        specs.append(spec)
        return spec

    yield backend, make
    for spec in specs:  # never leave a process behind
        backend.stop({**spec, "stop_timeout": 1})


def test_start_status_stop_by_process_group(daemon):
    backend, make = daemon
    spec = make(LOOP)
    backend.start(spec)
    status = wait_for(lambda: (s := backend.status(spec))["active_state"] == "active" and s)
    assert status["sub_state"] == "running" and status["main_pid"]
    pid = status["main_pid"]
    assert os.getpgid(pid) == pid and os.getsid(pid) != os.getsid(0)  # own group, own session
    assert wait_for(lambda: "step 3" in open(spec["log_path"]).read())
    record = json.loads(open(spec["state_dir"] + "/pid").read())
    assert job_processes(record) == [pid]  # the python loop; the supervisor is not part of the job
    after = backend.stop(spec)
    assert job_processes(record) == []
    assert after["active_state"] == "failed" and after["exit_status"] == 143  # python died of SIGTERM
    assert after["main_pid"] is None


def test_exit_status_and_error_survive_the_process(daemon):
    backend, make = daemon
    spec = make(["sh", "-c", "echo 'dflash: error: data.train_path /nope does not exist' >&2; exit 2"])
    backend.start(spec)
    status = wait_for(lambda: (s := backend.status(spec))["active_state"] not in ("active", "deactivating") and s)
    assert (status["active_state"], status["sub_state"], status["exit_status"]) == ("failed", "failed", 2)
    assert "dflash: error: data.train_path /nope" in open(spec["log_path"]).read()


def test_clean_exit_is_inactive_with_status_zero(daemon):
    backend, make = daemon
    spec = make(["true"])
    backend.start(spec)
    status = wait_for(lambda: (s := backend.status(spec))["active_state"] not in ("active", "deactivating") and s)
    assert (status["active_state"], status["exit_status"]) == ("inactive", 0)


def test_sigterm_is_forwarded_and_the_trainer_status_recorded(daemon):
    # Like the trainer: on SIGTERM, finish up and exit 0.
    code = "import signal,sys,time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\nprint('up', flush=True)\nwhile True: time.sleep(0.05)"
    backend, make = daemon
    spec = make([sys.executable, "-c", code])
    backend.start(spec)
    assert wait_for(lambda: "up" in open(spec["log_path"]).read())
    status = backend.stop(spec)
    assert (status["active_state"], status["exit_status"]) == ("inactive", 0)


def test_sigkill_after_stop_timeout(daemon):
    code = "import signal,time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)"
    backend, make = daemon
    spec = make([sys.executable, "-c", code], stop_timeout=1)
    backend.start(spec)
    assert wait_for(lambda: "up" in open(spec["log_path"]).read())
    record = json.loads(open(spec["state_dir"] + "/pid").read())
    started = time.monotonic()
    status = backend.stop(spec)
    assert time.monotonic() - started >= 0.9  # SIGKILL only after the stop timeout (1 s)
    assert job_processes(record) == [] and status["exit_status"] == 137


def test_processes_that_leave_the_group_are_stopped_too(daemon, tmp_path):
    # torchrun-style: a worker in its own session. It carries the job's DFLASH_UNIT_ID marker.
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        open({str(tmp_path / 'worker.pid')!r}, "w").write(str(p.pid))
        time.sleep(60)
    """)
    backend, make = daemon
    spec = make([sys.executable, "-c", code])
    backend.start(spec)
    worker = int(wait_for(lambda: (tmp_path / "worker.pid").exists() and (tmp_path / "worker.pid").read_text()))
    assert os.getsid(worker) == worker  # left the job's session and group
    backend.stop(spec)
    assert wait_for(lambda: not os.path.exists(f"/proc/{worker}") or open(f"/proc/{worker}/stat").read().split(") ")[1][0] == "Z", 60)


def test_environment_file_environment_and_user(daemon, tmp_path):
    if os.getuid() != 0:
        pytest.skip("dropping privileges needs root")
    nobody = pwd.getpwnam("nobody")
    env_file = tmp_path / "job.env"
    env_file.write_text("# env role output\nFROM_FILE=1\nOVERRIDDEN=file\n")
    os.chmod(tmp_path, 0o755)
    backend, make = daemon
    spec = make(["sh", "-c", "id -u; echo $FROM_FILE $OVERRIDDEN $PYTHONPATH; pwd; sleep 30"],
                environment_file=str(env_file), environment={"OVERRIDDEN": "param", "PYTHONPATH": "/opt/dflash/current"},
                user="nobody", working_directory="/")  # fmt: skip
    backend.start(spec)
    assert wait_for(lambda: len(open(spec["log_path"]).read().split("\n")) >= 4)
    lines = open(spec["log_path"]).read().split("\n")
    assert lines[:3] == [str(nobody.pw_uid), "1 param /opt/dflash/current", "/"]


def test_start_does_not_hold_the_callers_pipes(tmp_path):
    # Ansible reads a module's stdout until EOF: a daemon keeping it open would hang the play.
    script = textwrap.dedent(f"""
        import sys
        import ansible.module_utils
        ansible.module_utils.__path__.append({str(ROOT / 'module_utils')!r})
        from ansible.module_utils.dflash_host import LocalHost
        from ansible.module_utils.dflash_unit_daemon import DaemonBackend
        spec = dict(name="pipes", command=["sleep", "600"], log_path={str(tmp_path / 'log')!r},
                    state_dir={str(tmp_path / 'state')!r}, working_directory="/")
        DaemonBackend(LocalHost()).start(spec)
        print("started")
    """)
    # A held pipe would keep subprocess.run reading until the job (sleep 600) ends: it times out instead.
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "started"
    finally:
        DaemonBackend(LocalHost()).stop({"name": "pipes", "state_dir": str(tmp_path / "state"), "stop_timeout": 1})


def test_restart_sequence_for_real(daemon, tmp_path):
    backend, make = daemon
    # The trainer's kernel cache lives in the run directory (working_directory) and survives every restart.
    entry = tmp_path / "compile-cache" / "torch-x" / "inductor" / "fxgraph" / "entry"
    entry.parent.mkdir(parents=True)
    entry.write_text("warm")
    spec = make(LOOP, config_hash="h1", settle_time=0.2)
    host = LocalHost()
    first = ensure(spec, "started", backend, host)
    assert first["action"] == "started" and first["active_state"] == "active"
    first_record = json.loads(open(spec["state_dir"] + "/pid").read())
    again = ensure(spec, "started", backend, host)
    assert (again["action"], again["changed"], again["main_pid"]) == ("none", False, first["main_pid"])
    changed = ensure({**spec, "config_hash": "h2"}, "started", backend, host)
    assert changed["action"] == "restarted" and changed["previous_hash"] == "h1"
    assert changed["main_pid"] != first["main_pid"] and job_processes(first_record) == []
    assert entry.read_text() == "warm"
    stopped = ensure({**spec, "config_hash": "h2"}, "stopped", backend, host)
    assert stopped["action"] == "stopped" and stopped["active_state"] != "active"
    removed = ensure(spec, "absent", backend, host)
    assert removed["action"] == "removed" and not os.path.exists(spec["state_dir"])
    assert ensure(spec, "absent", backend, host)["action"] == "none"


def test_a_recycled_process_group_is_never_signalled(daemon, tmp_path):
    # A stale pidfile whose pid/pgid now belongs to an unrelated process (same number, other start time).
    bystander = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        state = tmp_path / "stale"
        state.mkdir()
        (state / "pid").write_text(json.dumps({"pid": bystander.pid, "pgid": bystander.pid, "token": "0" * 32, "starttime": 1}))
        backend, _ = daemon
        status = backend.stop({"name": "stale", "state_dir": str(state), "stop_timeout": 1})
        assert bystander.poll() is None and status["active_state"] != "active"
    finally:
        bystander.kill()
        bystander.wait()


def test_reading_the_proc_file_of_a_process_that_just_exited_gives_the_default(monkeypatch):
    """/proc/PID/stat opened just before PID exits fails on read with ESRCH; stop() must treat it as gone."""
    import builtins

    from ansible.module_utils import dflash_host

    child = subprocess.Popen(["sleep", "30"])
    handle = open(f"/proc/{child.pid}/stat")  # noqa: SIM115 - held open across the exit on purpose
    child.kill()
    child.wait()
    monkeypatch.setattr(builtins, "open", lambda *a, **k: handle)
    assert dflash_host.read_text(f"/proc/{child.pid}/stat", "gone") == "gone"
