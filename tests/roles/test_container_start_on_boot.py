"""The container starts when its host or node boots (LXC `lxc.start.auto`, Proxmox `onboot`), by default and
configurably: the role's own LXC config and `pct create`/`pct set` arguments, rendered by Ansible from its defaults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "container"


def _render_all(tmp_path: Path, cases: dict[str, tuple[str, dict]]) -> dict[str, object]:
    """Each case's Jinja expression rendered with the role's defaults (and its own variables), in one play."""
    tasks = [{"ansible.builtin.copy": {"content": "{{ (" + expression + ") | to_json }}",
                                       "dest": str(tmp_path / f"{name}.json"), "mode": "0644"},
              "vars": variables} for name, (expression, variables) in cases.items()]  # fmt: skip
    play = [{"hosts": "localhost", "gather_facts": False, "vars_files": [str(ROLE / "defaults" / "main.yml")],
             "tasks": tasks}]  # fmt: skip
    (tmp_path / "play.yml").write_text(json.dumps(play))
    env = {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": f"{sys.prefix}/bin:/usr/bin:/bin", "HOME": str(tmp_path),
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / ".ansible-tmp")}  # fmt: skip
    extra = {"dflash_container_id": 200, "dflash_container_pct_template": "local:vztmpl/debian-12.tar.zst",
             "_dflash_container_template": "local:vztmpl/debian-12.tar.zst",
             "_dflash_container_dir": "/var/lib/lxc/c1", "_dflash_container_mounts": [], "dflash_container_name": "c1",
             "ansible_managed": "managed"}  # fmt: skip
    proc = subprocess.run([f"{sys.prefix}/bin/ansible-playbook", "-i", "localhost,", "-c", "local", "-e", json.dumps(extra),
                           "-e", f"ansible_python_interpreter={sys.executable}", str(tmp_path / "play.yml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in cases}


def _expression(text: str) -> str:
    text = text.strip()
    assert text.startswith("{{") and text.endswith("}}")
    return text[2:-2]


def test_the_container_starts_at_boot_by_default_and_can_be_told_not_to(tmp_path):
    create = yaml.safe_load((ROLE / "tasks" / "proxmox" / "create.yml").read_text())[0]
    argv = _expression(create["ansible.builtin.command"]["argv"])
    configure = yaml.safe_load((ROLE / "tasks" / "proxmox" / "configure.yml").read_text())
    compute = next(t for t in configure if t.get("name") == "Compute the pct set arguments")
    onboot = _expression(compute["vars"]["_onboot"])
    lxc = "lookup('ansible.builtin.template', '" + str(ROLE / "templates" / "lxc.conf.j2") + "')"
    off = {"dflash_container_start_on_boot": False}
    out = _render_all(tmp_path, {
        "argv_on": (argv, {}), "argv_off": (argv, off),
        "lxc_on": (lxc, {}), "lxc_off": (lxc, off),
        # pct set: on where it is not set; off only where it is on (onboot absent from pct config means 0)
        "set_on_fresh": (onboot, {"_current": {}}), "set_on_already": (onboot, {"_current": {"onboot": "1"}}),
        "set_off_fresh": (onboot, {**off, "_current": {}}), "set_off_was_on": (onboot, {**off, "_current": {"onboot": "1"}}),
    })  # fmt: skip
    assert out["argv_on"][out["argv_on"].index("--onboot") + 1] == "1"
    assert out["argv_off"][out["argv_off"].index("--onboot") + 1] == "0"
    assert "lxc.start.auto = 1" in out["lxc_on"].splitlines()
    assert "lxc.start.auto = 0" in out["lxc_off"].splitlines()
    assert out["set_on_fresh"] == {"onboot": 1} and out["set_on_already"] == {"onboot": 1}
    assert out["set_off_fresh"] == {} and out["set_off_was_on"] == {"onboot": 0}


def test_pct_set_changes_onboot_only_where_it_differs():
    sys.path.insert(0, str(ROLE / "filter_plugins"))
    from dflash_container import pct_restart_keys, pct_set_args

    assert pct_set_args({"onboot": 1}, {"onboot": "1"}) == []
    args = pct_set_args({"onboot": 1}, {})
    assert args == ["--onboot", "1"] and pct_restart_keys(args) == []  # applied live: no container restart


def test_the_option_is_documented():
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    assert specs["dflash_container_start_on_boot"]["default"] is True
    assert defaults["dflash_container_start_on_boot"] is True
