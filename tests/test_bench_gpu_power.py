"""bench/gpu_power.py and the energy figures of bench/e2e_profile.py, against a stand-in nvidia-smi (the real one
runs on the GPU machine: docs/PERFORMANCE.md)."""

import os
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from e2e_profile import energy  # noqa: E402
from gpu_power import GpuSampler  # noqa: E402

FAKE_SMI = """#!/bin/sh
case "$1" in
  *power.limit*) echo "700.00, 1980" ;;
  *clocks_event_reasons*) [ -n "$NO_REASONS" ] && exit 6; echo "1410, 695.20, 61, 0x0000000000000004" ;;
  *) echo "1410, 695.20, 61" ;;
esac
"""


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    return monkeypatch


def sampled() -> tuple[GpuSampler, dict]:
    sampler = GpuSampler()
    t0 = time.time()
    deadline = t0 + 30
    while len(sampler.samples) < 2 and time.time() < deadline:  # polls with a deadline: no fixed wait
        time.sleep(0.05)
    window = sampler.window(t0 - 1, time.time())
    sampler.stop()
    return sampler, window


def test_the_sampler_reads_power_clock_and_reasons(fake_smi):
    sampler, window = sampled()
    assert sampler.limits == {"power_limit_w": 700.0, "sm_clock_max_mhz": 1980.0}
    assert window["samples"] >= 2
    assert window["power.draw"] == 695.2 and window["clocks.sm"] == 1410.0
    assert window["reasons"] == ["0x0000000000000004"]
    assert sampler.window(0, 1) == {"samples": 0}


def test_a_driver_without_clock_event_reasons_still_gives_power(fake_smi):
    fake_smi.setenv("NO_REASONS", "1")
    sampler, window = sampled()
    assert sampler.fields == GpuSampler.FIELDS[:3]
    assert window["power.draw"] == 695.2 and "reasons" not in window


def test_energy_per_sequence_and_what_the_power_limit_allows():
    got = energy({"power.draw": 700.0}, {"power_limit_w": 700.0}, 5.0)
    assert got == {"joules_per_sequence_of_3072": 140.0, "sequences_per_s_at_power_limit": 5.0}
    half = energy({"power.draw": 350.0}, {"power_limit_w": 700.0}, 5.0)
    assert half["sequences_per_s_at_power_limit"] == 10.0
    assert energy({}, {"power_limit_w": 700.0}, 5.0) == {}
    assert energy({"power.draw": 700.0}, {"power_limit_w": None}, 5.0) == {"joules_per_sequence_of_3072": 140.0}
