"""The strict `pct` double refuses what a Proxmox node refuses (pve-container's schema and behaviour)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .conftest import load_pct_double


@pytest.fixture
def pct(tmp_path, monkeypatch):
    module = load_pct_double("pct_double_strict", tmp_path, monkeypatch)
    template = tmp_path / "rootfs"
    (template / "etc").mkdir(parents=True)
    monkeypatch.setattr(module, "AVAILABLE", {"debian-12-standard_12.7-1_amd64.tar.zst": ("system", str(template)),
                                             "debian-12-turnkey-core_18.1-1_amd64.tar.gz": ("turnkeylinux", str(template))})
    module.live = False
    monkeypatch.setattr(module, "running", lambda vmid: module.live)
    module.cmd_create("9201", str(template), "--hostname", "ct", "--rootfs", "local-zfs:8", "--cores", "2")
    return module


def refused(capsys, call, *args) -> str:
    with pytest.raises(SystemExit) as exc:
        call(*args)
    assert exc.value.code != 0
    return capsys.readouterr().err


def config(pct, capsys, *args) -> list[str]:
    capsys.readouterr()
    pct.cmd_config("9201", *args)
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("/dev/null,mode=666", "dev0.mode: value does not match the regex pattern"),
        ("/dev/null,mode=0999", "dev0.mode: value does not match the regex pattern"),
        ("/tmp/null,mode=0666", "/tmp/null is not a valid device path"),
        ("/dev/../dev/null", "is not a valid device path"),
        ("/dev/null,perms=0666", "dev0.perms: property is not defined in schema"),
        ("/dev/null,uid=root", "type check ('integer') failed"),
        ("/dev/nvidia-uvm-not-here,mode=0666", "Device /dev/nvidia-uvm-not-here does not exist"),
    ],
)
def test_devn_is_validated_like_pve(pct, capsys, value, message):
    assert message in refused(capsys, pct.cmd_set, "9201", "--dev0", value)


def test_unknown_options_features_and_read_only_keys_are_refused(pct, capsys):
    assert "property is not defined in schema" in refused(capsys, pct.cmd_set, "9201", "--gpus", "all")
    assert "features.nvidia: property is not defined" in refused(capsys, pct.cmd_set, "9201", "--features", "nvidia=1")
    assert "unable to modify read-only option: 'unprivileged'" in refused(capsys, pct.cmd_set, "9201", "--unprivileged", "0")


def test_running_container_keeps_non_hotplug_changes_pending(pct, capsys):
    pct.live = True
    pct.cmd_set("9201", "--cores", "4", "--dev0", "/dev/null,mode=0666", "--features", "nesting=1")
    current = config(pct, capsys, "--current", "1")
    assert "cores: 4" in current  # hot-pluggable: applied at once
    assert not any(line.startswith(("dev0", "features")) for line in current)
    pending = config(pct, capsys)
    assert "dev0: /dev/null,mode=0666" in pending and "features: nesting=1" in pending
    assert "\n[pve:pending]\n" in open(pct.conf_path("9201")).read()
    conf = pct.read_conf("9201")
    pct.apply_pending(conf)  # what `pct start` does first
    assert conf["main"]["dev0"] == "/dev/null,mode=0666" and not conf["pending"]


def test_start_refuses_a_devn_path_that_disappeared(pct, capsys):
    pct.cmd_set("9201", "--dev0", "/dev/null,mode=0666")
    path = pct.conf_path("9201")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace("/dev/null", "/dev/nvidia-uvm-gone"))  # the node rebooted: no uvm node yet
    assert "Device /dev/nvidia-uvm-gone does not exist" in refused(capsys, pct.cmd_start, "9201")


def test_lock_refuses_set_start_and_destroy_until_unlocked(pct, capsys):
    pct.cmd_set("9201", "--lock", "backup")
    for call, args in [(pct.cmd_set, ("9201", "--cores", "3")), (pct.cmd_start, ("9201",)), (pct.cmd_destroy, ("9201",))]:
        assert "CT is locked (backup)" in refused(capsys, call, *args)
    pct.cmd_unlock("9201")
    pct.cmd_set("9201", "--cores", "3")
    assert "cores: 3" in config(pct, capsys)


def test_exec_keeps_the_callers_environment(pct, capsys, monkeypatch):
    """Real pct keeps the caller's environment in `pct exec` (keep-env): a proxy the caller sets reaches apt."""
    calls = []
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: calls.append((argv, env)))
    monkeypatch.setenv("https_proxy", "http://proxy.example:3128/")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    assert "container '9201' not running!" in refused(capsys, pct.cmd_exec, "9201", "--", "true")
    pct.live = True
    pct.cmd_exec("9201", "--", "sh", "-c", "echo $PATH")
    argv, env = calls[0]
    assert argv == ["lxc-attach", "-n", "9201", "--keep-env", "--", "sh", "-c", "echo $PATH"]
    assert env["https_proxy"] == "http://proxy.example:3128/" and env["LC_ALL"] == "C.UTF-8" and "PATH" in env


def test_what_an_older_or_different_node_refuses(pct, capsys, tmp_path):
    """devN before PVE 8.1, Debian 13 before pve-container 5.3.1, a missing bridge, a symlinked mount source."""
    (Path(pct.STATE) / "pveversion").write_text("pve-manager: 8.0.4\npve-container: 5.0.8\n")
    assert "dev0: property is not defined in schema" in refused(capsys, pct.cmd_set, "9201", "--dev0", "/dev/null")
    capsys.readouterr()
    pct.main(["-v"], "pveversion")
    assert "pve-manager: 8.0.4" in capsys.readouterr().out
    trixie = tmp_path / "debian-13-standard_13.1-2_amd64"
    (trixie / "etc").mkdir(parents=True)
    assert "unsupported debian version '13.1'" in refused(capsys, pct.cmd_create, "9202", str(trixie))
    pct.cmd_set("9201", "--net0", "name=eth0,bridge=vmbr1,ip=dhcp")
    assert "bridge 'vmbr1' does not exist" in refused(capsys, pct.cmd_start, "9201")
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    pct.cmd_set("9201", "--net0", "name=eth0,bridge=vmbr0,ip=dhcp", "--mp0", f"{tmp_path}/link/models,mp=/models,ro=1")
    assert f"symlink encountered at: {tmp_path}/link" in refused(capsys, pct.cmd_start, "9201")


def test_templates_and_storages(pct, capsys):
    capsys.readouterr()
    pct.main(["status", "--content", "rootdir"], "pvesm")
    storages = capsys.readouterr().out
    assert "local-zfs" in storages and "local-lvm" not in storages
    volid = "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"
    assert f"volume '{volid}' does not exist" in refused(capsys, pct.cmd_create, "9300", volid)
    assert "no such template" in refused(capsys, pct.main, ["download", "local", "debian-99.tar.zst"], "pveam")
    capsys.readouterr()
    pct.main(["available", "--section", "system"], "pveam")
    assert capsys.readouterr().out == "system          debian-12-standard_12.7-1_amd64.tar.zst\n"
    pct.main(["download", "local", "debian-12-standard_12.7-1_amd64.tar.zst"], "pveam")
    assert "storage 'local-lvm' does not exist" in refused(capsys, pct.cmd_create, "9300", volid, "--rootfs", "local-lvm:8")
    capsys.readouterr()
    pct.main(["list", "local"], "pveam")
    assert volid in capsys.readouterr().out
    pct.cmd_create("9300", volid, "--rootfs", "local-zfs:8")
    assert "rootfs: local-zfs:subvol-9300-disk-0,size=8G" in open(pct.conf_path("9300")).read()
    assert open(os.path.join(pct.STATE, "tasks.log")).read().splitlines()[-1] == f"pct create 9300 {volid}"
