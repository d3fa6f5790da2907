"""The operator sees progress (issue 32 item 4): a hung job's diagnosis says when the watchdog acts, `make status`
shows the last checkpoint in every state (training too), and a failed health check's diagnosis is printed once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml
from ansible.module_utils.dflash_health import check_health
from ansible.module_utils.dflash_host import LocalHost
from test_ansible_health import ACTIVE, Trainer, params, write_heartbeat

from dflash.ops.results import ContainerStatus, _describe

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "roles" / "job" / "tasks"


def hung(tmp_path, heartbeat_age=100.0, **kw):
    """A snapshot of a job whose step 7 is `heartbeat_age` seconds old (hung for a 30 s window)."""
    (tmp_path / "job.log").write_text("step 7\n")
    os.utime(tmp_path / "job.log", (time.time() - 100, time.time() - 100))
    write_heartbeat(tmp_path / "heartbeat.json", 7, age=heartbeat_age)
    result = check_health(LocalHost(), params(tmp_path, timeout=0, progress_window=30, **kw), lambda: dict(ACTIVE))
    assert result["state"] == "hung"
    return result


def watchdog_lines(result):
    return [line for line in result["diagnosis"].splitlines() if line.startswith("watchdog: ")]


def test_a_hung_jobs_diagnosis_says_when_the_watchdog_acts(tmp_path):
    result = hung(tmp_path, watchdog=600)
    [line] = watchdog_lines(result)
    # 600 s after the last step's ping, which was 100 s (and a little) ago
    assert line.startswith("watchdog: it acts in about ") and "(600s after the last step's ping, step 7 " in line
    remaining = int(line.removeprefix("watchdog: it acts in about ").split("s ", 1)[0])
    assert 495 <= remaining <= 500
    assert line in result["hint"] and result["hint"].startswith("restart it with -e dflash_job_state=restarted")
    # the lines before it stay: the restart command, then the hang evidence
    lines = result["diagnosis"].splitlines()
    restart = next(i for i, text in enumerate(lines) if text.startswith("the job is hung: "))
    stacks = next(i for i, text in enumerate(lines) if text.startswith("stacks: "))
    assert restart < stacks < lines.index(line)


def test_without_a_watchdog_a_hung_job_stays_hung_until_restarted(tmp_path):
    for kw in ({}, {"watchdog": 0}):
        [line] = watchdog_lines(hung(tmp_path, **kw))
        assert line == "watchdog: none (dflash_job_watchdog 0): it stays hung until restarted"


def test_a_watchdog_whose_interval_ran_out_acts_now(tmp_path):
    [line] = watchdog_lines(hung(tmp_path, heartbeat_age=100, watchdog=60))
    assert line.startswith("watchdog: its 60s after the last step's ping (step 7) ran out ")
    assert "it acts now" in line


def test_before_the_first_step_the_watchdog_is_the_start_up_interval(tmp_path):
    (tmp_path / "job.log").write_text("loading\n")
    os.utime(tmp_path / "job.log", (time.time() - 100, time.time() - 100))
    write_heartbeat(tmp_path / "heartbeat.json", 0, status="training", age=100)
    result = check_health(LocalHost(), params(tmp_path, timeout=0, progress_window=30, watchdog=600),
                          lambda: dict(ACTIVE))  # fmt: skip
    assert result["state"] == "hung"
    [line] = watchdog_lines(result)
    assert "dflash_job_watchdog_start" in line


def test_a_training_job_has_no_watchdog_line(tmp_path):
    trainer = Trainer(tmp_path)
    trainer.start()
    try:
        result = check_health(LocalHost(), params(tmp_path, watchdog=600), lambda: dict(ACTIVE))
    finally:
        trainer.running = False
    assert result["state"] == "training" and not watchdog_lines(result) and result["hint"] is None


@pytest.mark.parametrize("state", ["training", "starting", "hung", "stopped", "crashed"])
def test_make_status_shows_the_last_checkpoint_in_every_state(state):
    """`make status` is `dflash ops status`: one line per job, the checkpoint in it whatever the state."""
    line = _describe(ContainerStatus(host="c1", state=state, step=40, tokens_per_s=1234.0 if state == "training" else None,
                                     checkpoint="step-00000040"))  # fmt: skip
    assert "checkpoint step-00000040" in line


def test_status_yml_shows_the_last_checkpoint_and_the_watchdog(tmp_path):
    """roles/job/templates/status.txt.j2 (playbooks/status.yml), rendered as Ansible renders it (trim_blocks)."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters.update(dirname=os.path.dirname, bool=bool)
    template = env.from_string((ROOT / "roles" / "job" / "templates" / "status.txt.j2").read_text())
    result = hung(tmp_path, watchdog=600)
    health = {**result, "checkpoint": "step-00000040"}
    variables = {"inventory_hostname": "c1", "dflash_job_name": "job", "_dflash_job_multinode": False,
                 "_dflash_job_gpu_ids": [], "dflash_job_log_path": "/log"}  # fmt: skip
    lines = template.render(dflash_job_health=health, **variables).splitlines()
    assert "checkpoint step-00000040" in lines
    assert any(line.strip().startswith("restart it with") and "watchdog: it acts in about " in line for line in lines)
    training = {**health, "state": "training", "ok": True, "failures": [], "hint": None}
    assert "checkpoint step-00000040" in template.render(dflash_job_health=training, **variables).splitlines()


def _tasks(path):
    """Every task of a tasks file, blocks flattened."""
    out = []
    for task in yaml.safe_load(path.read_text()) or []:
        out.append(task)
        out.extend(t for t in task.get("block", []) + task.get("rescue", []) + task.get("always", []))
    return out


def _prints_a_diagnosis(task):
    printer = task.get("ansible.builtin.fail") or task.get("ansible.builtin.debug") or {}
    msg = str(printer.get("msg", ""))
    return "diagnosis" in msg or "rollback.txt.j2" in msg


def test_a_failed_health_checks_diagnosis_is_printed_once():
    """verify.yml: the health check fails with the diagnosis as its message, and no later task prints it again.
    launch.yml: the check reports only; one of two exclusive fail tasks prints it (rolled back or not)."""
    verify = _tasks(TASKS / "verify.yml")
    [check] = [t for t in verify if "dflash_health" in t]
    assert check["dflash_health"].get("fail_on_unhealthy", True) is True
    assert not [t["name"] for t in verify if _prints_a_diagnosis(t)]
    summary = (ROOT / "roles" / "job" / "templates" / "summary.txt.j2").read_text()
    assert "diagnosis" not in summary
    launch = _tasks(TASKS / "launch.yml")
    assert all(t["dflash_health"].get("fail_on_unhealthy") is False for t in launch if "dflash_health" in t)
    printers = [t for t in launch if _prints_a_diagnosis(t)]
    assert len(printers) == 2, [t["name"] for t in printers]
    no_rollback, rollback = printers
    assert "not _dflash_job_rolling_back | bool" in no_rollback["when"]
    [block] = [t for t in yaml.safe_load((TASKS / "launch.yml").read_text()) if rollback in t.get("block", [])]
    assert block["when"] == "_dflash_job_rolling_back | bool"


FAKE_BUILD = """#!/bin/sh
# dflash-build-rootfs's contract: CACHE SUITE MIRROR PACKAGES; the marker last; `built rootfs cache` on stdout
set -eu
cache="$1"
[ "$2" = bookworm ] && [ "$4" = "systemd,python3" ] || { echo "bad arguments: $*" >&2; exit 2; }
sleep "${FAKE_BUILD_SECONDS:-0}"
[ -z "${FAKE_BUILD_FAIL:-}" ] || { echo "debootstrap: E: Failed getting release file" >&2; exit 1; }
mkdir -p "$cache" && echo "$4" > "$cache/.dflash-rootfs-complete"
echo "built rootfs cache $cache"
"""


def run_rootfs_build(tmp_path, *args, **env):
    """roles/container/tasks/lxc/rootfs.yml on localhost (its apt task left out), with a fake debootstrap script."""
    import subprocess
    import sys

    role = tmp_path / "roles" / "container"
    (role / "tasks").mkdir(parents=True, exist_ok=True)
    (role / "files").mkdir(exist_ok=True)
    tasks = yaml.safe_load((ROOT / "roles" / "container" / "tasks" / "lxc" / "rootfs.yml").read_text())
    assert tasks[0]["name"] == "Install the LXC host tools"
    (role / "tasks" / "rootfs.yml").write_text(yaml.safe_dump(tasks[1:], sort_keys=False))
    (role / "files" / "dflash-build-rootfs").write_text(FAKE_BUILD)
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "Build", "hosts": "localhost", "connection": "local", "gather_facts": False,
        "vars": {"dflash_container_rootfs_cache": str(tmp_path / "cache" / "bookworm"),
                 "dflash_container_debian_suite": "bookworm", "dflash_container_debian_mirror": "http://mirror",
                 "dflash_container_rootfs_packages": ["systemd", "python3"]},
        "tasks": [{"name": "Rootfs", "ansible.builtin.include_role": {"name": "container", "tasks_from": "rootfs.yml"}}],
    }]))  # fmt: skip
    environ = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_ROLES_PATH": str(tmp_path / "roles"),
               "ANSIBLE_PYTHON_INTERPRETER": sys.executable, "ANSIBLE_ASYNC_DIR": str(tmp_path / "async"),
               "ANSIBLE_NOCOLOR": "1", **env}  # fmt: skip
    return subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", *args, str(playbook)],
                          cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300)  # fmt: skip


def test_the_rootfs_build_prints_what_it_waits_for_every_10_s_until_it_is_built(tmp_path):
    proc = run_rootfs_build(tmp_path, FAKE_BUILD_SECONDS="12")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    waits = [line for line in proc.stdout.splitlines()
             if line.startswith("FAILED - RETRYING: [localhost]: Wait for the rootfs build (debootstrap")]
    assert waits, proc.stdout  # 12 s: at least one line from the wait before it ended
    assert (tmp_path / "cache" / "bookworm" / ".dflash-rootfs-complete").read_text() == "systemd,python3\n"
    assert "changed: [localhost]" in proc.stdout.split("Wait for the rootfs build")[-1]
    again = run_rootfs_build(tmp_path)  # built: the build and its wait are skipped
    assert again.returncode == 0 and "changed=0" in again.stdout and "skipped=4" in again.stdout, again.stdout


def test_a_failed_rootfs_build_fails_the_wait_with_its_error(tmp_path):
    proc = run_rootfs_build(tmp_path, FAKE_BUILD_FAIL="1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "debootstrap: E: Failed getting release file" in proc.stdout
    assert not (tmp_path / "cache" / "bookworm" / ".dflash-rootfs-complete").exists()


def test_check_mode_builds_no_rootfs(tmp_path):
    proc = run_rootfs_build(tmp_path, "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "cache").exists()
