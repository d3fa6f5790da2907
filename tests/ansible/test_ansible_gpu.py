"""nvidia-smi parsing: a captured H200, [N/A]/[Not Supported] cells, MIG rows, failures."""

from __future__ import annotations

import pytest
from ansible.module_utils.dflash_gpu import (
    GpuQueryError,
    classify_failure,
    format_gpu_table,
    gpus_above,
    gpus_below,
    missing_gpu_ids,
    parse_gpu_csv,
    parse_process_csv,
    query_gpus,
)
from conftest import FIXTURES

SMI = FIXTURES / "nvidia_smi"
H200_UUID = "GPU-c759e63c-29f0-7cc5-2732-e587923e50c9"


def test_captured_h200_idle():
    (gpu,) = parse_gpu_csv((SMI / "h200_query_gpu_idle.csv").read_text())
    assert gpu == {
        "index": 0,
        "uuid": H200_UUID,
        "name": "NVIDIA H200",
        "driver_version": "580.159.04",
        "memory_total_mib": 143771,
        "memory_used_mib": 0,
        "utilization_pct": 0,
        "mig_mode": "Disabled",
        "mig_enabled": False,
    }
    assert parse_process_csv((SMI / "h200_query_apps_idle.csv").read_text()) == []


def test_captured_h200_busy_links_processes_to_gpus():
    gpus = parse_gpu_csv((SMI / "h200_query_gpu_busy.csv").read_text())
    procs = parse_process_csv((SMI / "h200_query_apps_busy.csv").read_text(), gpus)
    assert gpus[0]["memory_used_mib"] == 2435
    assert procs == [{"gpu_uuid": H200_UUID, "gpu_index": 0, "pid": 429, "process_name": "python3", "used_memory_mib": 2426}]
    table = format_gpu_table(gpus, procs)
    assert "NVIDIA H200" in table and "2435/143771" in table and "429 python3 2426MiB" in table


EIGHT_GPUS = "\n".join(
    f"{i}, GPU-0000000{i}-aaaa-bbbb-cccc-ddddeeeeffff, NVIDIA H200, 580.159.03, 143771, {used}, {util}, Disabled"
    for i, used, util in [(0, 70000, 98), (1, 70010, 97), (2, 69990, 99), (3, 70000, 95), (4, 70020, 96), (5, 20000, 80), (6, 0, 0), (7, 1, 0)]
)


def test_eight_gpus_thresholds_and_missing_ids():
    gpus = parse_gpu_csv(EIGHT_GPUS + "\n")
    assert [g["index"] for g in gpus] == list(range(8))
    assert gpus_below(gpus, [0, 1, 5, 6, 7], 8192) == [(6, 0), (7, 1)]
    assert gpus_above(gpus, [5, 6, 7], 1024) == [(5, 20000)]
    assert missing_gpu_ids(gpus, [0, 8, 9]) == [8, 9]


def test_na_and_not_supported_become_none():
    text = "0, GPU-x, NVIDIA A100-SXM4-80GB, 550.54.15, [N/A], [N/A], [Not Supported], [N/A]\n"
    (gpu,) = parse_gpu_csv(text)
    assert gpu["memory_total_mib"] is None and gpu["memory_used_mib"] is None
    assert gpu["utilization_pct"] is None and gpu["mig_mode"] is None and gpu["mig_enabled"] is False
    # Unknown used memory never counts as loaded.
    assert gpus_below([gpu], [0], 1) == [(0, None)]
    assert gpus_above([gpu], [0], 1) == []


def test_mig_rows():
    gpus = parse_gpu_csv(
        "0, GPU-aaaa, NVIDIA A100-SXM4-80GB, 550.54.15, 81920, 20131, [N/A], Enabled\n"
        "1, GPU-bbbb, NVIDIA A100-SXM4-80GB, 550.54.15, 81920, 0, 0, Disabled\n"
    )
    assert gpus[0]["mig_enabled"] and gpus[0]["utilization_pct"] is None and gpus[0]["memory_used_mib"] == 20131
    assert not gpus[1]["mig_enabled"]
    # In MIG mode compute apps are listed against MIG-instance UUIDs and without memory.
    procs = parse_process_csv("MIG-11111111-2222-3333-4444-555555555555, 4242, python, [N/A]\n", gpus)
    assert procs == [
        {"gpu_uuid": "MIG-11111111-2222-3333-4444-555555555555", "gpu_index": None, "pid": 4242, "process_name": "python", "used_memory_mib": None}
    ]
    assert "Enabled" in format_gpu_table(gpus, procs)


def test_process_name_with_commas():
    (proc,) = parse_process_csv("GPU-x, 7, /usr/bin/python3 -c a,b, 100\n")
    assert proc["process_name"] == "/usr/bin/python3 -c a,b" and proc["used_memory_mib"] == 100


def test_garbage_line_is_a_parse_error():
    with pytest.raises(GpuQueryError) as err:
        parse_gpu_csv("0, GPU-x, NVIDIA H200\n")
    assert err.value.kind == "parse" and "expected 8" in str(err.value) and "line 1" in str(err.value)


@pytest.mark.parametrize(
    ("rc", "out", "kind", "needle"),
    [
        (18, "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.95\n", "driver_mismatch", "reboot or reload"),
        (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
            "NVIDIA driver is installed and running.\n", "no_driver", "/dev/nvidia*"),
        (6, (SMI / "h200_bad_index_rc6.txt").read_text(), "no_devices", "found no GPUs"),
        (2, (SMI / "h200_bad_field_rc2.txt").read_text(), "failed", "exit status 2"),
    ],
)
def test_failures_are_classified_with_a_fix(rc, out, kind, needle):
    err = classify_failure(rc, out, "")
    assert err.kind == kind
    assert needle in str(err)


def test_query_runs_both_queries_as_argument_lists(fake_host):
    host = fake_host(
        {
            "--query-gpu": (0, (SMI / "h200_query_gpu_busy.csv").read_text(), ""),
            "--query-compute-apps": (0, (SMI / "h200_query_apps_busy.csv").read_text(), ""),
        }
    )
    gpus, procs = query_gpus(host)
    assert host.calls[0][0] == "/usr/bin/nvidia-smi"
    assert host.calls[0][1].startswith("--query-gpu=index,uuid,name,driver_version,memory.total,memory.used")
    assert host.calls[0][2] == "--format=csv,noheader,nounits"
    assert procs[0]["gpu_index"] == 0 and gpus[0]["memory_used_mib"] == 2435


def test_query_without_nvidia_smi(fake_host):
    with pytest.raises(GpuQueryError) as err:
        query_gpus(fake_host(which={}))
    assert err.value.kind == "missing" and "nvidia-smi not found" in str(err.value)


def test_query_driver_mismatch(fake_host):
    host = fake_host({"--query-gpu": (18, "Failed to initialize NVML: Driver/library version mismatch\n", "")})
    with pytest.raises(GpuQueryError) as err:
        query_gpus(host)
    assert err.value.kind == "driver_mismatch"
