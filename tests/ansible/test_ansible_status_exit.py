"""status.yml, `dflash ops status` (and `make status`, which runs it) exit alike: 1 for an unhealthy job, 2 for bad
input; and print the same report lines of the job (state, the failed invariants, the restarts line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _inventory(tmp_path, **extra):
    job = tmp_path / "job"
    (job / "etc").mkdir(parents=True)
    (job / "etc" / "job.env").write_text("")
    (job / "opt" / "unit").mkdir(mode=0o700, parents=True)
    (job / "opt" / "unit" / "exit_status").write_text("1\n")  # it exited 1 before its first step: failed to start
    (job / "run").mkdir()
    (job / "job.log").write_text("loading\n")
    host = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, "dflash_job_name": "broken",
            "dflash_job_backend": "daemon", "dflash_job_user": "root", "dflash_job_venv": str(ROOT / ".venv"),
            "dflash_job_root": str(job / "opt"), "dflash_job_run_dir": str(job / "run"),
            "dflash_job_log_path": str(job / "job.log"), "dflash_job_config_path": str(job / "etc" / "job.yaml"),
            "dflash_job_env_file": str(job / "etc" / "job.env"), **extra}  # fmt: skip
    path = tmp_path / "hosts.yml"
    path.write_text(json.dumps({"all": {"children": {"dflash_containers": {"hosts": {"box": host}}}}}))
    return path


def _env(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0",
               ANSIBLE_LOCAL_TEMP=str(tmp_path / ".ansible-tmp"), DFLASH_CACHE_DIR=str(tmp_path / "cache"))
    return env


STATE_DIR = "_dflash_job_unit_state_dir={{ dflash_job_root }}/unit"  # a role variable: only -e overrides it


def _status_yml(tmp_path, inventory):
    return subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory),
                           str(ROOT / "playbooks" / "status.yml"), "-e", STATE_DIR], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.mark.slow
def test_status_yml_and_dflash_ops_status_exit_1_for_an_unhealthy_job_with_the_same_lines(tmp_path):
    inventory = _inventory(tmp_path)
    played = _status_yml(tmp_path, inventory)
    assert played.returncode == 1, played.stdout[-3000:] + played.stderr[-3000:]
    ops = subprocess.run([sys.executable, "-m", "dflash", "ops", "status", "-i", str(inventory), "-q", "-e",
                          "_dflash_job_unit_state_dir='{{ dflash_job_root }}/unit'"],
                         cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert ops.returncode == 1, ops.stdout[-3000:] + ops.stderr[-3000:]
    header = "box / broken: failed-to-start (NOT HEALTHY)"
    printed = [line.strip() for line in ops.stdout.splitlines()]
    start = printed.index(header)
    report = printed[start:printed.index(next(x for x in printed[start:] if x.startswith("restarts "))) + 1]
    assert len(report) >= 3 and any(line.startswith("- unit: ") for line in report), report
    played_lines = {line.strip() for line in played.stdout.splitlines()}
    for line in report:
        assert line in played_lines, (line, played.stdout[-3000:])


@pytest.mark.slow
def test_status_yml_exits_2_for_bad_input(tmp_path):
    played = _status_yml(tmp_path, _inventory(tmp_path, dflash_job_nmae="typo"))
    assert played.returncode == 2, played.stdout[-3000:] + played.stderr[-3000:]
    assert "dflash_job_nmae" in played.stdout + played.stderr
