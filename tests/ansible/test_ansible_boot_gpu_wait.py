"""A job relaunched at boot waits (bounded) for its GPUs: after a reboot of an NVSwitch node CUDA sees no GPU until
the fabric manager is done, and the trainer would exit as bad input (2, never restarted). The unit's relaunch
script (RELAUNCH_SCRIPT) runs here with stand-ins for systemctl and nvidia-smi on PATH."""

from __future__ import annotations

import os
import subprocess
import time

from ansible.module_utils.dflash_unit_systemd import RELAUNCH_SCRIPT


def setup(tmp_path, gpus: str):
    state, bin_dir = tmp_path / "state", tmp_path / "bin"
    state.mkdir()
    bin_dir.mkdir()
    (state / "relaunch").write_text(RELAUNCH_SCRIPT)
    (state / "desired").write_text("running\n")
    (state / "record.conf").write_text("[Service]\n")
    (state / "environment").write_text(f"CUDA_VISIBLE_DEVICES={gpus}\nDFLASH_X=1\n")
    launched = tmp_path / "launched"
    (state / "launch.argv").write_bytes(b"\0".join([b"sh", b"-c", f"date +%s > {launched}".encode()]) + b"\0")
    # The node's fabric: "In Progress" and no GPU listed until the flag file exists.
    ready = tmp_path / "fabric-ready"
    (bin_dir / "nvidia-smi").write_text(
        f"#!/bin/sh\nif [ -e {ready} ]; then n=2; s=Completed; else n=0; s='In Progress'; fi\n"
        'if [ "$1" = -L ]; then i=0; while [ $i -lt $n ]; do echo "GPU $i: NVIDIA H200 (UUID: GPU-$i)"; i=$((i+1)); done; '
        "exit 0; fi\nfor g in 0 1; do printf 'GPU 0000:0%s:00.0\\n    Fabric\\n        State : %s\\n' $g \"$s\"; done\n")
    (bin_dir / "systemctl").write_text("#!/bin/sh\nexit 0\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DFLASH_BOOT_GPU_WAIT_S": "30"}
    argv = ["sh", str(state / "relaunch"), str(state), "dflash-train", str(tmp_path / "units"), str(tmp_path / "markers")]
    return argv, env, ready, launched


def test_the_relaunch_waits_for_the_fabric_then_launches(tmp_path):
    argv, env, ready, launched = setup(tmp_path, "0,1")
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(2)
    assert proc.poll() is None and not launched.exists()  # waiting, not launched into a CUDA error
    ready.touch()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "dflash job dflash-train: waiting up to 30 s for its GPUs (0 of its 2 GPUs visible, fabric state: 2 In Progress;)" in out
    assert launched.exists() and "relaunched from its last deployed launch" in out


def test_the_wait_is_bounded(tmp_path):
    argv, env, _ready, launched = setup(tmp_path, "0,1")
    out = subprocess.run(argv, env={**env, "DFLASH_BOOT_GPU_WAIT_S": "0"}, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "GPUs still not ready after 0 s (0 of its 2 GPUs visible" in out.stdout and launched.exists()


def test_a_cpu_job_does_not_wait(tmp_path):
    argv, env, _ready, launched = setup(tmp_path, "")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "waiting" not in out.stdout and launched.exists()
