"""The sources of a Proxmox container's bind mounts (roles/container/tasks/proxmox/bind_sources.yml), run by
ansible-playbook on this machine: a missing one is created owned by the container's root (uid 100000 on the node
for an unprivileged container: PVE refuses to start a container whose mount source is missing); an existing one
the container's root cannot write is refused with the chown that fixes it; readonly mounts and privileged
containers are left alone. And the two-node example inventory passes the checks a first start needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT, load_plugin, run_role_cases

f = load_plugin("container", "dflash_container")


def _run(tmp_path, cases):
    return run_role_cases(tmp_path, "container", "proxmox/bind_sources.yml",
                          {name: {"dflash_container_host": "node-a", **v} for name, v in cases.items()})


def test_bind_mount_sources_are_created_for_the_mapped_root_and_unwritable_ones_refused(tmp_path):
    missing, root_owned, readonly = tmp_path / "cephfs" / "dflash", tmp_path / "root-owned", tmp_path / "data"
    root_owned.mkdir()
    readonly.mkdir()
    os.chmod(root_owned, 0o755)
    results = _run(tmp_path, {
        "unprivileged": {"dflash_container_pct_unprivileged": True, "dflash_container_bind_mounts": [
            {"src": str(missing), "dest": "/srv/dflash-shared"}, {"src": str(readonly), "dest": "/data", "readonly": True}]},
        "root_owned": {"dflash_container_pct_unprivileged": True,
                       "dflash_container_bind_mounts": [{"src": str(root_owned), "dest": "/srv/x"}]},
        "privileged": {"dflash_container_pct_unprivileged": False,
                       "dflash_container_bind_mounts": [{"src": str(root_owned), "dest": "/srv/x"}]},
    })  # fmt: skip
    assert results["unprivileged"] == {"ok": True}
    st = missing.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (100000, 100000, 0o750)
    assert readonly.stat().st_uid == os.getuid()  # a readonly mount's source is not touched
    msg = results["root_owned"]["msg"]
    assert not results["root_owned"]["ok"] and f"{root_owned} (owner uid 0) on node-a" in msg, msg
    assert "chown 100000:100000 DIR" in msg and root_owned.stat().st_uid == 0
    assert results["privileged"] == {"ok": True}


def test_the_filters_name_unwritable_sources_and_a_static_address_without_gateway():
    results = [{"item": {"src": "/a"}, "stat": {"exists": True, "uid": 0, "woth": False}},
               {"item": {"src": "/b"}, "stat": {"exists": True, "uid": 100000, "woth": False}},
               {"item": {"src": "/c"}, "stat": {"exists": True, "uid": 0, "woth": True}},
               {"item": {"src": "/d", "readonly": True}, "stat": {"exists": True, "uid": 0, "woth": False}},
               {"item": {"src": "/e"}, "stat": {"exists": False}}]  # fmt: skip
    assert f.unwritable_sources(results, "100000") == ["/a (owner uid 0)"]
    assert f.net0_problems("name=eth0,bridge=vmbr1,ip=10.10.0.200/24")[0].startswith("dflash_container_pct_net0 (")
    assert f.net0_problems("name=eth0,bridge=vmbr1,ip=10.10.0.200/24,gw=10.10.0.1") == []
    assert f.net0_problems("name=eth0,bridge=vmbr0,ip=dhcp") == [] and f.net0_problems("none") == []


def test_the_two_node_example_has_a_gateway_and_absolute_mount_sources():
    """What the example must give for its containers to start and install packages (failed before: no gw=)."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
    data = json.loads(subprocess.run([str(Path(sys.executable).parent / "ansible-inventory"), "-i",
                                      "inventories/proxmox-multinode.example", "--list"],
                                     cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=600).stdout)  # fmt: skip
    hosts = data["qwen3_8b_2node"]["hosts"]
    assert len(hosts) == 2
    for host in hosts:
        hv = data["_meta"]["hostvars"][host]
        net0 = hv["dflash_container_pct_net0"].replace("{{ dflash_container_id }}", str(hv["dflash_container_id"]))
        assert f.net0_problems(net0) == [], (host, net0)
        assert all(m["src"].startswith("/") for m in hv["dflash_container_bind_mounts"])
        assert hv["dflash_job_rendezvous_address"].startswith("10.10.0.")


def test_a_missing_read_only_source_is_refused_never_created(tmp_path):
    models = tmp_path / "models" / "Qwen3-8B"
    results = _run(tmp_path, {"typo": {"dflash_container_pct_unprivileged": True, "dflash_container_bind_mounts": [
        {"src": str(models), "dest": "/models/Qwen3-8B", "readonly": True}]}})  # fmt: skip
    msg = results["typo"]["msg"]
    assert not results["typo"]["ok"] and f"{models} on node-a does not exist (a read-only source is never created)" in msg
    assert not models.exists() and not models.parent.exists()


def _hostvars_all(inventory: str) -> dict:
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
    data = json.loads(subprocess.run([str(Path(sys.executable).parent / "ansible-inventory"), "-i", inventory, "--list"],
                                     cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=600).stdout)  # fmt: skip
    return data["_meta"]["hostvars"]


def _hostvars(inventory: str) -> dict:
    return {h: hv for h, hv in _hostvars_all(inventory).items() if "dflash_container_id" in hv}


def test_the_examples_mount_the_model_and_data_read_only_and_need_no_nvcc():
    """What the examples' config reads (target.path, data paths) is a read-only mount; the target is dense, so the
    kernels role builds nothing (no nvcc); multi-node containers share one template and trainer uid, and pin CPUs."""
    import yaml

    kernels = load_plugin("kernels", "dflash_kernels")
    for inventory in ("inventories/proxmox.example", "inventories/proxmox-multinode.example"):
        for host, hv in _hostvars(inventory).items():
            config = yaml.safe_load((ROOT / "configs" / hv["dflash_job_base_config"]).read_text())
            needed = [config["target"]["path"], config["data"]["train_path"], config["data"]["eval_path"]]
            readonly = [m for m in hv["dflash_container_bind_mounts"] if m.get("readonly")]
            for path in needed:
                assert any(path == m["dest"] or path.startswith(m["dest"].rstrip("/") + "/") for m in readonly), (host, path)
            assert str(hv["dflash_venv_uid"]) == "990", host
            model_type = "qwen3"  # Qwen3-8B's config.json
            assert kernels.kernels_for_target(model_type, hv.get("dflash_kernels_fast_path", "auto")) == [], host
            if "multinode" in inventory:
                assert hv["dflash_container_pct_template"].startswith("local:vztmpl/debian-12-standard_"), host
                assert hv["dflash_container_pct_numa_pin"] is True and int(hv["dflash_container_pct_cores"]) >= 8
                node = _hostvars_all(inventory)[hv["dflash_container_host"]]
                assert node["dflash_node_pve_guests_wait_mounts"] == ["/mnt/pve/cephfs"]
