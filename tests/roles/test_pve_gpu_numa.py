"""The node script behind NUMA pinning (roles/container/files/dflash-gpu-numa) on a fake 2-socket node:
nvidia-smi's 8-digit PCI domains map to sysfs devices, and its JSON feeds the cpuset filter."""

from __future__ import annotations

import json
import os
import subprocess

from .conftest import ROOT, load_plugin

SCRIPT = ROOT / "roles" / "container" / "files" / "dflash-gpu-numa"
f = load_plugin("container", "dflash_container")


def test_gpu_numa_script_on_a_fake_node(tmp_path):
    sysfs = tmp_path / "sys"
    buses = {"0": ("00000000:18:00.0", 0), "1": ("00000000:2A:00.0", 0), "4": ("00000000:9A:00.0", 1)}
    for _index, (bus, numa) in buses.items():
        device = sysfs / "bus" / "pci" / "devices" / bus[4:].lower()
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{numa}\n")
    for node, cpus in {"0": "0-47,96-143", "1": "48-95,144-191"}.items():
        (sysfs / "devices" / "system" / "node" / f"node{node}").mkdir(parents=True)
        (sysfs / "devices" / "system" / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo '{i}, {bus}'\n" for i, (bus, _) in buses.items()))
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DFLASH_SYSFS": str(sysfs)}
    out = subprocess.run(["sh", str(SCRIPT)], env=env, capture_output=True, text=True, check=True).stdout
    facts = json.loads(out)
    assert facts == {"gpus": {"0": 0, "1": 0, "4": 1}, "nodes": {"0": "0-47,96-143", "1": "48-95,144-191"}}
    assert f.numa_cpuset([0, 1], facts["gpus"], facts["nodes"]) == "0-47,96-143"
