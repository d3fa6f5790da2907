"""Smoke test of the unit/health/GPU logic on a real GPU host without systemd (the daemon backend).

Run on the GPU machine (needs torch with CUDA and nvidia-smi; Ansible need not be installed):

    python tests/ansible/device_gpu_smoke.py [OUT_DIR]

A stand-in trainer holds 8 GiB on GPU 0 and writes heartbeats. The script checks: backend
auto-detection picks `daemon`; launch; health with the GPU invariant; a second `started` is a
no-op; a config change restarts through the GPU release wait; an impossible memory threshold
fails with a diagnosis and a GPU table; stop releases the GPU. Prints a JSON report.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import ansible.module_utils as module_utils
except ImportError:  # the GPU machine has no Ansible: provide the namespace only
    sys.modules["ansible"] = types.ModuleType("ansible")
    sys.modules["ansible"].__path__ = []
    module_utils = sys.modules["ansible.module_utils"] = types.ModuleType("ansible.module_utils")
    module_utils.__path__ = []
module_utils.__path__.append(os.path.join(ROOT, "module_utils"))

from ansible.module_utils.dflash_gpu import format_gpu_table, query_gpus  # noqa: E402
from ansible.module_utils.dflash_health import check_health  # noqa: E402
from ansible.module_utils.dflash_host import LocalHost  # noqa: E402
from ansible.module_utils.dflash_unit import ensure, resolve_backend  # noqa: E402
from ansible.module_utils.dflash_unit_daemon import DaemonBackend  # noqa: E402

TRAINER = """
import json, os, signal, sys, time
import torch
held = torch.empty(8 << 30, dtype=torch.uint8, device=os.environ.get("DFLASH_SMOKE_DEVICE", "cuda:0"))
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
out = sys.argv[1]
step = 0
while True:
    step += 1
    print(f"step {step} tok/s 1000 held {held.numel() / 2**30:.2f}GiB", flush=True)
    with open(out + "/heartbeat.tmp", "w") as f:
        json.dump({"step": step, "epoch": 0, "time": time.time(), "pid": os.getpid(), "status": "training",
                   "loss": 1.0, "tau": 2.0, "tokens_per_s": 1000.0}, f)
    os.replace(out + "/heartbeat.tmp", out + "/heartbeat.json")
    time.sleep(0.5)
"""


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    work = tempfile.mkdtemp(prefix="dflash-smoke-")
    os.makedirs(os.path.join(work, "run"))
    # The trainer's kernel cache in the working directory must survive the restart.
    kernel = os.path.join(work, "compile-cache", "torch-x", "inductor", "entry")
    os.makedirs(os.path.dirname(kernel))
    with open(kernel, "w") as f:
        f.write("warm\n")
    host = LocalHost()
    report = {"backend": resolve_backend("auto")}
    backend = DaemonBackend(host)
    spec = {"name": "smoke", "command": [sys.executable, "-c", TRAINER, os.path.join(work, "run")],
            "log_path": os.path.join(work, "job.log"), "state_dir": os.path.join(work, "state"), "working_directory": work,
            "stop_timeout": 30, "gpu_ids": [0], "gpu_release_timeout": 60, "gpu_release_threshold_mib": 1024,
            "config_hash": "h1", "settle_time": 1,
            "environment": {"DFLASH_SMOKE_DEVICE": os.environ.get("DFLASH_SMOKE_DEVICE", "cuda:0")}}  # fmt: skip
    health = {"name": "smoke", "log_path": spec["log_path"], "heartbeat_path": os.path.join(work, "run", "heartbeat.json"),
              "gpu_ids": [0], "gpu_min_memory_mib": 4096, "timeout": 120, "progress_window": 60, "poll_interval": 1, "log_lines": 5}  # fmt: skip

    def probe():
        return {**backend.status(spec), "backend": "daemon"}

    try:
        report["start"] = ensure(spec, "started", backend, host)
        report["health"] = check_health(host, health, probe)
        report["again"] = ensure(spec, "started", backend, host)
        report["restart"] = ensure({**spec, "config_hash": "h2"}, "started", backend, host)
        report["health_after_restart"] = check_health(host, health, probe)
        report["health_impossible"] = check_health(host, {**health, "gpu_min_memory_mib": 10**7, "timeout": 5, "progress_window": 3}, probe)
        report["stop"] = ensure({**spec, "config_hash": "h2"}, "stopped", backend, host)
        gpus, procs = query_gpus(host)
        report["gpu_table_after_stop"] = format_gpu_table(gpus, procs)
    finally:
        backend.stop({**spec, "stop_timeout": 5})
    summary = {
        "backend": report["backend"],
        "start": report["start"]["action"],
        "healthy": report["health"]["healthy"],
        "gpu_used_mib_while_training": [g["memory_used_mib"] for g in report["health"]["gpus"]],
        "second_start": report["again"]["action"],
        "restart": report["restart"]["action"],
        "restart_gpu_release": report["restart"]["gpu_release"],
        "restart_cache_kept": os.path.isfile(kernel),
        "healthy_after_restart": report["health_after_restart"]["healthy"],
        "impossible_threshold": report["health_impossible"]["failures"],
        "stop": report["stop"]["action"],
        "stop_exit_status": report["stop"]["exit_status"],
        "stop_gpu_release": report["stop"]["gpu_release"],
    }
    print(json.dumps(summary, indent=1))
    print(report["health"]["diagnosis"])
    print(report["health_impossible"]["diagnosis"])
    print(report["gpu_table_after_stop"])
    with open(os.path.join(out_dir, "gpu_smoke.json"), "w") as handle:
        json.dump(report, handle, indent=1, default=str)
    ok = (summary["backend"] == "daemon" and summary["start"] == "started" and summary["healthy"]
          and summary["second_start"] == "none" and summary["restart"] == "restarted" and summary["restart_gpu_release"]["released"]
          and summary["healthy_after_restart"] and summary["impossible_threshold"] and summary["stop"] == "stopped"
          and summary["stop_gpu_release"]["released"])  # fmt: skip
    print("SMOKE OK" if ok else "SMOKE FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
