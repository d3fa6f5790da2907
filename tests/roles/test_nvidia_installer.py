"""Where the container role gets the NVIDIA installer of the node's driver version (roles/container/tasks/
nvidia_installer.yml), run by ansible-playbook on this machine with file:// URLs standing in for NVIDIA's trees:
the Tesla tree first (data-center drivers), then XFree86; one already on the node, or given on the controller,
is used as is; a wrong sha256 is refused; when nothing gives it, the error lists every URL tried."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from .conftest import ROOT

VERSION = "580.95.05"
NAME = f"NVIDIA-Linux-x86_64-{VERSION}.run"


def _case(name, common, **variables):
    variables = {**common, **variables}
    return {"name": name, "block": [
        {"name": "Get the installer", "ansible.builtin.include_role": {"name": "container", "tasks_from": "nvidia_installer.yml"},
         "vars": variables},
        {"name": "Keep success", "ansible.builtin.set_fact": {f"result_{name}": {"ok": True}}},
    ], "rescue": [{"name": "Keep the failure", "ansible.builtin.set_fact": {f"result_{name}": {"ok": False, "msg": "{{ ansible_failed_result.msg }}"}}}]}  # fmt: skip


def test_installer_sources(tmp_path):
    tesla, xfree = tmp_path / "tesla", tmp_path / "XFree86"
    (xfree / VERSION).mkdir(parents=True)
    (xfree / VERSION / NAME).write_text("#!/bin/sh\necho xfree86\n")
    given = tmp_path / "given.run"
    given.write_text("#!/bin/sh\necho given\n")
    urls = [f"file://{tesla}/{{version}}/NVIDIA-Linux-x86_64-{{version}}.run",
            f"file://{xfree}/{{version}}/NVIDIA-Linux-x86_64-{{version}}.run"]  # fmt: skip
    xfree_sha = hashlib.sha256((xfree / VERSION / NAME).read_bytes()).hexdigest()
    node = {k: tmp_path / k for k in ("fallback", "missing", "badsum", "given", "kept")}
    (node["badsum"]).mkdir()
    (node["badsum"] / NAME).write_text("truncated")
    (node["kept"]).mkdir()
    (node["kept"] / NAME).write_text("already here")
    common = {"_version": VERSION, "dflash_container_nvidia_installer_urls": urls}
    cases = [
        _case("fallback", common, _installer=str(node["fallback"] / NAME), dflash_container_nvidia_installer_sha256=xfree_sha),
        _case("missing", common, _installer=str(node["missing"] / NAME),
              dflash_container_nvidia_installer_urls=[f"file://{tesla}/{{version}}/a.run", f"file://{tmp_path}/nowhere/{{version}}/b.run"]),
        _case("badsum", common, _installer=str(node["badsum"] / NAME), dflash_container_nvidia_installer_sha256=xfree_sha),
        _case("given", common, _installer=str(node["given"] / NAME), dflash_container_nvidia_installer_src=str(given)),
        _case("kept", common, _installer=str(node["kept"] / NAME), dflash_container_nvidia_installer_urls=[]),
    ]  # fmt: skip
    names = [c["name"] for c in cases]
    dump = {"name": "Dump", "ansible.builtin.copy": {
        "dest": str(tmp_path / "results.json"), "mode": "0644",
        "content": "{{ {" + ", ".join(f"'{n}': result_{n}" for n in names) + "} | to_json }}"}}  # fmt: skip
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": [*cases, dump]}]))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_ROLES_PATH": str(ROOT / "roles"),
           "ANSIBLE_NOCOLOR": "1"}  # fmt: skip
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           str(playbook), "-e", json.dumps({"ansible_python_interpreter": sys.executable})],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())

    # not under the Tesla tree: the XFree86 one, its sha256 checked
    assert results["fallback"] == {"ok": True} and (node["fallback"] / NAME).read_text() == "#!/bin/sh\necho xfree86\n"
    # nowhere: one message listing each URL tried, and the ways to give it
    msg = results["missing"]["msg"]
    assert not results["missing"]["ok"] and f"No NVIDIA installer for driver {VERSION}" in msg, msg
    assert f"file://{tesla}/{VERSION}/a.run (" in msg and f"file://{tmp_path}/nowhere/{VERSION}/b.run (" in msg, msg
    assert "dflash_container_nvidia_installer_src" in msg and str(node["missing"]) in msg
    # a copy on the node with another sha256: refused, left for the operator
    assert not results["badsum"]["ok"] and f"not dflash_container_nvidia_installer_sha256 {xfree_sha}" in results["badsum"]["msg"]
    assert (node["badsum"] / NAME).read_text() == "truncated"
    # given on the controller: copied; already on the node: used, nothing fetched
    assert results["given"] == {"ok": True} and (node["given"] / NAME).read_text() == given.read_text()
    assert results["kept"] == {"ok": True} and (node["kept"] / NAME).read_text() == "already here"
