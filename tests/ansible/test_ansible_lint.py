"""Every playbook passes --syntax-check; the repository passes ansible-lint (production) and yamllint."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess

import pytest
from conftest import ROOT, tool

PLAYBOOKS = sorted(p.relative_to(ROOT) for p in (ROOT / "playbooks").glob("*.yml"))


def test_the_main_playbooks_exist():
    names = {p.name for p in PLAYBOOKS}
    assert {"train.yml", "provision.yml", "deploy.yml", "status.yml", "stop.yml"} <= names


@pytest.mark.parametrize("inventory", ["inventories/local", "inventories/proxmox.example"])
def test_syntax_check(inventory, ansible_env):
    # One call checks every playbook (ansible-playbook takes several); each is named in the output.
    proc = subprocess.run(
        [tool("ansible-playbook"), "--syntax-check", "-i", inventory, *map(str, PLAYBOOKS)],
        cwd=ROOT, env=ansible_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for playbook in PLAYBOOKS:
        assert f"playbook: {playbook}" in proc.stdout


def test_inventories_define_the_groups(ansible_env):
    for inventory, container in [("inventories/local", "dflash-local"), ("inventories/proxmox.example", "dflash-200")]:
        proc = subprocess.run([tool("ansible-inventory"), "-i", inventory, "--list"], cwd=ROOT, env=ansible_env,
                              capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
        data = json.loads(proc.stdout)
        assert container in data["dflash_containers"]["hosts"]
        assert data["dflash_hosts"]["hosts"]
        hostvars = data["_meta"]["hostvars"][container]
        assert hostvars["dflash_container_host"] in data["dflash_hosts"]["hosts"]
    proxmox = json.loads(subprocess.run([tool("ansible-inventory"), "-i", "inventories/proxmox.example", "--host", "dflash-200"],
                                        cwd=ROOT, env=ansible_env, capture_output=True, text=True, check=True).stdout)  # fmt: skip
    assert proxmox["ansible_connection"] == "community.proxmox.proxmox_pct_remote" and proxmox["proxmox_vmid"] == 200
    assert proxmox["dflash_job_target_gpu_ids"] == [0, 1, 2, 3, 4] and proxmox["dflash_job_drafter_gpu_ids"] == [5, 6, 7]


@pytest.mark.slow
def test_ansible_lint_production_profile(ansible_env):
    env = {**ansible_env, "ANSIBLE_LINT_SKIP_SCHEMA_UPDATE": "1"}
    proc = subprocess.run([tool("ansible-lint"), "--offline", "--nocolor"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]


def test_yamllint(ansible_env):
    proc = subprocess.run([tool("yamllint"), "-s", "."], cwd=ROOT, env=ansible_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]


def test_ruff_on_the_ansible_python():
    proc = subprocess.run([tool("ruff"), "check", "library", "module_utils", "tests/ansible"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


MODULES = sorted(p.stem for p in (ROOT / "library").glob("dflash_*.py"))


def test_module_docs_render_and_match_the_argument_spec(ansible_env):
    assert MODULES == ["dflash_check", "dflash_directory", "dflash_gpu_facts", "dflash_health", "dflash_inventory_check", "dflash_lock", "dflash_logs",
                       "dflash_pct_conf", "dflash_progress", "dflash_sync", "dflash_unit"]
    proc = subprocess.run([tool("ansible-doc"), "-t", "module", "-M", "library", "--json", *MODULES], cwd=ROOT, env=ansible_env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    docs = json.loads(proc.stdout)
    for name in MODULES:
        doc = docs[name]
        assert doc["doc"]["attributes"]["check_mode"]["support"] == "full", name
        assert "diff_mode" in doc["doc"]["attributes"], name
        assert doc["examples"].strip() and doc["return"], name
        source = (ROOT / "library" / f"{name}.py").read_text()
        documented = set(doc["doc"]["options"])
        if "\nARGUMENT_SPEC = " in source:
            # One source for each default: the documented one is the coded one (e.g. a module_utils constant).
            spec = _load_module(name).ARGUMENT_SPEC
            coded = set(spec)
            for option in documented & coded:
                assert doc["doc"]["options"][option].get("default") == spec[option].get("default"), (name, option)
        else:
            spec = source[source.index("argument_spec={"):]
            coded = set(re.findall(r'^\s{12}"(\w+)": \{"type"', spec, re.M))
        assert documented == coded, f"{name}: documented {sorted(documented ^ coded)} differ from argument_spec"


def _load_module(name):
    loaded = importlib.util.spec_from_file_location(f"_dflash_library_{name}", ROOT / "library" / f"{name}.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module
