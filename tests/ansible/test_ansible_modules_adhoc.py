"""The modules end to end through Ansible with a local connection (AnsiballZ, module_utils shipping,
argument_spec, check mode, diff). One playbook run registers every result; the tests read them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, tool

LOOP = "import time\nwhile True:\n    print('step', flush=True)\n    time.sleep(0.2)"
CRASH = "echo 'dflash: error: target.path /models/x does not exist; fix target.path' >&2; exit 2"


def _tasks(tmp):
    unit = {"name": "adhoc-job", "backend": "daemon", "command": [sys.executable, "-u", "-c", LOOP], "log_path": f"{tmp}/job.log",
            "config_path": f"{tmp}/run.yaml", "environment_file": f"{tmp}/job.env", "environment": {"PYTHONPATH": "/opt/dflash/current", "HF_TOKEN": "s3cret-one"},
            "working_directory": tmp, "state_dir": f"{tmp}/state", "stop_timeout": 5}  # fmt: skip
    crash = {**unit, "name": "adhoc-crash", "command": ["sh", "-c", CRASH], "state_dir": f"{tmp}/crash-state", "log_path": f"{tmp}/crash.log"}
    health = {"name": "adhoc-crash", "backend": "daemon", "state_dir": f"{tmp}/crash-state", "log_path": f"{tmp}/crash.log",
              "heartbeat_path": f"{tmp}/heartbeat.json", "timeout": 30, "poll_interval": 1}  # fmt: skip
    sync = {"src": f"{tmp}/staging", "dest": f"{tmp}/opt", "keep": 2}
    write = [
        {"ansible.builtin.copy": {"content": "seed: 0\n", "dest": f"{tmp}/run.yaml", "mode": "0644"}},
        {"ansible.builtin.copy": {"content": "OMP_NUM_THREADS=1\n", "dest": f"{tmp}/job.env", "mode": "0644"}},
        {"ansible.builtin.copy": {"content": "v1\n", "dest": f"{tmp}/staging/dflash/train.py", "mode": "0644"}},
    ]
    tasks = [
        *write,
        {"dflash_unit": unit, "register": "start1"},
        {"dflash_unit": unit, "register": "start2"},
        {"ansible.builtin.copy": {"content": "seed: 1\n", "dest": f"{tmp}/run.yaml", "mode": "0644"}},
        {"dflash_unit": unit, "register": "check3", "check_mode": True, "diff": True},
        {"dflash_unit": {**unit, "environment": {**unit["environment"], "HF_TOKEN": "s3cret-two"}}, "register": "check3_env",
         "check_mode": True, "diff": True},
        {"dflash_unit": unit, "register": "start3"},
        {"dflash_unit": {**unit, "state": "stopped"}, "register": "stop4"},
        {"dflash_unit": {**unit, "state": "absent"}, "register": "absent5"},
        {"dflash_unit": {"name": "x", "backend": "daemon"}, "register": "err_missing", "ignore_errors": True},
        {"dflash_unit": {"name": "x", "backend": "daemon", "command": ["true"], "log_path": f"{tmp}/l", "environment_file": f"{tmp}/nope.env"},
         "register": "err_envfile", "ignore_errors": True},
        {"dflash_unit": crash, "register": "crash_start"},
        {"dflash_health": health, "register": "health_fail", "ignore_errors": True},
        {"dflash_health": {**health, "timeout": 0, "fail_on_unhealthy": False}, "register": "health_report"},
        {"dflash_unit": {**crash, "state": "absent"}},
        {"dflash_sync": sync, "register": "sync1", "diff": True},
        {"dflash_sync": sync, "register": "sync2"},
        {"dflash_gpu_facts": {}, "register": "gpu_required", "ignore_errors": True},
        {"dflash_gpu_facts": {"required": False}, "register": "gpu_optional"},
    ]
    names = ["start1", "start2", "check3", "check3_env", "start3", "stop4", "absent5", "err_missing", "err_envfile", "crash_start",
             "health_fail", "health_report", "sync1", "sync2", "gpu_required", "gpu_optional"]  # fmt: skip
    dump = {"ansible.builtin.copy": {"content": "{{ {" + ", ".join(f"'{n}': {n}" for n in names) + "} | to_json }}",
                                     "dest": f"{tmp}/results.json", "mode": "0644"}}  # fmt: skip
    return [{"name": f"step {i}", **t} for i, t in enumerate([*tasks, dump])]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adhoc")
    (tmp / "staging" / "dflash").mkdir(parents=True)
    play = [{"name": "dflash modules end to end", "hosts": "localhost", "gather_facts": False, "tasks": _tasks(str(tmp))}]
    (tmp / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    env = {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1", "PATH": f"{sys.prefix}/bin:/usr/bin:/bin",
           "HOME": str(tmp), "ANSIBLE_LOCAL_TEMP": str(tmp / ".ansible-tmp")}  # fmt: skip
    proc = subprocess.run(
        [tool("ansible-playbook"), "-i", "localhost,", "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}", str(tmp / "play.yml")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    data = json.loads((tmp / "results.json").read_text())
    data["_stdout"] = proc.stdout
    return data


def test_unit_started_twice_is_idempotent(results):
    first, second = results["start1"], results["start2"]
    assert first["changed"] and first["action"] == "started" and first["active_state"] == "active"
    assert not second["changed"] and second["action"] == "none" and second["main_pid"] == first["main_pid"]


def test_config_change_restarts_and_check_mode_only_reports(results):
    first, checked, third = results["start1"], results["check3"], results["start3"]
    assert checked["changed"] and checked["action"] == "restarted" and checked["main_pid"] == first["main_pid"]
    # --diff shows the launch spec: the config's changed line, the environment's names, never a value or a hash.
    before, after = checked["diff"]["before"], checked["diff"]["after"]
    assert "  seed: 0" in before and "  seed: 1" in after and "-  seed: 0" in results["_stdout"]
    assert after.startswith(f"command: {sys.executable} -u -c ") and "\nuser: -\nworking_directory: /" in after
    assert "environment keys: HF_TOKEN, PYTHONPATH" in after and "environment_file keys: OMP_NUM_THREADS" in after
    assert "environment values: not shown" in after and first["config_hash"] not in before + after
    env_change = results["check3_env"]
    assert env_change["action"] == "restarted" and "environment values: changed (not shown)" in env_change["diff"]["after"]
    assert "+environment values: changed (not shown)" in results["_stdout"]
    assert "s3cret" not in results["_stdout"] and "s3cret" not in json.dumps(results)
    assert third["changed"] and third["action"] == "restarted"
    assert third["previous_hash"] == first["config_hash"] and third["config_hash"] != first["config_hash"]
    assert third["main_pid"] != first["main_pid"] and third["active_state"] == "active"


def test_stop_keeps_exit_status_and_absent_cleans_up(results):
    stop, absent = results["stop4"], results["absent5"]
    assert stop["action"] == "stopped" and stop["active_state"] != "active" and stop["exit_status"] == 143
    assert absent["action"] == "removed" and absent["changed"]


def test_argument_errors_are_clear(results):
    assert results["err_missing"]["failed"]
    assert "state is started but all of the following are missing: command, log_path" in results["err_missing"]["msg"]
    assert results["err_envfile"]["failed"] and "nope.env does not exist: write it first" in results["err_envfile"]["msg"]


def test_health_failure_carries_the_trainers_error(results):
    fail = results["health_fail"]
    assert fail["failed"] and not fail["healthy"] and fail["unit"]["exit_status"] == 2
    assert "unit failed: exit status 2" in fail["msg"]
    assert "dflash: error: target.path /models/x does not exist; fix target.path" in fail["msg"]
    # The play output shows it too (what an operator sees).
    assert "dflash: error: target.path /models/x does not exist" in results["_stdout"]
    report = results["health_report"]
    assert not report.get("failed") and not report["healthy"] and "unit" in report["failed_invariants"]


def test_sync_twice(results):
    first, second = results["sync1"], results["sync2"]
    assert first["changed"] and first["files_added"] == ["dflash/train.py"]
    assert not second["changed"] and second["release"] == first["release"]


def test_gpu_facts_without_nvidia_smi(results):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    assert results["gpu_required"]["failed"] and "nvidia-smi not found" in results["gpu_required"]["msg"]
    facts = results["gpu_optional"]["ansible_facts"]
    assert facts["dflash_gpus"] == [] and facts["dflash_gpu_available"] is False
    assert "nvidia-smi not found" in facts["dflash_gpu_error"]
