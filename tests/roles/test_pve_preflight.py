"""The Proxmox node check (roles/container/files/dflash-pve-preflight), run as the node runs it: plain python3 with a
`pveversion` on PATH (a stand-in printing a node's versions) over a scratch directory tree. Each refusal is one line
naming the thing and its fix; a first run's sources and node pass."""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from .conftest import ROOT

SCRIPT = ROOT / "roles" / "container" / "files" / "dflash-pve-preflight"


def node(tmp_path: Path, manager="8.2.4", container="5.1.12") -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "pveversion").write_text(
        f"#!/bin/sh\necho 'proxmox-ve: 8.2.0 (running kernel: 6.8.4-2-pve)'\necho 'pve-manager: {manager} (running "
        f"version: {manager}/abc)'\necho 'pve-container: {container}'\n")
    (bin_dir / "pveversion").chmod(0o755)
    (tmp_path / "sys" / "class" / "net" / "vmbr0" / "bridge").mkdir(parents=True, exist_ok=True)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def check(tmp_path, env, **args) -> dict:
    args = {"node": "pve-gpu01", "bridges": ["vmbr0"], "devn": True, "mounts": [],
            "storage_root": str(tmp_path / "mnt-pve"), "sysfs": str(tmp_path / "sys"), **args}
    out = subprocess.run(["python3", str(SCRIPT), json.dumps(args)], env={**os.environ, **env}, capture_output=True,
                         text=True, check=True, timeout=60)  # fmt: skip
    return json.loads(out.stdout)


def test_a_first_run_passes_and_reports_the_versions(tmp_path):
    env = node(tmp_path)
    models = tmp_path / "models" / "Qwen3-8B"
    models.mkdir(parents=True)
    (models / "config.json").write_text("{}")
    got = check(tmp_path, env, reader_uid=os.getuid(), reader_gid=os.getgid(), mounts=[{"src": str(models), "readonly": True},
                                       {"src": str(tmp_path / "runs"), "readonly": False}])  # fmt: skip
    assert got["problems"] == [] and got["pve"] == "8.2.4" and got["pve_container"] == "5.1.12"
    assert got["debian13"] is False and got["debian_major"] > 0


def test_each_refusal_names_its_fix(tmp_path):
    env = node(tmp_path, manager="8.0.4", container="5.3.5")
    real = tmp_path / "real-models"
    real.mkdir()
    (tmp_path / "models").symlink_to(real)
    storage = tmp_path / "mnt-pve" / "cephfs"
    storage.mkdir(parents=True)  # a mount point whose storage is not mounted: the node's local disk
    # Under a directory anyone may enter (pytest's own tmp root is 0700): only the source itself is closed.
    open_dir = Path(tempfile.mkdtemp(prefix="dflash-preflight-"))
    open_dir.chmod(0o755)
    secret = open_dir / "data"
    secret.mkdir(mode=0o700)
    got = check(tmp_path, env, bridges=["vmbr1"], reader_uid=100990, reader_gid=100990, mounts=[
        {"src": str(tmp_path / "models" / "Qwen3-8B"), "readonly": True},
        {"src": str(storage / "dflash"), "readonly": False},
        {"src": str(tmp_path / "typo"), "readonly": True},
        {"src": str(secret), "readonly": True}])  # fmt: skip
    problems = got["problems"]
    assert got["debian13"] is True
    assert len(problems) == 6, problems
    assert "pve-manager 8.0.4, which has no devN passthrough (added in 8.1)" in problems[0]
    assert "dflash_container_gpu_passthrough: legacy" in problems[0]
    assert problems[1].startswith("bridge vmbr1 (dflash_container_pct_net0) does not exist on pve-gpu01")
    assert f"has a symlink in its path ({tmp_path}/models -> {real})" in problems[2]
    assert f"use the real path {real}/Qwen3-8B" in problems[2]
    assert f"is under {storage}, which is not mounted" in problems[3] and not (storage / "dflash").exists()
    assert f"{tmp_path}/typo on pve-gpu01 does not exist (a read-only source is never created)" in problems[4]
    assert f"{secret} is not readable by the container's trainer (node uid 100990)" in problems[5]
    assert f"chmod -R o+rX {secret}" in problems[5]
    assert all("\n" not in p for p in problems)
    shutil.rmtree(open_dir)


def test_not_a_proxmox_node(tmp_path):
    got = check(tmp_path, {"PATH": "/usr/bin:/bin"})
    assert "`pveversion -v` gives nothing on pve-gpu01: this is not a Proxmox VE node" in got["problems"][0]


def test_a_driver_older_than_the_torch_index_needs_is_refused(tmp_path):
    env = node(tmp_path)
    (tmp_path / "version").write_text("570.124.06\n")
    got = check(tmp_path, env, gpus=True, driver_version_file=str(tmp_path / "version"), torch_index_url="")
    assert got["problems"] == [
        "the NVIDIA driver 570.124.06 on pve-gpu01 is older than torch's CUDA 13 build needs (580.65.06 or newer; torch "
        "index PyPI): set dflash_venv_torch_index_url to https://download.pytorch.org/whl/cu128 (a build that has "
        "dflash_venv_torch_version), or upgrade the node's driver"]
    fits = check(tmp_path, env, gpus=True, driver_version_file=str(tmp_path / "version"),
                 torch_index_url="https://download.pytorch.org/whl/cu128")  # fmt: skip
    assert fits["problems"] == []
    assert check(tmp_path, env, gpus=False, driver_version_file=str(tmp_path / "version"))["problems"] == []


def test_the_provision_runs_the_preflight_before_the_node_role_and_the_containers():
    import yaml

    plays = yaml.safe_load((ROOT / "playbooks" / "provision.yml").read_text())
    names = [p["name"] for p in plays]
    preflight = names.index("Preflight on the nodes")
    node = next(i for i, p in enumerate(plays) if "node" in [r["role"] if isinstance(r, dict) else r for r in p.get("roles") or []])
    assert preflight < node
    include = plays[preflight]["tasks"][0]["ansible.builtin.include_role"]
    assert include["name"] == "container" and include["tasks_from"] == "preflight.yml"


@pytest.fixture
def torch_index(tmp_path):
    """A PEP 503 torch page as a CUDA build's index serves it (torch 2.9.1 and 2.10.0 only), over local HTTP."""
    root = tmp_path / "index"
    (root / "whl" / "cu128" / "torch").mkdir(parents=True)
    (root / "whl" / "cu128" / "torch" / "index.html").write_text("".join(
        f'<a href="/whl/cu128/torch-{v}%2Bcu128-cp311-cp311-manylinux_2_28_x86_64.whl#sha256=00">'
        f"torch-{v}+cu128-cp311-cp311-manylinux_2_28_x86_64.whl</a><br/>\n" for v in ("2.9.1", "2.10.0")))
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cu128"
    server.shutdown()


def test_a_torch_version_the_index_lacks_is_refused_at_first_contact(tmp_path, torch_index):
    env = node(tmp_path)
    (tmp_path / "version").write_text("570.124.06\n")
    common = {"gpus": True, "driver_version_file": str(tmp_path / "version"), "torch_index_url": torch_index,
              "torch_find_links": ["/opt/wheels"]}
    got = check(tmp_path, env, creating=True, torch_version="2.13.0", **common)
    assert got["problems"] == [
        f"torch 2.13.0 (dflash_venv_torch_version) is not on the torch index {torch_index} (its newest: 2.9.1, "
        "2.10.0) nor in dflash_venv_find_links: set dflash_venv_torch_version to one it has, or "
        "dflash_venv_torch_index_url to an index that has it, or put its wheel in a find-links directory"]
    assert check(tmp_path, env, creating=True, torch_version="2.10.0", **common)["problems"] == []
    # A later run leaves it to the venv role; an index the node cannot read is left to pip.
    assert check(tmp_path, env, creating=False, torch_version="2.13.0", **common)["problems"] == []
    unreachable = {**common, "torch_index_url": "http://127.0.0.1:9/whl/cu128"}
    assert check(tmp_path, env, creating=True, torch_version="2.13.0", **unreachable)["problems"] == []


def test_a_torch_wheel_in_a_mounted_wheelhouse_passes(tmp_path, torch_index):
    env = node(tmp_path)
    (tmp_path / "version").write_text("570.124.06\n")
    wheels = tmp_path / "wheelhouse" / "cu128"
    wheels.mkdir(parents=True)
    (wheels / "torch-2.13.0+cu128-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    got = check(tmp_path, env, creating=True, torch_version="2.13.0", gpus=True, torch_index_url=torch_index,
                driver_version_file=str(tmp_path / "version"), torch_find_links=["/opt/wheels/cu128"],
                mounts=[{"src": str(tmp_path / "wheelhouse"), "dest": "/opt/wheels", "readonly": False}])  # fmt: skip
    assert got["problems"] == []
