"""dflash.ops from an installed wheel, and the trainer without it.

The wheel carries the playbooks, roles, modules and ansible.cfg (setup.py copies them into
dflash/ops/project/); `dflash ops` run from a fresh venv outside the checkout finds them there
and imports no torch. A release synced into the containers leaves dflash/ops out, and no
trainer module imports it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dflash"


def _ops_imports(path: Path) -> list[tuple[int, bool]]:
    """(line, inside a function) of every import of dflash.ops in one module."""
    tree = ast.parse(path.read_text(), str(path))
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
        if any(n == "dflash.ops" or n.startswith("dflash.ops.") for n in names):
            found.append((node.lineno, id(node) in nested))
    return found


def test_no_trainer_module_imports_dflash_ops():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("dflash/ops/"):
            continue
        for line, deferred in _ops_imports(path):
            # The CLI hands `dflash ops ...` over, from inside its dispatch only.
            if not (rel == "dflash/cli.py" and deferred):
                offenders.append(f"{rel}:{line}")
    assert not offenders, f"trainer modules import dflash.ops, which the containers do not get: {offenders}"


def test_a_release_leaves_dflash_ops_out(tmp_path):
    """The job role's own tar command and exclude list (roles/job/tasks/sync.yml, defaults/main.yml)."""
    exclude = yaml.safe_load((ROOT / "roles/job/defaults/main.yml").read_text())["dflash_job_code_exclude"]
    items = yaml.safe_load((ROOT / "roles/job/vars/main.yml").read_text())["_dflash_job_source_items"]
    archive = tmp_path / "source.tar"
    subprocess.run(["tar", "--create", "--file", str(archive), "--directory", str(ROOT), "--sort=name",
                    *[f"--exclude={pattern}" for pattern in exclude], *items], check=True)
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert "dflash/training/trainer.py" in names and "dflash/cli.py" in names
    assert not [n for n in names if n == "dflash/ops" or n.startswith("dflash/ops/")]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A wheel built from the repository, installed without dependencies into a fresh venv outside the checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Build directories outside the checkout (setuptools reads this extra config).
    (tmp / "setup.cfg").write_text(f"[build]\nbuild_base = {tmp / 'build'}\n[egg_info]\negg_base = {tmp}\n")
    env = {**os.environ, "DIST_EXTRA_CONFIG": str(tmp / "setup.cfg")}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "dist"), str(ROOT)], check=True, env=env, timeout=900)
    (wheel,) = (tmp / "dist").glob("dflash_trainer-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=600)
    python = venv / "bin" / "python"
    clean = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # else pip sees a dflash there
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, timeout=900, env=clean)
    # ansible, ansible-runner, rich and yaml from the test's own environment, after the wheel's own packages
    # (a path line, so the checkout's editable-install hook there is not run).
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return {"python": python, "site": Path(site), "tmp": tmp}


# Fails on any import of torch; prints where dflash and its playbooks came from; runs `dflash ops ARGS`.
PROBE = """
import json, sys
sys.modules["torch"] = None
import dflash
from dflash.cli import main
from dflash.ops.runner import project_dir
print(json.dumps({"dflash": dflash.__file__, "project": str(project_dir())}), file=sys.stderr)
sys.exit(main(["ops", *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_dflash_ops_runs_from_a_wheel_outside_the_checkout(installed):
    tmp, site = installed["tmp"], installed["site"]
    work = tmp / "elsewhere"
    work.mkdir()
    (work / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {"dflash_containers": {"hosts": {
        "dflash-far": {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": 1,
                       "ansible_ssh_common_args": "-o ConnectTimeout=3 -o BatchMode=yes -o StrictHostKeyChecking=no"},
    }}}}}))
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("DFLASH_", "ANSIBLE_")) and key != "PYTHONPATH"}  # the wheel's package only
    env.update(HOME=str(tmp), DFLASH_CACHE_DIR=str(tmp / "cache"),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"]))
    proc = subprocess.run([str(installed["python"]), "-c", PROBE, "status", "-i", "hosts.yml", "--json"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=900)
    where = json.loads(proc.stderr.splitlines()[0])
    assert Path(where["dflash"]).is_relative_to(site) and Path(where["project"]) == site / "dflash" / "ops" / "project"
    result = json.loads(proc.stdout)
    # The packaged status.yml ran (its roles and modules came along): the host was tried and is unreachable.
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert result["playbook"] == "playbooks/status.yml" and result["containers"]["dflash-far"]["state"] == "unreachable"
    for path in ("playbooks/train.yml", "roles/job/meta/argument_specs.yml", "library/dflash_unit.py",
                 "module_utils/dflash_supervisor.py", "connection_plugins/dflash_lxc.py", "configs/tiny-cpu.yaml",
                 "playbooks/action_plugins/dflash_wait.py"):
        assert (site / "dflash" / "ops" / "project" / path).is_file(), path


@pytest.mark.slow
def test_a_deploy_from_the_wheel_packs_the_installed_trainer(installed):
    """What the job role packs when dflash ops runs from the wheel: the installed package without dflash/ops,
    the wheel's configs/ and pyproject.toml."""
    into = installed["tmp"] / "sources"
    probe = ("import sys; from pathlib import Path; from dflash.ops.runner import project_dir, source_tree; "
             "print(source_tree(project_dir(), Path(sys.argv[1])))")
    env = {key: value for key, value in os.environ.items() if not key.startswith("DFLASH_") and key != "PYTHONPATH"}
    out = subprocess.run([str(installed["python"]), "-c", probe, str(into)], cwd=installed["tmp"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert Path(out) == into
    for item in ("dflash/training/trainer.py", "dflash/cli.py", "configs/tiny-cpu.yaml", "pyproject.toml"):
        assert (into / item).is_file(), item
    assert not (into / "dflash" / "ops").exists()
    assert (into / "dflash" / "training" / "trainer.py").read_text() == (PACKAGE / "training" / "trainer.py").read_text()
