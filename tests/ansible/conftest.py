"""Make the repository's module_utils importable as ``ansible.module_utils.dflash_*``,
exactly as Ansible ships them to a managed host, so their logic is tested without a playbook."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import ansible.module_utils
import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
BIN = Path(sys.executable).parent

if str(ROOT / "module_utils") not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(str(ROOT / "module_utils"))


def wait_for(predicate, timeout: float = 300.0, interval: float = 0.05):
    """predicate()'s first truthy value within `timeout` seconds (its last value otherwise)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def tool(name: str) -> str:
    """A tool of the project venv (installed by `make test` from the ops/dev extras)."""
    candidate = BIN / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found next to {sys.executable} nor in PATH: run `make venv` (extras ops,dev)")
    return found


@pytest.fixture
def ansible_env():
    """Environment for ansible CLI calls from the repository root (its ansible.cfg)."""
    env = dict(os.environ)
    env.update(
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_LOCAL_TEMP=env.get("TMPDIR", "/tmp") + "/ansible-local-dflash-tests",
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


class FakeHost:
    """A host whose commands answer from a table; time passes only when the code sleeps."""

    def __init__(self, answers=None, which=None):
        self.answers = answers or {}
        self.calls = []
        self.clock = 0.0
        self.written = {}
        self._which = which if which is not None else {"nvidia-smi": "/usr/bin/nvidia-smi"}

    def run(self, args, check_rc=False):
        self.calls.append(list(args))
        for key, answer in self.answers.items():
            if key in " ".join(args):
                return answer(self) if callable(answer) else answer
        return 0, "", ""

    def which(self, name, extra_dirs=()):
        return self._which.get(name)

    def atomic_write(self, path, data, mode=0o644):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Path(path).write_text(data)
        self.written[path] = data

    def sleep(self, seconds):
        self.clock += seconds

    def now(self):
        return self.clock

    def warn(self, message):
        pass


@pytest.fixture
def fake_host():
    return FakeHost


@pytest.fixture(autouse=True)
def systemd_dirs(tmp_path_factory, monkeypatch):
    """Where the systemd backend writes its units, drop-ins and boot markers (and reads transient units) in a test:
    never the host's /etc/systemd/system, /run/systemd/system, /run/dflash-units or /run/systemd/transient."""
    from ansible.module_utils.dflash_unit_systemd import SystemdBackend

    root = tmp_path_factory.mktemp("systemd")
    dirs = {"runtime_unit_dir": root / "run-systemd-system", "boot_unit_dir": root / "etc-systemd-system",
            "marker_dir": root / "run-dflash-units", "transient_dir": root / "run-systemd-transient"}
    for attribute, path in dirs.items():
        monkeypatch.setattr(SystemdBackend, attribute, str(path))
    return dirs
