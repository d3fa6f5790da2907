"""The proxmox scenario's `pct` test double: Proxmox-style config in, LXC config out."""

from __future__ import annotations

import pytest

from .conftest import load_pct_double


@pytest.fixture
def pct(tmp_path, monkeypatch):
    module = load_pct_double("pct_double", tmp_path, monkeypatch)
    monkeypatch.setattr(module, "running", lambda vmid: False)  # not the host's container of the same VMID
    template = tmp_path / "template"
    (template / "etc").mkdir(parents=True)
    (template / "etc" / "os-release").write_text("ID=debian\n")
    module.template = str(template)
    return module


def test_create_set_config(pct, tmp_path, capsys):
    pct.cmd_create("9201", pct.template, "--hostname", "ct1", "--cores", "2", "--memory", "4096",
                   "--rootfs", "local-zfs:64", "--features", "nesting=1")  # fmt: skip
    assert (tmp_path / "lxc" / "9201" / "rootfs" / "etc" / "os-release").exists()
    assert (tmp_path / "lxc" / "9201" / "rootfs" / "etc" / "hostname").read_text() == "ct1\n"
    pct.cmd_set("9201", "--mp0", "/opt/wheels,mp=/opt/wheels,ro=1", "--dev0", "/dev/null,mode=0666", "--cores", "4")
    pct.cmd_config("9201")
    out = capsys.readouterr().out.splitlines()
    assert "cores: 4" in out
    assert "mp0: /opt/wheels,mp=/opt/wheels,ro=1" in out
    assert "rootfs: local-zfs:subvol-9201-disk-0,size=64G" in out
    pct.write_lxc_config("9201", pct.read_conf("9201"))  # what `pct start` generates
    lxc_config = (tmp_path / "lxc" / "9201" / "config").read_text()
    assert "lxc.uts.name = ct1" in lxc_config
    assert "lxc.mount.entry = /opt/wheels opt/wheels none bind,create=dir,ro 0 0" in lxc_config
    assert "lxc.cgroup2.devices.allow = c 1:3 rw" in lxc_config  # /dev/null, made by the autodev hook
    assert 'mknod -m 0666 "$LXC_ROOTFS_MOUNT"/dev/null c 1 3' in (tmp_path / "lxc" / "9201" / "autodev-hook").read_text()

    pct.cmd_set("9201", "--delete", "dev0,mp0")
    pct.write_lxc_config("9201", pct.read_conf("9201"))
    lxc_config = (tmp_path / "lxc" / "9201" / "config").read_text()
    assert "1:3" not in lxc_config and "wheels" not in lxc_config


def test_missing_container_and_duplicate_create(pct, capsys):
    with pytest.raises(SystemExit) as missing:
        pct.cmd_config("9999")
    assert missing.value.code == 2
    assert "9999.conf' does not exist" in capsys.readouterr().err
    pct.cmd_create("9202", pct.template)
    with pytest.raises(SystemExit):
        pct.cmd_create("9202", pct.template)
    assert "already exists" in capsys.readouterr().err


def test_unknown_command_lists_the_supported_ones(pct, capsys):
    with pytest.raises(SystemExit):
        pct.main(["migrate", "9201"])
    err = capsys.readouterr().err
    assert "unknown command 'migrate'" in err and "exec" in err and "push" in err
