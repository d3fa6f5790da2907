"""Proxmox containers are unprivileged by default, GPUs included: the role's own `pct create` command line
(rendered by Ansible from its defaults), the devN passthrough that works without privileges, and the bind
mounts owned by the mapped root."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "container"


def _render(expression: str, tmp_path: Path, **extra) -> object:
    play = [{"hosts": "localhost", "gather_facts": False,
             "vars_files": [str(ROLE / "defaults" / "main.yml")],
             "tasks": [{"ansible.builtin.copy": {"content": "{{ (" + expression + ") | to_json }}",
                                                 "dest": str(tmp_path / "out.json"), "mode": "0644"}}]}]  # fmt: skip
    (tmp_path / "play.yml").write_text(json.dumps(play))
    env = {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": f"{sys.prefix}/bin:/usr/bin:/bin", "HOME": str(tmp_path),
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / ".ansible-tmp")}  # fmt: skip
    extra = {"dflash_container_id": 200, "dflash_container_pct_template": "local:vztmpl/debian-12.tar.zst",
             "_dflash_container_template": "local:vztmpl/debian-12.tar.zst", **extra}
    proc = subprocess.run([f"{sys.prefix}/bin/ansible-playbook", "-i", "localhost,", "-c", "local", "-e", json.dumps(extra),
                           "-e", f"ansible_python_interpreter={sys.executable}", str(tmp_path / "play.yml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((tmp_path / "out.json").read_text())


def test_pct_create_makes_an_unprivileged_container_by_default(tmp_path):
    task = yaml.safe_load((ROLE / "tasks" / "proxmox" / "create.yml").read_text())[0]
    expression = task["ansible.builtin.command"]["argv"].strip()
    assert expression.startswith("{{") and expression.endswith("}}")
    argv = _render(expression[2:-2], tmp_path)
    assert argv[argv.index("--unprivileged") + 1] == "1"
    assert argv[argv.index("--features") + 1] == "nesting=1"  # systemd inside an unprivileged container
    privileged = _render(expression[2:-2], tmp_path, dflash_container_pct_unprivileged=False)
    assert privileged[privileged.index("--unprivileged") + 1] == "0"  # offered, not forced


def test_gpu_passthrough_and_mounts_work_for_the_unprivileged_container():
    sys.path.insert(0, str(ROLE / "filter_plugins"))
    try:
        from dflash_container import nvidia_dev_entries
    finally:
        sys.path.pop(0)
    entries = nvidia_dev_entries(["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"])
    assert all(v.endswith(",mode=0666") for v in entries.values())  # openable by the container's mapped root
    assert (ROLE / "defaults" / "main.yml").read_text().count("dflash_container_gpu_passthrough: devN") == 1
    # bind mounts (the role's own and the inventory's) owned by the mapped root
    assert "_dflash_container_mapped_root: \"{{ 100000 if dflash_container_pct_unprivileged else 0 }}\"" in \
        (ROLE / "vars" / "main.yml").read_text()
    for tasks in ("configure.yml", "bind_sources.yml"):
        assert 'owner: "{{ _dflash_container_mapped_root }}"' in (ROLE / "tasks" / "proxmox" / tasks).read_text()
