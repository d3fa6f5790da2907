"""`make status` and `make train` end with their tool's own exit status (GNU make alone would turn 1 into 2)."""

from __future__ import annotations

import subprocess

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
