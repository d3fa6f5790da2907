"""The kernels role's install path on a CPU machine: a fake CUDA torch in a scratch venv.

The real build needs a GPU node (docs/operations.md); what runs here is everything
around it: the probe, the cache key, installing a cached or supplied wheel, recording
the key, and doing nothing on the second run.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .conftest import ROOT, load_plugin

ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ANSIBLE_PLAYBOOK.exists(), reason="ansible-playbook is not in the venv (make venv)"),
]

PROBE = {"torch": "2.11.0+cu130", "cuda": "13.0", "capabilities": [[9, 0], [9, 0]]}
KEY = load_plugin("kernels", "dflash_kernels").causal_conv1d_cache_key(PROBE, "1.7.0")

FAKE_TORCH = f'''"""A stand-in for a CUDA build of torch: just what the kernels role's probe reads."""
__version__ = {PROBE["torch"]!r}


class version:
    cuda = {PROBE["cuda"]!r}


class cuda:
    @staticmethod
    def device_count():
        return 2

    @staticmethod
    def get_device_capability(index):
        return (9, 0)
'''


def make_wheel(directory: Path, version: str = "1.7.0") -> Path:
    """A minimal pure-Python wheel named like a built causal-conv1d."""
    dist = f"causal_conv1d-{version}.dist-info"
    files = {
        "causal_conv1d/__init__.py": b"FAKE_BUILD = True\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: causal-conv1d\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: dflash-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"causal_conv1d-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
        whl.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture(scope="module")
def scratch_venv(tmp_path_factory):
    venv = tmp_path_factory.mktemp("kernels") / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(FAKE_TORCH)
    # The role points pip at the venv's own pip.conf (the venv role writes it); offline here.
    (venv / "pip.conf").write_text("[global]\nno-index = true\ndisable-pip-version-check = true\n")
    return venv


def run_role(tmp_path: Path, venv: Path, cache: Path, **extra) -> subprocess.CompletedProcess:
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        "- name: Kernels on a fake GPU venv\n"
        "  hosts: localhost\n"
        "  connection: local\n"
        "  gather_facts: false\n"
        "  roles:\n"
        "    - role: kernels\n"
    )
    variables = {
        "ansible_python_interpreter": sys.executable,
        "dflash_kernels_gpus": [0, 1],
        "dflash_kernels_venv_path": str(venv),
        "dflash_kernels_cache_dir": str(cache),
        "dflash_kernels_doctor_code_dir": str(tmp_path / "no-code-yet"),
        # A hybrid target (causal-conv1d): the cases below are about its build; a dense one needs none.
        "dflash_kernels_target_model_type": "qwen3_5_text",
        **extra,
    }
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_ROLES_PATH": str(ROOT / "roles"),
        "ANSIBLE_NOCOLOR": "1",
    }
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", "localhost,", str(playbook), "--skip-tags", "dflash_kernels_fla",
         "-e", json.dumps(variables)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def recap_changed(output: str) -> int:
    line = next(line for line in output.splitlines() if line.startswith("localhost") and "changed=" in line)
    return int(line.split("changed=")[1].split()[0])


def installed(venv: Path) -> bool:
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import causal_conv1d; print(causal_conv1d.FAKE_BUILD)"],
                           capture_output=True, text=True)  # fmt: skip
    return probe.stdout.strip() == "True"


def test_cached_wheel_is_installed_then_nothing_changes(tmp_path, scratch_venv):
    cache = tmp_path / "cache"
    make_wheel(cache / KEY)
    first = run_role(tmp_path, scratch_venv, cache)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"causal-conv1d wheel cache key: {KEY}" in first.stdout
    assert installed(scratch_venv)
    assert (scratch_venv / ".dflash-causal-conv1d-key").read_text().strip() == KEY
    assert "Build the wheel" in first.stdout and not (cache / f"{KEY}.partial").exists()
    assert "fast-path check deferred" in first.stdout

    second = run_role(tmp_path, scratch_venv, cache)
    assert second.returncode == 0, second.stdout + second.stderr
    assert recap_changed(second.stdout) == 0, second.stdout


def test_supplied_wheel_goes_into_the_node_cache(tmp_path, scratch_venv):
    (scratch_venv / ".dflash-causal-conv1d-key").unlink(missing_ok=True)
    cache = tmp_path / "cache"
    supplied = make_wheel(tmp_path / "supplied")
    result = run_role(tmp_path, scratch_venv, cache, dflash_kernels_causal_conv1d_wheel=str(supplied))
    assert result.returncode == 0, result.stdout + result.stderr
    assert (cache / KEY / supplied.name).is_file()
    assert installed(scratch_venv)
    assert (scratch_venv / ".dflash-causal-conv1d-key").read_text().strip() == KEY


def test_no_gpus_skips_with_a_message(tmp_path, scratch_venv):
    result = run_role(tmp_path, scratch_venv, tmp_path / "cache", dflash_kernels_gpus=[])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kernels: skipped on localhost: the job uses no GPUs" in result.stdout
    assert recap_changed(result.stdout) == 0


def test_slow_path_fails_the_role_with_the_doctors_message(tmp_path, scratch_venv):
    cache = tmp_path / "cache"
    make_wheel(cache / KEY)
    code = tmp_path / "release"
    (code / "dflash").mkdir(parents=True)
    (code / "dflash" / "__init__.py").write_text("")
    # A stand-in for `dflash doctor` on a node whose kernels fall back to PyTorch.
    (code / "dflash" / "__main__.py").write_text(
        "import sys\n"
        "assert sys.argv[1:] == ['doctor', '--require-fast-path'], sys.argv\n"
        "sys.exit('dflash: error: the hybrid-target fast path is not available')\n"
    )
    result = run_role(tmp_path, scratch_venv, cache, dflash_kernels_doctor_code_dir=str(code))
    assert result.returncode != 0
    assert "the hybrid-target fast path is not available" in result.stdout
