"""scripts/cpu-report.py: make test's account of CPU time, per container and on the host."""

from __future__ import annotations

import importlib.util

from conftest import ROOT

spec = importlib.util.spec_from_file_location("cpu_report", ROOT / "scripts" / "cpu-report.py")
cpu_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_report)


def test_a_restarted_container_counts_each_life_and_the_host_gets_the_rest():
    lines = [
        "100 1000.0",
        "115 1030.0 a=5.0",
        "130 1060.0 a=20.0 b=3.0",
        "145 1090.0 a=2.0 b=9.0",  # a restarted: its counter began again at 0
        "160 1120.0 a=8.0",  # b is gone: it counted 9 s
    ]
    text = cpu_report.report(lines)
    # machine 120 s busy; a: 20 + 8 = 28 s, b: 9 s; host 120 - 37 = 83 s
    assert text.splitlines()[0] == ("CPU time used while testing: 2.0 core-min; in containers 0.6, "
                                    "on the host (pytest, ansible, molecule) 1.4")  # fmt: skip
    assert text.splitlines()[1].split() == ["a", "0.5", "core-min"]
    assert text.splitlines()[2].split() == ["b", "0.1", "core-min"]


def test_no_samples_says_so():
    assert cpu_report.report([]) == "cpu: no samples"
