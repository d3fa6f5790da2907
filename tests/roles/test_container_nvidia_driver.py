"""GPUs asked for on a host without the NVIDIA driver (roles/container/tasks/nvidia.yml, run by ansible-playbook on
this machine): the failure is one line naming the GPU ids, the host and the fix, not the missing driver file's
`File not found`."""

from __future__ import annotations

from .conftest import run_role_cases


def test_gpus_on_a_host_without_the_nvidia_driver_fail_naming_the_gpus_and_the_fix(tmp_path):
    missing = tmp_path / "sys-module-nvidia-version"
    results = run_role_cases(tmp_path, "container", "nvidia.yml", {"no_driver": {
        "dflash_container_host": "node-a", "dflash_container_name": "dflash-c1", "dflash_container_gpus": [7],
        "dflash_container_nvidia_driver_version_file": str(missing)}})  # fmt: skip
    msg = results["no_driver"].get("msg", "")
    assert not results["no_driver"]["ok"], results
    assert msg.startswith("GPU(s) 7 asked for container dflash-c1"), msg
    assert f"its host node-a has no NVIDIA driver loaded ({missing}:" in msg, msg
    assert "load the NVIDIA driver on node-a, or set those GPU ids to [] for a CPU job" in msg, msg
    assert "\n" not in msg.strip()
