"""`make status` and `make train` end with their tool's own exit status (GNU make alone would turn 1 into 2);
the recipes run Python allowed to write its bytecode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT


def make(goal: str, variable: str, script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", "-s", goal, f"{variable}=sh -c '{script}'"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@pytest.mark.parametrize("code", [0, 1, 2])
def test_make_status_passes_the_exit_status_through(code):
    proc = make("status", "STATUS_CMD", f"echo the report of the jobs; exit {code}")
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "the report of the jobs" in proc.stdout  # the report is on stdout, also for an unhealthy job


def test_make_status_maps_other_statuses_to_2_and_names_them():
    proc = make("status", "STATUS_CMD", "exit 5")
    assert proc.returncode == 2
    assert "dflash ops status exited 5" in proc.stderr


@pytest.mark.parametrize("code", [0, 1, 2])
def test_make_train_passes_the_exit_status_through(code):
    proc = make("train", "TRAIN_CMD", f"echo PLAY RECAP; exit {code}")
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "PLAY RECAP" in proc.stderr  # streamed while it runs
    assert ("Training runs in the LXC container" in proc.stdout) == (code == 0)


def test_make_train_config_passes_the_file_as_extra_vars_and_prints_the_phase_times(tmp_path):
    config = tmp_path / "override.yml"
    config.write_text("dflash_job_health_timeout: 300\n")
    # -n with a second goal: make prints the recipes and runs nothing (train alone runs at parse time)
    proc = subprocess.run(["make", "-n", "--no-print-directory", "train", "stop", f"CONFIG={config}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    train = [line for line in proc.stdout.splitlines() if "playbooks/train.yml" in line]
    assert len(train) == 1 and f"-e @{config}" in train[0]
    # the phase times (ROLES RECAP, PLAYBOOK RECAP) for make train only, not for stop (or the tests)
    assert "ANSIBLE_CALLBACKS_ENABLED=ansible.posix.profile_roles,ansible.posix.timer" in train[0]
    stop = [line for line in proc.stdout.splitlines() if "playbooks/stop.yml" in line]
    assert stop and "ANSIBLE_CALLBACKS_ENABLED" not in stop[0]


def test_make_train_with_a_missing_config_file_stops_at_once_naming_it(tmp_path):
    missing = tmp_path / "missing.yml"
    proc = subprocess.run(["make", "--no-print-directory", "-s", "train", f"CONFIG={missing}",
                           "TRAIN_CMD=sh -c 'echo THE PLAYBOOK RAN'"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert f"CONFIG={missing}: no such file" in proc.stderr
    assert "THE PLAYBOOK RAN" not in proc.stdout + proc.stderr and "host-setup" not in proc.stdout + proc.stderr


def test_the_phase_time_callbacks_are_installed():
    """ansible.posix comes with the `ansible` package of the venv: no galaxy download."""
    for callback in ("ansible.posix.profile_roles", "ansible.posix.timer"):
        proc = subprocess.run([str(Path(sys.executable).parent / "ansible-doc"), "-t", "callback", callback],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr


def test_a_config_in_the_environment_is_not_an_overrides_file(tmp_path):
    env = {**os.environ, "CONFIG": str(tmp_path / "missing.yml")}
    proc = subprocess.run(["make", "-n", "--no-print-directory", "train", "stop"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-e @" not in proc.stdout


def test_make_recipes_do_not_inherit_pythondontwritebytecode(tmp_path):
    """The controller venv is installed without byte-compiling (Makefile): with a shell's PYTHONDONTWRITEBYTECODE
    every test process would compile torch and transformers from source again."""
    probe = tmp_path / "probe.mk"
    probe.write_text(f"include {ROOT}/Makefile\nprobe:\n\t@echo \"[$$PYTHONDONTWRITEBYTECODE]\"\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(["make", "-s", "-f", str(probe), "probe"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_controller_venv_says_what_it_installs_before_each_silent_pip(tmp_path):
    """`pip -q` prints nothing for minutes on the first `make train`: each install step of the venv (make -n, the
    recipe as it would run) is preceded by a line naming what it installs."""
    proc = subprocess.run(["make", "-n", "-W", "pyproject.toml", ".venv/.installed"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    installs = [i for i, line in enumerate(lines) if "pip install" in line]
    assert len(installs) == 4, lines
    for n, i in enumerate(installs, 1):
        before = lines[max(0, i - 2):i]
        assert any(line.startswith("echo \"controller venv .venv [") and f"[{n}/4]" in line for line in before), (n, lines)
