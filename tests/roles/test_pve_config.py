"""Proxmox config handling of the container role, against pve-container's config format.

The raw-line module (module_utils/dflash_pve.py) keeps /etc/pve/lxc/VMID.conf the way
pve-container's parse_pct_config/write_pct_config read and write it (main section, raw
`lxc.*` lines after the keys, `[pve:pending]`, snapshots, `#` description) and writes it
without chmod/chown, which pmxcfs refuses. The filters produce devN values that pass
pve-container's dev schema (mode `0[0-7]{3}`, a /dev/ path) and only the nodes CUDA needs.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import ansible.module_utils
import pytest

from .conftest import ROOT, load_plugin

# the module_utils import each other as ansible.module_utils.dflash_* (as Ansible ships them)
if str(ROOT / "module_utils") not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(str(ROOT / "module_utils"))
from ansible.module_utils import dflash_pve  # noqa: E402

f = load_plugin("container", "dflash_container")

# A container config as PVE 8 writes it: description, keys sorted, raw lines last,
# a change pending on the running container, a snapshot.
PVE_CONF = """\
#GPU training container
arch: amd64
cores: 8
dev0: /dev/nvidia0,mode=0666
features: nesting=1,keyctl=1
hostname: dflash-200
memory: 65536
mp0: /var/cache/dflash/pip,mp=/var/cache/dflash/pip
net0: name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:00:01,ip=192.0.2.50/24,gw=192.0.2.1,type=veth
ostype: debian
rootfs: local-zfs:subvol-200-disk-0,size=64G
unprivileged: 1
lxc.cgroup2.devices.allow: c 10:200 rwm
lxc.mount.entry: /dev/net/tun dev/net/tun none bind,create=file
lxc.cgroup2.devices.allow: c 195:* rwm
lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file

[pve:pending]
cores: 16

[before-upgrade]
arch: amd64
cores: 8
lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file
snaptime: 1733000000
"""

# `find /dev -maxdepth 2 -type c -path '*/nvidia*' -exec stat -c '%n %t %T' {} +` on an HGX node (hex majors:minors).
FIND = """\
/dev/nvidia0 c3 0
/dev/nvidia1 c3 1
/dev/nvidia7 c3 7
/dev/nvidiactl c3 ff
/dev/nvidia-modeset c3 fe
/dev/nvidia-nvswitchctl ea ff
/dev/nvidia-nvswitch0 ea 0
/dev/nvidia-uvm 1fc 0
/dev/nvidia-uvm-tools 1fc 1
/dev/nvidia-caps/nvidia-cap1 1fd 1
/dev/nvidia-caps/nvidia-cap2 1fd 2
""".splitlines()

OWNED = [r"^lxc\.cgroup2?\.devices\.allow: c (195|508|509):", r"^lxc\.mount\.entry: /dev/nvidia"]


def test_merge_replaces_only_owned_raw_lines_and_keeps_sections():
    lines = ["lxc.cgroup2.devices.allow: c 195:0 rw",
             "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file"]  # fmt: skip
    out = dflash_pve.merge_raw_lines(PVE_CONF, lines, OWNED)
    main, rest = dflash_pve.split_sections(out)
    assert "lxc.cgroup2.devices.allow: c 195:* rwm" not in main  # an owned line not wanted
    assert "lxc.cgroup2.devices.allow: c 10:200 rwm" in main  # the operator's own lines stay
    assert "lxc.mount.entry: /dev/net/tun dev/net/tun none bind,create=file" in main
    assert main.count("lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file") == 1
    assert [line for line in main if line][-1] == "lxc.cgroup2.devices.allow: c 195:0 rw"  # raw lines last, as PVE writes
    assert main[0] == "#GPU training container" and "dev0: /dev/nvidia0,mode=0666" in main
    assert rest == dflash_pve.split_sections(PVE_CONF)[1]  # pending and snapshot untouched
    assert out.endswith("snaptime: 1733000000\n") and "\n\n[pve:pending]\n" in out
    assert dflash_pve.merge_raw_lines(out, lines, OWNED) == out  # idempotent


def test_merge_removes_every_owned_line_and_accepts_equals_form():
    text = "arch: amd64\nlxc.prlimit.memlock = 1024\nlxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind\n"
    out = dflash_pve.merge_raw_lines(text, ["lxc.prlimit.memlock = unlimited"], OWNED + [r"^lxc\.prlimit\.memlock:"])
    assert out == "arch: amd64\nlxc.prlimit.memlock: unlimited\n"
    with pytest.raises(ValueError, match="not a raw lxc line"):
        dflash_pve.merge_raw_lines(text, ["dev0: /dev/nvidia0"], OWNED)


def test_lock_of_reads_the_main_section_only():
    assert dflash_pve.lock_of(PVE_CONF) == ""
    assert dflash_pve.lock_of("arch: amd64\nlock: backup\n") == "backup"
    assert dflash_pve.lock_of("arch: amd64\n\n[snap]\nlock: snapshot\n") == ""


def test_write_content_never_changes_mode_or_owner(tmp_path, monkeypatch):
    path = tmp_path / "200.conf"
    path.write_text(PVE_CONF)

    def eperm(*_args, **_kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted (pmxcfs)")

    for name in ("chmod", "fchmod", "chown", "fchown", "lchown"):
        monkeypatch.setattr(os, name, eperm)
    dflash_pve.write_content(str(path), "arch: amd64\n")
    assert path.read_text() == "arch: amd64\n"
    assert [p.name for p in tmp_path.iterdir()] == ["200.conf"]  # no temp file left


def test_module_writes_through_ansible_with_check_and_diff(tmp_path):
    conf = tmp_path / "200.conf"
    conf.write_text(PVE_CONF)
    args = {"path": str(conf), "lines": ["lxc.prlimit.memlock: unlimited"], "owned": [r"^lxc\.prlimit\.memlock:"]}
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp")}  # fmt: skip
    base = [str(Path(sys.executable).parent / "ansible"), "localhost", "-c", "local", "-m", "dflash_pct_conf",
            "-a", json.dumps(args), "-e", f"ansible_python_interpreter={sys.executable}"]  # fmt: skip
    check = subprocess.run(base + ["--check", "--diff"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "+lxc.prlimit.memlock: unlimited" in check.stdout and conf.read_text() == PVE_CONF
    real = subprocess.run(base, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert real.returncode == 0 and "CHANGED" in real.stdout, real.stdout + real.stderr
    assert "lxc.prlimit.memlock: unlimited\n\n[pve:pending]" in conf.read_text()


def test_only_the_nodes_cuda_needs_are_passed():
    devices = f.nvidia_cuda_devices(FIND)
    assert [d["name"] for d in devices] == ["nvidia0", "nvidia1", "nvidia7", "nvidia-uvm", "nvidia-uvm-tools", "nvidiactl"]
    mig = [d["name"] for d in f.nvidia_cuda_devices(FIND, mig=True)]
    assert "nvidia-caps/nvidia-cap1" in mig and "nvidia-modeset" not in mig and "nvidia-nvswitch0" not in mig
    assert f.nvidia_missing_nodes(devices, [0, 1, 7]) == []
    without_uvm = [d for d in devices if not d["name"].startswith("nvidia-uvm")]
    assert f.nvidia_missing_nodes(without_uvm, [0, 2]) == ["nvidia-uvm", "nvidia2"]


def test_dev_entries_pass_pve_container_dev_schema():
    entries = f.nvidia_dev_entries(f.nvidia_cuda_devices(FIND, mig=True))
    for key, value in entries.items():
        assert re.fullmatch(r"dev\d+", key)
        props = dict(part.split("=", 1) if "=" in part else ("path", part) for part in value.split(","))
        assert set(props) == {"path", "mode"}
        assert props["path"].startswith("/dev/") and not re.search(r"/\.\.?(?:/|$)", props["path"])
        assert re.fullmatch(r"0[0-7]{3}", props["mode"])  # pve-container: pattern => '0[0-7]{3}'
    assert "/dev/nvidia-caps/nvidia-cap1,mode=0400" in entries.values()  # MIG config: root only, as on the host
    assert entries["dev0"] == "/dev/nvidia0,mode=0666"
    config = f.pct_config_to_dict(PVE_CONF)
    assert f.pct_dev_paths(config) == {"dev0": "/dev/nvidia0"}
    assert f.pct_dev_paths({"dev3": "path=/dev/nvidia-uvm,mode=0666"}) == {"dev3": "/dev/nvidia-uvm"}


def test_legacy_lines_allow_exact_nodes_and_own_old_majors():
    devices = f.nvidia_cuda_devices(FIND)
    lines = f.nvidia_legacy_lines(devices)
    assert "lxc.cgroup2.devices.allow: c 508:0 rw" in lines and "lxc.cgroup2.devices.allow: c 195:255 rw" in lines
    assert "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file" in lines
    assert not any("234:" in line or "nvswitch" in line for line in lines)
    # A fake-node directory mounts onto the container's /dev/NAME.
    fake = f.nvidia_cuda_devices(["/dev/test-gpu/nvidia0 c3 0"], "/dev/test-gpu")
    assert f.nvidia_legacy_lines(fake)[1] == "lxc.mount.entry: /dev/test-gpu/nvidia0 dev/nvidia0 none bind,optional,create=file"
    # After a driver upgrade moved nvidia-uvm from major 507, its old allow line is still owned.
    owned = f.nvidia_legacy_owned(devices, [195, 507])
    merged = dflash_pve.merge_raw_lines("arch: amd64\nlxc.cgroup2.devices.allow: c 507:0 rw\n", lines, owned)
    assert "507:" not in merged and "c 508:0 rw" in merged
    # Legacy lines parse as raw keys pve-container accepts (lxc.cgroup2.*, lxc.mount.entry).
    assert all(re.match(r"^(lxc\.[a-z0-9_\-.]+)(:|\s*=)\s*(.*?)\s*$", line) for line in lines)


def test_running_container_changes_that_need_a_restart():
    config = f.pct_config_to_dict(PVE_CONF)
    desired = {"cores": 8, "memory": 131072, "features": f.pct_features(config["features"], {"nesting": 1}),
               "dev0": "/dev/nvidia0,mode=0666", "dev1": "/dev/nvidia1,mode=0666"}  # fmt: skip
    args = f.pct_set_args(desired, config)
    assert args == ["--dev1", "/dev/nvidia1,mode=0666", "--memory", "131072", "--delete", "mp0"]
    assert f.pct_restart_keys(args) == ["dev1", "mp0"]  # memory hotplugs; devN/mpN stay pending
    assert f.pct_restart_keys(["--cores", "4", "--memory", "1024"]) == []
    assert f.pct_restart_keys(["--features", "nesting=1"]) == ["features"]


def test_features_are_merged_not_overwritten():
    assert f.pct_features("nesting=1,keyctl=1", {"nesting": 1}) == "nesting=1,keyctl=1"
    assert f.pct_features("keyctl=1,fuse=1", {"nesting": True}) == "keyctl=1,fuse=1,nesting=1"
    assert f.pct_features("", {"nesting": 1}) == "nesting=1"


def test_numa_cpuset_from_the_gpus_nodes():
    gpu_numa = {"0": 0, "1": 0, "4": 1, "5": 1}
    node_cpus = {"0": "0-47,96-143", "1": "48-95,144-191"}
    assert f.numa_cpuset([0, 1], gpu_numa, node_cpus) == "0-47,96-143"
    assert f.numa_cpuset([0, 5], gpu_numa, node_cpus) == "0-191"
    assert f.cpulist_count("0-47,96-143") == 96
    with pytest.raises(ValueError, match="has no NUMA node"):
        f.numa_cpuset([0], {"0": -1}, node_cpus)
    with pytest.raises(ValueError, match="GPU 3 is not on the node"):
        f.numa_cpuset([3], gpu_numa, node_cpus)


def test_config_parse_skips_raw_lines_and_pending():
    config = f.pct_config_to_dict(PVE_CONF)
    assert config["cores"] == "8"  # the current value, not the pending 16
    assert not any(key.startswith("lxc.") for key in config)


def _run_module(tmp_path, args):
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp")}  # fmt: skip
    argv = [str(Path(sys.executable).parent / "ansible"), "localhost", "-c", "local", "-m", "dflash_pct_conf",
            "-a", json.dumps(args), "-e", f"ansible_python_interpreter={sys.executable}"]  # fmt: skip
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_module_waits_for_pves_config_lock_and_never_writes_without_it(tmp_path):
    """Another Proxmox task holds the container's config lock (PVE::LXC::Config->lock_config's flock): the
    module fails naming it after its timeout and leaves the config as it was; once the lock is free, it writes."""
    conf, locks = tmp_path / "200.conf", tmp_path / "locks"
    conf.write_text(PVE_CONF)
    locks.mkdir()
    args = {"path": str(conf), "lines": ["lxc.prlimit.memlock: unlimited"], "owned": [r"^lxc\.prlimit\.memlock:"],
            "lock_dir": str(locks), "lock_timeout": 1}  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(locks / "pve-config-200.lock")],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = _run_module(tmp_path, args)
    finally:
        holder.kill()
        holder.wait()
    assert refused.returncode != 0, refused.stdout
    assert "container 200's config is in use by another Proxmox task" in refused.stdout
    assert str(locks / "pve-config-200.lock") in refused.stdout and conf.read_text() == PVE_CONF
    done = _run_module(tmp_path, args)
    assert done.returncode == 0 and "CHANGED" in done.stdout, done.stdout + done.stderr
    assert "lxc.prlimit.memlock: unlimited\n\n[pve:pending]" in conf.read_text()


def test_module_refuses_a_locked_container_and_names_the_lock_and_the_fix(tmp_path):
    """`lock: backup` in the main section (vzdump is running): nothing written, the lock and `pct unlock` named."""
    conf = tmp_path / "200.conf"
    locked = PVE_CONF.replace("hostname: dflash-200\n", "hostname: dflash-200\nlock: backup\n")
    conf.write_text(locked)
    args = {"path": str(conf), "lines": ["lxc.prlimit.memlock: unlimited"], "owned": [r"^lxc\.prlimit\.memlock:"],
            "lock_dir": str(tmp_path / "locks"), "locked_wait": 0}  # fmt: skip
    refused = _run_module(tmp_path, args)
    assert refused.returncode != 0, refused.stdout
    assert "container 200 is locked (backup)" in refused.stdout and "pct unlock 200" in refused.stdout
    assert conf.read_text() == locked


@pytest.mark.parametrize("planted", ["link", "fifo", "others' file", "others' directory", "world-writable directory"])
def test_the_config_lock_is_root_s_own_or_refused(tmp_path, planted):
    """/run/lock is world-writable: another account may have made the lock directory, or put a link, a FIFO or a
    file of its own at the lock's name. Refused at once naming it (never followed, never waited on, never locked)."""
    locks, target = tmp_path / "locks", tmp_path / "root-file"
    target.write_text("root's\n")
    locks.mkdir()
    lock = locks / "pve-config-200.lock"
    if planted == "link":
        os.symlink(target, lock)
    elif planted == "fifo":
        os.mkfifo(lock)
    elif planted == "others' file":
        lock.write_text("")
        os.chown(lock, 4242, 4242)
    elif planted == "others' directory":
        os.chown(locks, 4242, 4242)
    else:
        locks.chmod(0o777)
    with pytest.raises(dflash_pve.UnsafeLock, match="nothing was changed"):
        with dflash_pve.config_lock("200", 1, str(locks)):
            pass
    assert target.read_text() == "root's\n"
