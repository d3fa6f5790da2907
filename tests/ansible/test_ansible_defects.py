"""Defects of the roles and module_utils that once passed the whole suite, each caught here by a test that fails
with the defect in place (docs/testing.md lists them): node ranks from a node list that is not sorted, a
daemon-backend job stopped by SIGTERM without a `stopped` heartbeat, a systemd unit without its watchdog, and a
failure hook whose command words are not quoted."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

import pytest
import yaml
from ansible.module_utils.dflash_health import check_health
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_unit_daemon import DaemonBackend
from conftest import ROOT, tool, wait_for

# ------------------------------------------------------------------------------------------------ node ranks
NODES = ["node-z", "node-a", "node-m"]  # node 0 first, as the inventory lists them: not in sorted order


def test_node_rank_is_the_position_in_dflash_job_nodes_not_the_sorted_one(tmp_path):
    """The role's node rank (unit command line, node heartbeat file, health check) is the host's index in
    dflash_job_nodes as written: node-z is node 0 although it sorts last."""
    common = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
              "dflash_job_nodes": NODES, "dflash_job_venv": "/venv", "dflash_job_config_path": "/etc/job.yaml",
              "dflash_job_run_dir": "/runs/mn"}
    # the inventory lists the hosts in yet another order
    hosts = {name: dict(common) for name in ("node-a", "node-m", "node-z")}
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {"dflash_containers": {"hosts": hosts}}}}))
    out = tmp_path / "out"
    play = [{"name": "Node ranks", "hosts": "dflash_containers", "gather_facts": False, "tasks": [
        {"name": "The job role's variables", "ansible.builtin.include_vars": {"file": str(ROOT / "roles/job/vars/main.yml")}},
        {"name": "Write them", "ansible.builtin.copy": {
            "dest": str(out) + "/{{ inventory_hostname }}.json", "mode": "0644",
            "content": "{{ {'rank': _dflash_job_node_rank | int, 'command': _dflash_job_command,"
                       " 'node_file': _dflash_job_node_heartbeat_path} | to_json }}"}},
    ]}]
    out.mkdir()
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / ".ansible-tmp")}
    proc = subprocess.run([tool("ansible-playbook"), "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank, name in enumerate(NODES):
        got = json.loads((out / f"{name}.json").read_text())
        assert got["rank"] == rank, (name, got)
        assert got["command"] == ["/venv/bin/python", "-m", "dflash", "train", "/etc/job.yaml",
                                  f"topology.node_rank={rank}"]
        assert got["node_file"] == f"/runs/mn/nodes/node-{rank}.json"


# --------------------------------------------------------------------------------- SIGTERM, daemon backend
HEARTBEAT_LOOP = (
    "import json, os, sys, time\n"
    "path = sys.argv[1]\n"
    "step = 0\n"
    "while True:\n"  # no SIGTERM handler: the job dies of the signal and never writes `stopped`
    "    step += 1\n"
    "    with open(path + '.tmp', 'w') as f:\n"
    "        json.dump({'step': step, 'epoch': 0, 'time': time.time(), 'pid': os.getpid(), 'status': 'training'}, f)\n"
    "    os.replace(path + '.tmp', path)\n"
    "    print('step', step, flush=True)\n"
    "    time.sleep(0.05)\n"
)


def test_a_daemon_job_stopped_by_sigterm_without_a_stopped_heartbeat_reads_stopped(tmp_path):
    """A job that dies of the stop's SIGTERM (exit 143) before it could write `stopped` was stopped on
    purpose: its state is `stopped` and ok (status exits 0), not `crashed` (exit 1)."""
    backend = DaemonBackend(LocalHost())
    heartbeat = tmp_path / "heartbeat.json"
    spec = {"name": "sigterm-" + tmp_path.name[-20:], "command": [sys.executable, "-u", "-c", HEARTBEAT_LOOP, str(heartbeat)],
            "log_path": str(tmp_path / "job.log"), "state_dir": str(tmp_path / "state"), "stop_timeout": 5,
            "working_directory": str(tmp_path)}  # fmt: skip
    backend.start(spec)
    try:
        assert wait_for(lambda: heartbeat.exists() and json.loads(heartbeat.read_text())["step"] >= 3)
        status = backend.stop(spec)
    finally:
        backend.stop({**spec, "stop_timeout": 1})
    assert status["exit_status"] == 143 and status["main_pid"] is None
    assert json.loads(heartbeat.read_text())["status"] == "training"  # no `stopped` heartbeat
    params = {"name": spec["name"], "log_path": spec["log_path"], "heartbeat_path": str(heartbeat), "gpu_ids": [],
              "gpu_min_memory_mib": 1024, "timeout": 0, "progress_window": 30, "poll_interval": 0.05, "log_lines": 5}
    result = check_health(LocalHost(), params, lambda: {**backend.status(spec), "backend": "daemon"})
    assert result["state"] == "stopped" and result["ok"], result["diagnosis"]


@pytest.mark.parametrize(("exit_status", "state"), [(143, "stopped"), (137, "crashed"), (1, "crashed")])
def test_a_dead_unit_that_trained_is_stopped_only_when_sigterm_ended_it(tmp_path, exit_status, state):
    """The same dead unit with a `training` heartbeat: SIGTERM is a stop, SIGKILL and exit 1 are crashes."""
    (tmp_path / "job.log").write_text("step 40\n")
    (tmp_path / "heartbeat.json").write_text(json.dumps(
        {"step": 40, "epoch": 0, "time": time.time() - 5, "pid": 1, "status": "training"}))
    unit = {"load_state": "loaded", "active_state": "failed", "sub_state": "failed", "main_pid": None,
            "exit_status": exit_status, "result": None, "backend": "daemon", "started_at": time.time() - 60}
    params = {"name": "job", "log_path": str(tmp_path / "job.log"), "heartbeat_path": str(tmp_path / "heartbeat.json"),
              "gpu_ids": [], "gpu_min_memory_mib": 1024, "timeout": 0, "progress_window": 30, "poll_interval": 0.05,
              "log_lines": 5}  # fmt: skip
    result = check_health(LocalHost(), params, lambda: dict(unit))
    assert result["state"] == state
    assert result["ok"] == (state == "stopped")


# ------------------------------------------------------------------------------------- systemd unit and hook
SPEC = {"name": "dflash-train", "command": ["/v/bin/python", "-m", "dflash", "train", "/etc/dflash/c.yaml"],
        "log_path": "/var/log/dflash/j.log", "state_dir": "/var/lib/dflash-units/dflash-train", "stop_timeout": 30,
        "restart": {"policy": "on-failure", "delay": 5, "burst": 3, "interval": 300}}


def systemd_run_args(spec):
    from ansible.module_utils.dflash_unit_systemd import systemd_run_args

    return systemd_run_args(spec)


def hook_unit_text(spec):
    from ansible.module_utils.dflash_unit_systemd import hook_unit_text

    return hook_unit_text(spec)


def _properties(args):
    return [args[i + 1] for i, word in enumerate(args[:-1]) if word == "-p"]


@pytest.mark.parametrize(("watchdog", "expected"), [
    ({"interval": 60, "start_interval": 900}, "WatchdogSec=900s"),  # the start-up allowance first
    ({"interval": 60, "start_interval": 0}, "WatchdogSec=60s"),
    ({"interval": 600, "start_interval": 30}, "WatchdogSec=600s"),  # never below the steady interval
])
def test_a_unit_asked_for_a_watchdog_has_one(watchdog, expected):
    props = _properties(systemd_run_args({**SPEC, "watchdog": watchdog}))
    assert [p for p in props if p.startswith("WatchdogSec=")] == [expected]
    assert "NotifyAccess=main" in props  # the trainer's pings reach systemd


@pytest.mark.parametrize("watchdog", [None, {"interval": 0, "start_interval": 900}])
def test_a_unit_without_a_watchdog_has_none(watchdog):
    props = _properties(systemd_run_args({**SPEC, "watchdog": watchdog}))
    assert not [p for p in props if p.startswith(("WatchdogSec=", "NotifyAccess="))]


def test_the_failure_hooks_command_keeps_each_word_whole():
    """ExecStart= of the hook unit: an argument with spaces, `;`, quotes or `$` stays one word, unexpanded."""
    hook = ["/usr/bin/notify", "--message", "job failed; restarts exhausted", 'say "hi"', "$HOME", "100%", "a\\b"]
    text = hook_unit_text({**SPEC, "on_failure": hook})
    [exec_start] = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    words = shlex.split(exec_start.removeprefix("ExecStart="))
    # systemd's own escapes: $$ is a literal $, %% a literal %
    assert [w.replace("$$", "$").replace("%%", "%") for w in words] == hook
    assert "OnFailure=dflash-train-on-failure.service" in _properties(systemd_run_args({**SPEC, "on_failure": hook}))
