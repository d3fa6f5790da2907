"""The container role's pct and NVIDIA passthrough logic."""

import pytest

from .conftest import load_plugin

f = load_plugin("container", "dflash_container")

PCT_CONFIG = """\
arch: amd64
cores: 8
features: nesting=1
hostname: dflash-200
memory: 65536
mp0: /opt/wheels,mp=/opt/wheels,ro=1
dev0: /dev/nvidia0,mode=0666
dev7: /dev/nvidia-caps/nvidia-cap2,mode=0666
net0: name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:00:01,ip=dhcp,type=veth
rootfs: local-lvm:vm-200-disk-0,size=64G
unprivileged: 1

[snap1]
cores: 2
"""

PROC_DEVICES = """\
Character devices:
  1 mem
  4 tty
195 nvidia-frontend
195 nvidia
234 nvidia-nvswitch
508 nvidia-uvm
509 nvidia-caps
510 nvidia-nvlink

Block devices:
  7 loop
259 nvidia-fake-block
"""


def test_pct_config_ignores_snapshots():
    config = f.pct_config_to_dict(PCT_CONFIG)
    assert config["cores"] == "8"
    assert config["mp0"] == "/opt/wheels,mp=/opt/wheels,ro=1"
    assert "[snap1]" not in config and config["cores"] != "2"


def test_set_args_empty_when_config_matches():
    config = f.pct_config_to_dict(PCT_CONFIG)
    desired = {
        "cores": 8,
        "memory": 65536,
        "features": "nesting=1",
        "mp0": "/opt/wheels,mp=/opt/wheels,ro=1",
        "dev0": "/dev/nvidia0,mode=0666",
        "dev7": "/dev/nvidia-caps/nvidia-cap2,mode=0666",
    }
    assert f.pct_set_args(desired, config) == []


def test_set_args_changes_and_deletes_stale_entries():
    config = f.pct_config_to_dict(PCT_CONFIG)
    desired = {"cores": 16, "memory": 65536, "features": "nesting=1", "dev0": "/dev/nvidia0,mode=0666"}
    args = f.pct_set_args(desired, config)
    assert args == ["--cores", "16", "--delete", "dev7,mp0"]


def test_dev_entries_cover_every_device_in_natural_order():
    paths = ["/dev/nvidia10", "/dev/nvidiactl", "/dev/nvidia2", "/dev/nvidia-uvm", "/dev/nvidia-caps/nvidia-cap1"]
    entries = f.nvidia_dev_entries(paths)
    assert list(entries.values()) == [
        "/dev/nvidia2,mode=0666",
        "/dev/nvidia10,mode=0666",
        "/dev/nvidia-caps/nvidia-cap1,mode=0400",  # MIG config capability: root only
        "/dev/nvidia-uvm,mode=0666",
        "/dev/nvidiactl,mode=0666",
    ]
    assert list(entries) == [f"dev{i}" for i in range(5)]


def test_mount_entries():
    mounts = [{"src": "/opt/wheels", "dest": "/opt/wheels", "readonly": True}, {"src": "/a", "dest": "/b"}]
    assert f.pct_mount_entries(mounts) == {"mp0": "/opt/wheels,mp=/opt/wheels,ro=1", "mp1": "/a,mp=/b"}


def test_char_majors_only_from_character_section():
    assert f.nvidia_char_majors(PROC_DEVICES) == [195, 234, 508, 509, 510]


def test_legacy_lines():
    devices = f.nvidia_cuda_devices(["/dev/nvidia0 c3 0", "/dev/nvidiactl c3 ff"])
    assert f.nvidia_legacy_lines(devices) == [
        "lxc.cgroup2.devices.allow: c 195:0 rw",
        "lxc.cgroup2.devices.allow: c 195:255 rw",
        "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file",
        "lxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind,optional,create=file",
    ]


@pytest.mark.parametrize(
    ("path", "version"),
    [
        ("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.14\n", "550.54.14"),
        ("/usr/lib64/libnvidia-ml.so.580.65", "580.65"),
        ("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", ""),
        ("", ""),
    ],
)
def test_library_version(path, version):
    assert f.nvidia_library_version(path) == version


# `pveam available --section system` on a PVE 8 node (abridged: each section's lines as pveam prints them).
PVEAM_AVAILABLE = """\
system          almalinux-9-default_20240911_amd64.tar.xz
system          alpine-3.20-default_20240908_amd64.tar.xz
system          debian-11-standard_11.7-1_amd64.tar.zst
system          debian-12-standard_12.2-1_amd64.tar.zst
system          debian-12-standard_12.12-1_amd64.tar.zst
system          debian-12-standard_12.7-1_amd64.tar.zst
system          debian-13-standard_13.1-2_amd64.tar.zst
system          ubuntu-24.04-standard_24.04-2_amd64.tar.zst
""".splitlines()
PVEAM_LIST = """\
NAME                                                         SIZE
local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst         120.29MB
""".splitlines()


def test_the_newest_debian_standard_template_is_chosen_by_version_not_by_text():
    newest = f.newest_debian_template
    assert newest(PVEAM_AVAILABLE, PVEAM_LIST, "local") == "local:vztmpl/debian-13-standard_13.1-2_amd64.tar.zst"
    without_13 = [line for line in PVEAM_AVAILABLE if "debian-13" not in line]
    assert newest(without_13, [], "local") == "local:vztmpl/debian-12-standard_12.12-1_amd64.tar.zst"  # 12.12 > 12.7
    # no index (an offline node): the newest one already on the storage
    assert newest([], PVEAM_LIST, "nfs") == "nfs:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"
    assert newest(["system          ubuntu-24.04-standard_24.04-2_amd64.tar.zst"], [], "local") == ""
