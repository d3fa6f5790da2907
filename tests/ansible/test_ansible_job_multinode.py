"""The job role's preflight of a multi-node job on this machine (local connection, two inventory hosts):
its nodes run together or not at all, so a run that leaves one out is refused, naming it and the fix; a
container missing from dflash_job_nodes, a missing rendezvous address and nodes naming different jobs
are refused the same way; the whole job passes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, tool

pytestmark = pytest.mark.slow


def preflight(tmp_path, limit=None, **overrides):
    (tmp_path / "venv" / "bin").mkdir(parents=True, exist_ok=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    (tmp_path / "job.env").write_text("")
    common = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
              "dflash_job_name": "mn", "dflash_job_venv": str(tmp_path / "venv"),
              "dflash_job_env_file": str(tmp_path / "job.env"), "dflash_job_nodes": ["node-a", "node-b"],
              "dflash_job_rendezvous_address": "10.0.0.5"}
    hosts = {name: {**common, **overrides.get(name, {})} for name in ("node-a", "node-b")}
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {"dflash_containers": {"hosts": hosts}}}}))
    play = [{"name": "Preflight", "hosts": "dflash_containers", "gather_facts": False,
             "tasks": [{"name": "Preflight", "ansible.builtin.include_role": {"name": "job", "tasks_from": "preflight.yml"}}]}]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / ".ansible-tmp")}
    argv = [tool("ansible-playbook"), "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml"),
            "-e", f"dflash_job_source_dir={ROOT}"] + (["--limit", limit] if limit else [])
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, " ".join((proc.stdout + proc.stderr).split())


def test_the_whole_job_passes(tmp_path):
    rc, out = preflight(tmp_path)
    assert rc == 0, out[-3000:]


def test_a_run_that_leaves_out_a_node_is_refused(tmp_path):
    rc, out = preflight(tmp_path, limit="node-a")
    assert rc != 0
    assert ("this run leaves out node(s) ['node-b'] of the multi-node job mn: its nodes start together or not at all; "
            "run without --limit, or limit it to all of ['node-a', 'node-b']") in out


def test_a_container_not_in_its_jobs_nodes_is_refused(tmp_path):
    rc, out = preflight(tmp_path, **{"node-b": {"dflash_job_nodes": ["node-a", "node-c"]}})
    assert rc != 0 and "node-b is not in dflash_job_nodes ['node-a', 'node-c'] of its job mn" in out


def test_a_missing_rendezvous_address_is_refused(tmp_path):
    rc, out = preflight(tmp_path, **{n: {"dflash_job_rendezvous_address": ""} for n in ("node-a", "node-b")})
    assert rc != 0 and "dflash_job_rendezvous_address is empty: set it to the address of node 0 (node-a)" in out


def test_nodes_that_name_different_jobs_are_refused(tmp_path):
    rc, out = preflight(tmp_path, **{"node-b": {"dflash_job_name": "other"}})
    assert rc != 0 and "name different jobs (['mn', 'other']): set dflash_job_name once for all of them" in out
