"""Where the container role gets the NVIDIA installer of the node's driver version (roles/container/tasks/
nvidia_installer.yml), run by ansible-playbook on this machine with file:// URLs standing in for NVIDIA's trees:
the Tesla tree first (data-center drivers), then XFree86; one already on the node, or given on the controller,
is used as is; a wrong sha256 is refused; when nothing gives it, the error lists every URL tried."""

from __future__ import annotations

import hashlib

from .conftest import run_role_cases

VERSION = "580.95.05"
NAME = f"NVIDIA-Linux-x86_64-{VERSION}.run"


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
    cases = {
        "fallback": dict(common, _installer=str(node["fallback"] / NAME), dflash_container_nvidia_installer_sha256=xfree_sha),
        "missing": dict(common, _installer=str(node["missing"] / NAME),
                        dflash_container_nvidia_installer_urls=[f"file://{tesla}/{{version}}/a.run", f"file://{tmp_path}/nowhere/{{version}}/b.run"]),
        "badsum": dict(common, _installer=str(node["badsum"] / NAME), dflash_container_nvidia_installer_sha256=xfree_sha),
        "given": dict(common, _installer=str(node["given"] / NAME), dflash_container_nvidia_installer_src=str(given)),
        "kept": dict(common, _installer=str(node["kept"] / NAME), dflash_container_nvidia_installer_urls=[]),
    }  # fmt: skip
    results = run_role_cases(tmp_path, "container", "nvidia_installer.yml", cases)

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
