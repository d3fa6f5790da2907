"""Proxmox containers are unprivileged by default, GPUs included: the role's own `pct create` command line
(rendered by Ansible from its defaults), the devN passthrough that works without privileges, and the bind
mounts owned by the mapped root; the proxmox scenario's `pct` double maps an unprivileged container's ids as
PVE does (molecule proxmox boots one and runs the roles against it)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import load_pct_double

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "container"


def _render(expression: str, tmp_path: Path, **extra) -> object:
    play = [{"hosts": "localhost", "gather_facts": False,
             "vars_files": [str(ROLE / "defaults" / "main.yml")],
             "tasks": [{"ansible.builtin.copy": {"content": "{{ (" + expression + ") | to_json }}",
                                                 "dest": str(tmp_path / "out.json"), "mode": "0644"}}]}]  # fmt: skip
    (tmp_path / "play.yml").write_text(json.dumps(play))
    env = {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": f"{sys.prefix}/bin:/usr/bin:/bin", "HOME": str(tmp_path),
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / ".ansible-tmp")}  # fmt: skip
    extra = {"dflash_container_id": 200, "dflash_container_pct_template": "local:vztmpl/debian-12.tar.zst",
             "_dflash_container_template": "local:vztmpl/debian-12.tar.zst", **extra}
    proc = subprocess.run([f"{sys.prefix}/bin/ansible-playbook", "-i", "localhost,", "-c", "local", "-e", json.dumps(extra),
                           "-e", f"ansible_python_interpreter={sys.executable}", str(tmp_path / "play.yml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((tmp_path / "out.json").read_text())


def test_pct_create_makes_an_unprivileged_container_by_default(tmp_path):
    task = yaml.safe_load((ROLE / "tasks" / "proxmox" / "create.yml").read_text())[0]
    expression = task["ansible.builtin.command"]["argv"].strip()
    assert expression.startswith("{{") and expression.endswith("}}")
    argv = _render(expression[2:-2], tmp_path)
    assert argv[argv.index("--unprivileged") + 1] == "1"
    assert argv[argv.index("--features") + 1] == "nesting=1"  # systemd inside an unprivileged container
    privileged = _render(expression[2:-2], tmp_path, dflash_container_pct_unprivileged=False)
    assert privileged[privileged.index("--unprivileged") + 1] == "0"  # offered, not forced


def test_gpu_passthrough_and_mounts_work_for_the_unprivileged_container():
    sys.path.insert(0, str(ROLE / "filter_plugins"))
    try:
        from dflash_container import nvidia_dev_entries, pct_idmap_root
    finally:
        sys.path.pop(0)
    entries = nvidia_dev_entries(["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"])
    assert all(v.endswith(",mode=0666") for v in entries.values())  # openable by the container's mapped root
    assert (ROLE / "defaults" / "main.yml").read_text().count("dflash_container_gpu_passthrough: devN") == 1
    # bind mounts (the role's own and the inventory's) owned by the mapped root
    # 100000 unless the container's own config maps its root elsewhere (an `lxc.idmap` line, read by the preflight)
    assert "{{ (_dflash_container_idmap_root | default(none) or 100000) if dflash_container_pct_unprivileged else 0 }}" in \
        (ROLE / "vars" / "main.yml").read_text()
    assert pct_idmap_root(["arch: amd64", "lxc.idmap: u 0 200000 65536", "lxc.idmap: g 0 200000 65536"]) == 200000
    assert pct_idmap_root(["arch: amd64", "unprivileged: 1"]) is None
    for tasks in ("configure.yml", "bind_sources.yml"):
        assert 'owner: "{{ _dflash_container_mapped_root }}"' in (ROLE / "tasks" / "proxmox" / tasks).read_text()


# --- the proxmox scenario's `pct` double makes unprivileged containers as PVE does ------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="chown, mknod and a private mount namespace need root")  # fmt: skip


@pytest.fixture
def pct(tmp_path, monkeypatch):
    module = load_pct_double("pct_double_unprivileged", tmp_path, monkeypatch)
    monkeypatch.setattr(module, "running", lambda vmid: False)
    template = tmp_path / "template"
    (template / "etc").mkdir(parents=True)
    (template / "usr" / "bin").mkdir(parents=True)
    (template / "etc" / "shadow").write_text("root:*:20000:0:99999:7:::\n")
    os.chown(template / "etc" / "shadow", 0, 42)  # group shadow
    (template / "usr" / "bin" / "passwd").write_text("#!/bin/sh\n")
    os.chmod(template / "usr" / "bin" / "passwd", 0o4755)
    (template / "bin").symlink_to("usr/bin")
    module.template = str(template)
    return module


@needs_root
def test_the_double_shifts_the_rootfs_and_maps_ids_as_pve(pct, tmp_path):
    pct.cmd_create("9201", pct.template, "--hostname", "ct", "--unprivileged", "1", "--rootfs", "local-zfs:8")
    rootfs = tmp_path / "lxc" / "9201" / "rootfs"
    owners = {p: (os.lstat(rootfs / p).st_uid, os.lstat(rootfs / p).st_gid)
              for p in (".", "etc/shadow", "etc/hostname", "usr/bin/passwd", "bin")}  # fmt: skip
    assert owners == {".": (100000, 100000), "etc/shadow": (100000, 100042), "etc/hostname": (100000, 100000),
                      "usr/bin/passwd": (100000, 100000), "bin": (100000, 100000)}  # fmt: skip
    assert stat.S_IMODE(os.stat(rootfs / "usr" / "bin" / "passwd").st_mode) == 0o4755  # chown clears set-id bits
    assert "unprivileged: 1" in (tmp_path / "state" / "9201.conf").read_text()

    pct.cmd_set("9201", "--dev0", "/dev/null,mode=0666", "--dev1", "/dev/zero,uid=5,gid=6")
    conf = pct.read_conf("9201")
    assert pct.make_passthrough_nodes("9201", conf) == ["/dev/null", "/dev/zero"]
    pct.write_lxc_config("9201", conf)
    lxc_config = (tmp_path / "lxc" / "9201" / "config").read_text().splitlines()
    # what PVE::LXC::update_lxc_config writes for `unprivileged: 1` without an lxc.idmap of its own
    for line in ("lxc.include = /usr/share/lxc/config/userns.conf",
                 "lxc.idmap = u 0 100000 65536", "lxc.idmap = g 0 100000 65536",
                 "lxc.cgroup2.devices.allow = c 1:3 rw", "lxc.cgroup2.devices.allow = c 1:5 rw"):  # fmt: skip
        assert line in lxc_config
    passthrough = tmp_path / "lxc" / "9201" / "passthrough" / "dev"
    null, zero = os.stat(passthrough / "null"), os.stat(passthrough / "zero")
    assert stat.S_ISCHR(null.st_mode) and (os.major(null.st_rdev), os.minor(null.st_rdev)) == (1, 3)
    assert (stat.S_IMODE(null.st_mode), null.st_uid, null.st_gid) == (0o666, 100000, 100000)
    assert (stat.S_IMODE(zero.st_mode), zero.st_uid, zero.st_gid) == (0o660, 100005, 100006)  # PVE's default mode

    # The autodev hook, run as LXC runs it (in the container's mount namespace, before pivot_root): the node
    # made on the node is bound over a placeholder; a node already there fails the start, as with PVE's mknod.
    hook = tmp_path / "lxc" / "9201" / "autodev-hook"
    target = tmp_path / "mnt"
    (target / "dev").mkdir(parents=True)
    probe = f'"{hook}" && stat -c "%F %t:%T %a %u:%g" "{target}/dev/null" "{target}/dev/zero"'
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LXC_ROOTFS_MOUNT": str(target)}
    first = subprocess.run(["unshare", "--mount", "sh", "-c", probe], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == ["character special file 1:3 666 100000:100000",
                                         "character special file 1:5 660 100005:100006"]  # fmt: skip
    again = subprocess.run(["unshare", "--mount", str(hook)], env=env, capture_output=True, text=True)
    assert again.returncode != 0 and "exist" in again.stderr


@needs_root
def test_the_double_mounts_mp_entries_as_pves_prestart_hook(pct, tmp_path):
    """mpN are mounted by the node's root before the container's user namespace exists: a source under a
    directory the mapped root cannot enter is mounted all the same (LXC's own mount entries would fail there),
    onto mount points made owned by the mapped root; `ro=1` mounts read-only."""
    pct.cmd_create("9201", pct.template, "--unprivileged", "1")
    locked = tmp_path / "locked"
    (locked / "data").mkdir(parents=True)
    locked.chmod(0o700)
    (locked / "data" / "file").write_text("node\n")
    (tmp_path / "wheels").mkdir()
    pct.cmd_set("9201", "--mp0", f"{locked}/data,mp=/srv/data", "--mp1", f"{tmp_path}/wheels,mp=/opt/w/heels,ro=1")
    conf = pct.read_conf("9201")
    pct.make_mount_targets("9201", conf)
    rootfs = tmp_path / "lxc" / "9201" / "rootfs"
    for made in ("srv", "srv/data", "opt", "opt/w", "opt/w/heels"):
        assert (os.stat(rootfs / made).st_uid, os.stat(rootfs / made).st_gid) == (100000, 100000), made
    pct.write_lxc_config("9201", conf)
    lxc_config = (tmp_path / "lxc" / "9201" / "config").read_text()
    hook = tmp_path / "lxc" / "9201" / "prestart-hook"
    assert f"lxc.hook.pre-start = {hook}" in lxc_config and "lxc.monitor.unshare = 1" in lxc_config
    assert "srv/data none bind" not in lxc_config  # not an LXC mount entry: those run in the user namespace

    probe = (f'"{hook}" && cat "{rootfs}/srv/data/file" && ! touch "{rootfs}/opt/w/heels/x" 2>/dev/null'
             f' && echo read-only')  # fmt: skip
    run = subprocess.run(["unshare", "--mount", "sh", "-c", probe], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["node", "read-only"]
    assert not (rootfs / "srv" / "data" / "file").exists()  # mounted in that namespace only


@needs_root
def test_the_double_keeps_privileged_containers_unmapped_and_refuses_unmappable_ids(pct, tmp_path, capsys):
    pct.cmd_create("9202", pct.template, "--unprivileged", "0")
    assert os.lstat(tmp_path / "lxc" / "9202" / "rootfs" / "etc" / "shadow").st_gid == 42
    pct.write_lxc_config("9202", pct.read_conf("9202"))
    assert "lxc.idmap" not in (tmp_path / "lxc" / "9202" / "config").read_text()

    pct.cmd_create("9203", pct.template, "--unprivileged", "1")
    pct.cmd_set("9203", "--dev0", "/dev/null,uid=70000")
    with pytest.raises(SystemExit):
        pct.make_passthrough_nodes("9203", pct.read_conf("9203"))
    assert "unable to map container id 70000" in capsys.readouterr().err
