"""A node's boot (roles/node): the unit waits, bounded, for the GPU fabric on NVSwitch machines and tolerates a
failing `nvidia-smi -pm 1`; pve-guests waits, bounded, for the job's storages (a drop-in). The helper
files/dflash-node-wait runs here with stand-ins for nvidia-smi and systemctl on PATH."""

from __future__ import annotations

import os
import subprocess
import time

from .conftest import ROOT, run_role_cases

WAIT = ROOT / "roles" / "node" / "files" / "dflash-node-wait"


def fake_bin(tmp_path, state_file):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # The fabric is "In Progress" until the state file says Completed (the fabric manager finishing its training).
    (bin_dir / "nvidia-smi").write_text(
        f"#!/bin/sh\nfor g in 0 1; do printf 'GPU 0000:0%s:00.0\\n    Fabric\\n        State : %s\\n' $g "
        f"\"$(cat {state_file})\"; done\n")
    (bin_dir / "systemctl").write_text("#!/bin/sh\nexit 0\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_the_fabric_wait_ends_when_the_fabric_is_ready_or_warns_after_its_timeout(tmp_path):
    switches = tmp_path / "nvswitch"
    switches.mkdir()
    (switches / "0").write_text("")
    state = tmp_path / "state"
    state.write_text("In Progress")
    env = fake_bin(tmp_path, state)
    late = subprocess.run([str(WAIT), "fabric", "1", str(switches)], env=env, capture_output=True, text=True, timeout=30)
    assert late.returncode == 0 and "the GPU fabric is not ready after 1 s" in late.stderr
    assert "fabric state: In Progress In Progress" in late.stderr
    proc = subprocess.Popen([str(WAIT), "fabric", "30", str(switches)], env=env, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    assert proc.poll() is None  # still waiting
    state.write_text("Completed")
    assert proc.wait(timeout=10) == 0 and proc.stderr.read() == ""
    no_switch = subprocess.run([str(WAIT), "fabric", "30", str(tmp_path / "none")], env=env, timeout=5)
    assert no_switch.returncode == 0


def test_the_mounts_wait_warns_and_lets_the_guests_start(tmp_path):
    out = subprocess.run([str(WAIT), "mounts", "1", str(tmp_path), "/"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and f"WARNING: {tmp_path} not mounted after 1 s" in out.stderr
    assert subprocess.run([str(WAIT), "mounts", "1", "/"], capture_output=True, timeout=30).stderr == b""


def test_the_unit_tolerates_persistence_mode_and_pve_guests_waits_for_the_storages(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    (tmp_path / "version").write_text("550.54.15\n")
    common = {"dflash_node_nvidia_driver_version_file": str(tmp_path / "version"), "dflash_node_nvidia_dev_dir": str(dev),
              "dflash_node_systemd": False, "dflash_node_nvidia_unit_dir": str(tmp_path), "dflash_node_bin_dir": str(tmp_path),
              "dflash_node_nvidia_commands": [["touch", str(dev / "nvidia-uvm")]],
              "dflash_node_nvidia_optional_commands": [["false"]],
              "dflash_node_nvswitch_dir": str(tmp_path / "no-nvswitch"),
              "dflash_node_pve_guests_dropin_dir": str(tmp_path / "pve-guests.service.d"),
              "dflash_node_pve_guests_wait_mounts": ["/mnt/pve/cephfs"]}  # fmt: skip
    results = run_role_cases(tmp_path, "node", "main.yml", {"boot": common})
    assert results["boot"] == {"ok": True}, results
    unit = (tmp_path / "dflash-nvidia-node.service").read_text()
    assert "ExecStart=-false" in unit and f"ExecStart={tmp_path}/dflash-node-wait fabric 300 " in unit
    assert "After=systemd-modules-load.service nvidia-fabricmanager.service" in unit
    dropin = (tmp_path / "pve-guests.service.d" / "dflash-wait-mounts.conf").read_text()
    assert f"ExecStartPre={tmp_path}/dflash-node-wait mounts 300 /mnt/pve/cephfs" in dropin
    assert (dev / "nvidia-uvm").exists() and os.access(tmp_path / "dflash-node-wait", os.X_OK)
