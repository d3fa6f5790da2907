"""The GPU health gate: `nvidia-smi -q` (captured on an H200) and the kernel's Xid records read into faults per
GPU (uncorrectable ECC, failed or pending row remap, pending page retirement, a lost GPU, fatal Xids); the health
check fails at once on an unfit job GPU; the role's gate refuses the launch naming the GPU (a fake nvidia-smi
in PATH, the real dflash_gpu_facts module and the real tasks file run by ansible-playbook)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible.module_utils.dflash_gpu import gpu_faults, health_faults, parse_query, parse_xids
from ansible.module_utils.dflash_health import check_health
from conftest import FIXTURES
from test_ansible_health import ACTIVE, Trainer, params

ROOT = Path(__file__).resolve().parents[2]
Q = (FIXTURES / "nvidia_smi" / "h200_q.txt").read_text()
UUID = "GPU-c8bbc8ee-a988-067b-2498-8c6da5f6f1c4"
GPU_CSV = f"0, {UUID}, NVIDIA H200, 580.159.04, 143771, 70000, 90, Disabled\n"
XID_79 = "[ 8123.456789] NVRM: Xid (PCI:0000:00:06): 79, pid=1234, name=python3, GPU has fallen off the bus.\n"


def unhealthy(text=Q):
    """The captured -q output with 2 volatile uncorrectable DRAM errors and a pending row remap."""
    ecc = text.index("        Volatile\n")
    dram = text.index("DRAM Uncorrectable", ecc)
    line_end = text.index("\n", dram)
    text = text[:dram] + text[dram:line_end].replace(": 0", ": 2") + text[line_end:]
    remap = text.index("    Remapped Rows\n")
    pending = text.index("Pending ", remap)
    line_end = text.index("\n", pending)
    return text[:pending] + text[pending:line_end].replace(": No", ": Yes") + text[line_end:]


def test_the_captured_h200_is_fit_and_its_sections_are_read():
    sections, lost = parse_query(Q)
    assert list(sections) == ["00000000:00:06.0"] and lost == {}
    section = sections["00000000:00:06.0"]
    assert section["GPU UUID"] == UUID and section["ECC Errors/Volatile/DRAM Uncorrectable"] == "0"
    assert section["Remapped Rows/Remapping Failure Occurred"] == "No"
    assert health_faults(section) == []


@pytest.mark.parametrize("counter", ["DRAM Uncorrectable", "SRAM Uncorrectable SEC-DED", "SRAM Uncorrectable Parity"])
def test_a_single_uncorrectable_ecc_error_is_a_fault(counter):
    """One is enough (a threshold of more than one, or a counter left unread, passes a GPU that corrupts memory)."""
    volatile = Q.index("        Volatile\n")
    at = Q.index(counter, volatile)
    line_end = Q.index("\n", at)
    one = Q[:at] + Q[at:line_end].replace(": 0", ": 1") + Q[line_end:]
    faults = health_faults(parse_query(one)[0]["00000000:00:06.0"])
    assert faults == [f"uncorrectable ECC errors since the driver loaded ({counter} 1): reset the GPU before using it"]


def test_ecc_remap_lost_and_xid_faults():
    section = parse_query(unhealthy())[0]["00000000:00:06.0"]
    assert health_faults(section) == [
        "uncorrectable ECC errors since the driver loaded (DRAM Uncorrectable 2): reset the GPU before using it",
        "a row remap is pending: reset the GPU (or reboot the node) to apply it"]
    failed = Q.replace("Remapping Failure Occurred                     : No", "Remapping Failure Occurred                     : Yes")
    assert "row remapping failed" in health_faults(parse_query(failed)[0]["00000000:00:06.0"])[0]
    lost = Q + "Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost.  Reboot the system to recover this GPU\n"
    assert parse_query(lost)[1] == {"0000:3B:00.0": "GPU is lost.  Reboot the system to recover this GPU"}
    # app errors (Xid 13, 31, 43) are the program's, not the GPU's
    log = "NVRM: Xid (PCI:0000:00:06): 13, pid=1, Graphics Exception\nNVRM: Xid (PCI:0000:3b:00): 31, pid=2\n" + XID_79
    assert parse_xids(log) == {"0000:00:06": ["Xid 79 (fallen off the bus) in the kernel log since boot"]}


class Host:
    def __init__(self, q, dmesg=(1, "", "dmesg: read kernel buffer failed: Operation not permitted")):
        self.answers = {"--query-gpu": (0, GPU_CSV, ""), "--query-compute-apps": (0, "", ""), "nvidia-smi -q": (0, q, ""),
                        "dmesg": dmesg}  # fmt: skip

    def run(self, args, check_rc=False):
        joined = " ".join(args)
        return next((answer for key, answer in self.answers.items() if key in joined), (0, "", ""))

    def which(self, name, extra_dirs=()):
        return "/usr/bin/nvidia-smi"

    def now(self):
        return 0.0

    def sleep(self, seconds):
        raise AssertionError("a one-look check does not sleep")


def test_gpu_faults_maps_sections_to_indices_and_reads_the_kernel_log_where_it_may():
    gpus = [{"index": 0, "uuid": UUID}]
    assert gpu_faults(Host(Q), gpus) == ({}, [])  # dmesg refused in a container: Xids not looked at
    faults, lost = gpu_faults(Host(Q, dmesg=(0, XID_79, "")), gpus)
    assert faults == {0: ["Xid 79 (fallen off the bus) in the kernel log since boot"]} and lost == []


def test_the_nodes_kernel_log_is_used_where_it_was_read_there():
    """An unprivileged container may not read dmesg: the gate hands in the node's Xid lines (roles/job/tasks/
    gpu_gate.yml). What the node read stands, its Xids included; the container's own dmesg is not read then."""
    gpus = [{"index": 0, "uuid": UUID}]
    faults, _ = gpu_faults(Host(Q), gpus, kernel_log=XID_79)  # the container's dmesg refused
    assert faults == {0: ["Xid 79 (fallen off the bus) in the kernel log since boot"]}
    assert gpu_faults(Host(Q, dmesg=(0, XID_79, "")), gpus, kernel_log="") == ({}, [])  # the node: none since boot


def test_health_fails_at_once_on_an_unfit_job_gpu(tmp_path):
    trainer = Trainer(tmp_path)
    trainer.start()
    try:
        host = Host(unhealthy())
        slept = []
        host.now, host.sleep = (lambda: sum(slept)), slept.append
        result = check_health(host, params(tmp_path, gpu_ids=[0], gpu_min_memory_mib=1024, timeout=60), lambda: dict(ACTIVE))
    finally:
        trainer.running = False
    gpu = next(f for f in result["failures"] if f["invariant"] == "gpu")
    assert not result["healthy"] and sum(slept) == 0, result["diagnosis"]  # final at the first look
    assert gpu["reason"].startswith("unfit GPU(s), the job cannot run on them: GPU 0: uncorrectable ECC errors")


def run_gate(tmp_path, q_text: str, extra_vars: dict | None = None) -> str:
    """The job role's gpu_gate.yml on localhost with a stand-in nvidia-smi: the launch refusal's message."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "q.txt").write_text(q_text)
    (tmp_path / "gpu.csv").write_text(GPU_CSV)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"""#!/bin/sh
case "$*" in
  *--query-gpu*) cat {tmp_path}/gpu.csv ;;
  *--query-compute-apps*) ;;
  -q) cat {tmp_path}/q.txt ;;
  *) exit 2 ;;
esac
""")
    smi.chmod(0o755)
    tasks = [{"name": "Gate", "block": [
        {"ansible.builtin.include_role": {"name": "job", "tasks_from": "gpu_gate.yml"},
         "vars": {"_dflash_job_gpu_ids": [0], **(extra_vars or {})}}],
        "rescue": [{"ansible.builtin.copy": {"dest": str(tmp_path / "msg.txt"), "content": "{{ ansible_failed_result.msg }}",
                                             "mode": "0644"}}]}]  # fmt: skip
    (tmp_path / "play.yml").write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": tasks}]))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
           "ANSIBLE_ROLES_PATH": str(ROOT / "roles"), "ANSIBLE_NOCOLOR": "1"}  # fmt: skip
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           str(tmp_path / "play.yml"), "-e", json.dumps({"ansible_python_interpreter": sys.executable})],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return (tmp_path / "msg.txt").read_text()


def test_the_role_refuses_the_launch_naming_the_gpu(tmp_path):
    msg = run_gate(tmp_path, unhealthy())
    assert msg.startswith("The launch on localhost is refused: GPU 0: uncorrectable ECC errors"), msg
    assert "a row remap is pending" in msg and "Leave an unfit GPU out of dflash_job_target_gpu_ids" in msg


def test_the_gate_reads_the_xids_on_the_node(tmp_path):
    """The container (here: the module's run) may not read dmesg; the node (dflash_container_host, here the same
    machine, told apart by the node read's LC_ALL=C) has a fatal Xid of GPU 0's bus: the launch is refused for it."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "dmesg").write_text(f"#!/bin/sh\n[ \"$LC_ALL\" = C ] || exit 1\nprintf '%s' '{XID_79.strip()}'\n")
    (fake / "dmesg").chmod(0o755)
    msg = run_gate(tmp_path, Q, {"dflash_container_host": "localhost"})
    assert msg.startswith("The launch on localhost is refused: GPU 0: Xid 79 (fallen off the bus)"), msg


def test_a_driver_upgrade_on_the_node_reads_driver_mismatch_with_the_fix(tmp_path):
    """The trainer exited 2 at start (its userspace is older than the node's new kernel module) and nvidia-smi in
    the container says so: status names the state and the provision run, not a crash to restart."""
    (tmp_path / "job.log").write_text("dflash: error: runtime.device is 'cuda' but the container's NVIDIA userspace ...\n")
    host = Host(Q)
    host.answers["--query-gpu"] = (18, "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.159\n", "")
    dead = {**ACTIVE, "active_state": "failed", "sub_state": "failed", "main_pid": 0, "exit_status": 2}
    result = check_health(host, params(tmp_path, gpu_ids=[0], timeout=0), lambda: dict(dead))
    assert result["state"] == "driver-mismatch" and not result["ok"], result["diagnosis"]
    assert "playbooks/provision.yml" in result["hint"] and "driver mismatch: " in result["diagnosis"]
