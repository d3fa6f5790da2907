"""One GPU contract: the inventory's host GPU numbers, translated once (roles/job/vars/main.yml) into the unit's
CUDA_VISIBLE_DEVICES and the trainer's topology, with non-identity sets (target [2, 3] + drafter [5]) end to end
on CPU: Ansible renders the contract, the trainer's own device check accepts it with the device count that
CUDA_VISIBLE_DEVICES leaves (mocked: no GPU here), every rank lands on the inventory's GPU, and the health
check looks at those host GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import yaml
from ansible.module_utils.dflash_health import check_health
from conftest import ROOT, tool

from dflash.config import RunConfig, _build, validate
from dflash.errors import BadInput
from dflash.runtime.topology import check_devices, plan_ranks

CASES = {
    # name: (target, drafter) -> (CUDA_VISIBLE_DEVICES, topology)
    "disaggregated 2,3 + 5": (([2, 3], [5]), ("2,3,5", {"mode": "disaggregated", "target_gpus": [0, 1], "drafter_gpus": [2]})),
    "drafter below target": (([5], [0, 7]), ("0,5,7", {"mode": "disaggregated", "target_gpus": [1], "drafter_gpus": [0, 2]})),
    "identity 0-4 + 5-7": (([0, 1, 2, 3, 4], [5, 6, 7]),
                           ("0,1,2,3,4,5,6,7", {"mode": "disaggregated", "target_gpus": [0, 1, 2, 3, 4], "drafter_gpus": [5, 6, 7]})),
    "colocated 4,6": (([4, 6], []), ("4,6", {"mode": "colocated", "nproc": 2})),
    "colocated from drafter set": (([], [1, 3, 6]), ("1,3,6", {"mode": "colocated", "nproc": 3})),
    "cpu": (([], []), (None, None)),
}  # fmt: skip


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """What the job role derives from each case (its defaults and vars, rendered by Ansible itself)."""
    tmp = tmp_path_factory.mktemp("gpucontract")
    out = {}
    for name, ((target, drafter), _) in CASES.items():
        play = [{"hosts": "localhost", "gather_facts": False,
                 "vars_files": [str(ROOT / "roles/job/defaults/main.yml"), str(ROOT / "roles/job/vars/main.yml")],
                 "tasks": [{"ansible.builtin.copy": {
                     "content": "{{ {'env': _dflash_job_gpu_environment, 'topology': _dflash_job_topology, "
                                "'gpu_ids': _dflash_job_gpu_ids} | to_json }}",
                     "dest": str(tmp / "out.json"), "mode": "0644"}}]}]  # fmt: skip
        (tmp / "play.yml").write_text(json.dumps(play))
        extra = json.dumps({"dflash_job_target_gpu_ids": target, "dflash_job_drafter_gpu_ids": drafter})
        env = {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": f"{sys.prefix}/bin:/usr/bin:/bin", "HOME": str(tmp),
               "ANSIBLE_LOCAL_TEMP": str(tmp / ".ansible-tmp")}  # fmt: skip
        proc = subprocess.run([tool("ansible-playbook"), "-i", "localhost,", "-c", "local", "-e", extra,
                               "-e", f"ansible_python_interpreter={sys.executable}", str(tmp / "play.yml")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out[name] = json.loads((tmp / "out.json").read_text())
    return out


@pytest.mark.parametrize("name", CASES)
def test_the_role_translates_host_gpus_to_visible_indices_once(rendered, name):
    (target, drafter), (visible, topology) = CASES[name]
    got = rendered[name]
    assert got["env"] == ({"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": visible} if visible else {})
    assert got["topology"] == ({"topology": topology} if topology else {})
    assert got["gpu_ids"] == sorted(set(target + drafter))  # host numbers: passthrough, release wait, health


def test_the_unit_gets_the_translated_environment_and_the_config_the_translated_topology():
    # The unit's arguments are one spec (recorded at each launch for a rollback), which launch.yml passes on.
    spec = yaml.safe_load((ROOT / "roles/job/vars/main.yml").read_text())["_dflash_job_unit_spec"]
    assert "_dflash_job_gpu_environment" in spec["environment"] and spec["gpu_ids"] == "{{ _dflash_job_gpu_ids }}"
    assert "_dflash_job_unit_spec" in (ROOT / "roles/job/tasks/launch.yml").read_text()
    assert "_dflash_job_topology" in (ROOT / "roles/job/tasks/configure.yml").read_text()
    env_defaults = yaml.safe_load((ROOT / "roles/env/defaults/main.yml").read_text())
    assert env_defaults["dflash_env_cuda_visible_devices"] == []  # no second, possibly different, list


def _config(topology: dict) -> RunConfig:
    data = yaml.safe_load((ROOT / "configs" / "tiny-cpu.yaml").read_text())
    data["topology"] = {**data.get("topology", {}), **topology}
    data["runtime"]["device"] = "cuda"
    data["data"].pop("regenerate", None)  # colocated-only; the GPU contract is what is tested
    config = _build(RunConfig, data, "")
    validate(config)
    return config


def _mock_visible(monkeypatch, visible: str):
    """A process started with CUDA_VISIBLE_DEVICES=visible: it sees len(visible) GPUs, numbered from 0."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible.split(",")))


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][1][0]])
def test_the_trainer_accepts_the_contract_and_every_rank_lands_on_the_inventorys_gpu(rendered, name, monkeypatch):
    (target, drafter), (visible, _) = CASES[name]
    _mock_visible(monkeypatch, visible)
    config = _config(rendered[name]["topology"]["topology"])
    plan = plan_ranks(config.topology)
    check_devices(config, plan)  # exit 2 before: "topology names GPU ids [3, 5] but only ids 0..2 are visible"
    host = [int(g) for g in visible.split(",")]
    used = [host[plan.gpu_of(rank)] for rank in range(plan.world_size)]
    assert plan.world_size == len(target + drafter)  # one rank per GPU, also when only one set is given
    if target and drafter:
        assert used == target + drafter  # target ranks first, then drafter ranks, on the inventory's GPUs
    else:
        assert used == sorted(target + drafter)


def test_host_numbers_in_the_topology_are_what_failed_before(monkeypatch):
    _mock_visible(monkeypatch, "2,3,5")
    config = _config({"mode": "disaggregated", "target_gpus": [2, 3], "drafter_gpus": [5]})
    with pytest.raises(BadInput, match=r"topology.target_gpus \[2, 3\] names GPU ids \[3\] but only ids 0\.\.2 are "
                                       r"visible \(CUDA_VISIBLE_DEVICES=2,3,5\)"):  # fmt: skip
        check_devices(config, plan_ranks(config.topology))


def _gpus_csv(used: dict[int, int]) -> str:
    return "".join(f"{i}, GPU-{i}, NVIDIA H200, 580.159.04, 143771, {used.get(i, 0)}, 0, Disabled\n" for i in range(8))


@pytest.mark.parametrize(("loaded", "healthy"), [({2: 70000, 3: 70000, 5: 30000}, True),
                                                 ({0: 70000, 1: 70000, 2: 30000}, False)])  # fmt: skip
def test_the_health_check_looks_at_the_inventorys_host_gpus(tmp_path, fake_host, loaded, healthy):
    """Job GPUs [2, 3, 5] on an 8-GPU node: the model on GPUs 2, 3 and 5 is healthy; on 0, 1 and 2 (the trainer
    using visible indices as host numbers) GPUs 3 and 5 are named."""
    (tmp_path / "job.log").write_text("step 1\n")
    apps = "".join(f"GPU-{i}, {os.getpid()}, python, {mib}\n" for i, mib in loaded.items())
    host = fake_host({"--query-gpu": (0, _gpus_csv(loaded), ""), "--query-compute-apps": (0, apps, "")})
    host.now, host.sleep = time.monotonic, time.sleep
    unit = {"load_state": "loaded", "active_state": "active", "sub_state": "running", "main_pid": os.getpid(),
            "exit_status": None, "result": None, "backend": "daemon", "started_at": time.time() - 3600}  # fmt: skip
    params = {"name": "job", "log_path": str(tmp_path / "job.log"), "heartbeat_path": str(tmp_path / "heartbeat.json"),
              "gpu_ids": [2, 3, 5], "gpu_min_memory_mib": 8192, "timeout": 0, "progress_window": 1, "poll_interval": 0.05,
              "log_lines": 5}  # fmt: skip
    result = check_health(host, params, lambda: dict(unit))
    gpu_failures = [f["reason"] for f in result["failures"] if f["invariant"] == "gpu"]
    if healthy:
        assert gpu_failures == []
    else:
        assert len(gpu_failures) == 1 and "GPU 3: 0 MiB" in gpu_failures[0] and "GPU 5: 0 MiB" in gpu_failures[0]
        assert "GPU 2" not in gpu_failures[0]
