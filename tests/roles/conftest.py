"""Helpers to import the roles' filter plugins and the proxmox scenario's `pct` double (plain Python files,
not a package)."""

import importlib.machinery
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_plugin(role: str, name: str):
    path = ROOT / "roles" / role / "filter_plugins" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_test_{role}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_pct_double(name: str, tmp_path, monkeypatch):
    """A fresh import of molecule/proxmox/files/pct whose state and containers live under `tmp_path`."""
    path = ROOT / "molecule" / "proxmox" / "files" / "pct"
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
    monkeypatch.setattr(module, "STATE", str(tmp_path / "state"))
    monkeypatch.setattr(module, "LXC_PATH", str(tmp_path / "lxc"))
    return module


def run_role_cases(tmp_path, role: str, tasks_from: str, cases: dict) -> dict:
    """Run `role`'s `tasks_from` once per case (name -> vars) on this machine with ansible-playbook, each in a
    block whose rescue keeps the failure: {name: {"ok": True} or {"ok": False, "msg": the failure's message}}."""
    import json
    import os
    import subprocess
    import sys

    import yaml

    tasks = [{"name": name, "block": [
        {"name": "Run the tasks", "ansible.builtin.include_role": {"name": role, "tasks_from": tasks_from}, "vars": variables},
        {"name": "Keep success", "ansible.builtin.set_fact": {f"result_{name}": {"ok": True}}},
    ], "rescue": [{"name": "Keep the failure",
                   "ansible.builtin.set_fact": {f"result_{name}": {"ok": False, "msg": "{{ ansible_failed_result.msg }}"}}}]}
             for name, variables in cases.items()]  # fmt: skip
    tasks.append({"name": "Dump", "ansible.builtin.copy": {"dest": str(tmp_path / "results.json"), "mode": "0644",
                  "content": "{{ {" + ", ".join(f"'{n}': result_{n}" for n in cases) + "} | to_json }}"}})  # fmt: skip
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": tasks}]))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_ROLES_PATH": str(ROOT / "roles"),
           "ANSIBLE_NOCOLOR": "1"}  # fmt: skip
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           str(playbook), "-e", json.dumps({"ansible_python_interpreter": sys.executable})],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((tmp_path / "results.json").read_text())
