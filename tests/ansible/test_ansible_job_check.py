"""The deploy's check of the run config and its data (roles/job/tasks/configure.yml, `dflash_check`): it runs as the
job's user, in the job's environment, and no value of that environment is ever on a command line (every process's
/proc/PID/cmdline is world-readable): sampled by a stand-in trainer during its check and by this test during the whole
play. A data file the trainer cannot read is refused before the config is written, as a data error."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, tool

SECRET = "hf_S3CRET-d0-not-show-7c1e"
USER = "daemon"  # an account of every Debian, with a group of its name (the role sets both)

# Stands in for `VENV/bin/python -m dflash train CONFIG --check --check-data`: what it is, sees and reads.
FAKE_CHECK = """#!/bin/sh
out=__OUT__
id -u > "$out/uid"
if [ -r "$4" ]; then echo readable > "$out/config"; fi
printf '%s' "$HF_TOKEN" > "$out/token"
printf '%s' "$HOME" > "$out/home"
for f in /proc/[0-9]*/cmdline; do tr '\\000' ' ' < "$f" 2>/dev/null; echo; done > "$out/cmdlines"
echo "config OK: $4"
"""


def _sample(stop, found):
    """Every process's command line, every 20 ms, until ``stop``: any holding the secret."""
    while not stop.is_set():
        for path in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                text = path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if SECRET in text:
                found.append(text)
        time.sleep(0.02)


@pytest.fixture
def world():
    """A tree the job's user can traverse (pytest's temp directories are root's 0700)."""
    base = Path(tempfile.mkdtemp(prefix="dflash-check-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(os.getuid() != 0, reason="runs the check as another account")
def test_the_check_runs_as_the_jobs_user_with_no_secret_on_a_command_line(world):
    account = pwd.getpwnam(USER)
    out = world / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    repo = world / "repo"
    (repo / "configs").mkdir(parents=True)
    readable, private = world / "data.jsonl", world / "private.jsonl"
    readable.write_text('{"messages": []}\n')
    readable.chmod(0o644)
    private.write_text('{"messages": []}\n')
    private.chmod(0o600)  # root's: the trainer cannot read it
    (repo / "configs" / "fake.yaml").write_text(yaml.safe_dump({"output_dir": "x", "seed": 0,
                                                                "data": {"train_path": str(readable)}}))  # fmt: skip
    (world / "venv" / "bin").mkdir(parents=True)
    (world / "venv" / "bin" / "python").write_text(FAKE_CHECK.replace("__OUT__", str(out)))
    (world / "venv" / "bin" / "python").chmod(0o755)
    (world / "etc").mkdir()
    (world / "etc" / "job.env").write_text('OMP_NUM_THREADS="1"\n')
    (world / "etc" / "job.env").chmod(0o600)
    config = world / "etc" / "job.yaml"
    host = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, "dflash_job_name": "checkjob",
            "dflash_job_source_dir": str(repo), "dflash_job_base_config": "fake.yaml", "dflash_job_venv": str(world / "venv"),
            "dflash_job_user": USER, "dflash_job_root": str(world / "opt"), "dflash_job_run_dir": str(world / "run"),
            "dflash_job_config_path": str(config), "dflash_job_log_path": str(world / "log" / "job.log"),
            "dflash_job_env_file": str(world / "etc" / "job.env"), "dflash_job_environment": {"HF_TOKEN": SECRET}}  # fmt: skip
    (world / "hosts.yml").write_text(json.dumps({"all": {"children": {"dflash_containers": {"hosts": {"here": host}}}}}))
    configure = {"name": "job", "tasks_from": "configure.yml"}
    play = [{"name": "Check", "hosts": "dflash_containers", "gather_facts": False, "tasks": [
        {"name": "Configure", "ansible.builtin.include_role": configure},
        {"name": "Configure with data the trainer cannot read", "block": [
            {"name": "Configure", "ansible.builtin.include_role": configure,
             "vars": {"dflash_job_config": {"seed": 1, "data": {"train_path": str(private)}}}}],
         "rescue": [{"name": "Keep", "ansible.builtin.copy": {"dest": str(world / "refused.json"), "mode": "0600",
                                                               "content": "{{ ansible_failed_result | to_json }}"}}]},
    ]}]  # fmt: skip
    (world / "play.yml").write_text(yaml.safe_dump(play))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(world / ".ansible-tmp")}  # fmt: skip
    stop, found = threading.Event(), []
    sampler = threading.Thread(target=_sample, args=(stop, found), daemon=True)
    sampler.start()
    try:
        proc = subprocess.run([tool("ansible-playbook"), "-i", str(world / "hosts.yml"), str(world / "play.yml")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    finally:
        stop.set()
        sampler.join()
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    # the check ran, as the job's user, with the job's environment, and read its config (a temp file it can read)
    assert (out / "uid").read_text().strip() == str(account.pw_uid)
    assert (out / "token").read_text() == SECRET and (out / "home").read_text() == account.pw_dir
    assert (out / "config").read_text() == "readable\n"
    # no command line held the secret: not during the check (every process then), nor in the whole play
    cmdlines = (out / "cmdlines").read_text()
    assert "--check --check-data" in cmdlines and SECRET not in cmdlines
    assert not found, found[:3]
    assert SECRET not in proc.stdout + proc.stderr
    assert "seed: 0" in config.read_text()
    # the data file only root can read: refused before anything was written, as a data error
    refused = json.loads((world / "refused.json").read_text())
    assert refused["failure_class"] == "data_error" and refused["rc"] == 3, refused
    assert f"data file {private} cannot be read by the job's user {USER} (Permission denied)" in refused["msg"]
    assert "seed: 0" in config.read_text() and "seed: 1" not in config.read_text()
    assert not list(config.parent.glob(".job.yaml.check-*"))  # the temp file is gone
