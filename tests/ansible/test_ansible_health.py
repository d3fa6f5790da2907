"""Health invariants and diagnosis on real files: advancing, stalled, missing log, dead unit, finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from ansible.module_utils.dflash_health import HealthTracker, check_health
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_unit import DaemonBackend
from test_ansible_unit_daemon import wait_for

ACTIVE = {"load_state": "loaded", "active_state": "active", "sub_state": "running", "main_pid": os.getpid(),
          "exit_status": None, "result": None, "backend": "daemon"}  # fmt: skip


def write_heartbeat(path, step, status="training", pid=None, age=0.0, **extra):
    data = {"step": step, "epoch": 0, "time": time.time() - age, "pid": pid or os.getpid(), "status": status,
            "loss": 3.21, "tau": 1.05, "tokens_per_s": 1234.0, **extra}  # fmt: skip
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(data, handle)
    os.replace(tmp, path)


def params(tmp_path, **kw):
    return {"name": "job", "log_path": str(tmp_path / "job.log"), "heartbeat_path": str(tmp_path / "heartbeat.json"),
            "gpu_ids": [], "gpu_min_memory_mib": 1024, "timeout": 5, "progress_window": 1, "poll_interval": 0.05,
            "log_lines": 5, **kw}  # fmt: skip


class Trainer(threading.Thread):
    """Writes log lines and heartbeats like the real trainer, until stopped."""

    def __init__(self, tmp_path, start_step=0):
        super().__init__(daemon=True)
        self.tmp_path, self.step, self.running = tmp_path, start_step, True

    def run(self):
        while self.running:
            self.step += 1
            with open(self.tmp_path / "job.log", "a") as log:
                log.write(f"step {self.step} epoch 0 loss 3.2100 acc@1 0.120 tau 1.05 tok/s 1234 lr 6.00e-04 mem 0.10GiB\n")
            write_heartbeat(self.tmp_path / "heartbeat.json", self.step)
            time.sleep(0.05)


def test_advancing_trainer_is_healthy(tmp_path):
    trainer = Trainer(tmp_path)
    trainer.start()
    try:
        result = check_health(LocalHost(), params(tmp_path), lambda: dict(ACTIVE))
    finally:
        trainer.running = False
    assert result["healthy"] and result["failed_invariants"] == [] and not result["finished"]
    assert result["step"] >= 1 and result["tokens_per_s"] == 1234.0 and result["tau"] == 1.05
    assert result["log_tail"][-1].startswith("step ") and len(result["log_tail"]) <= 5
    assert "is healthy" in result["diagnosis"]


def test_stalled_heartbeat_is_diagnosed(tmp_path):
    (tmp_path / "job.log").write_text("step 12 epoch 0 loss 3.2100\n")
    os.utime(tmp_path / "job.log", (time.time() - 100, time.time() - 100))
    write_heartbeat(tmp_path / "heartbeat.json", 12, age=60)
    started = time.monotonic()
    result = check_health(LocalHost(), params(tmp_path, progress_window=1), lambda: dict(ACTIVE))
    assert time.monotonic() - started < 2.5  # a stall longer than the window is final at once
    assert not result["healthy"] and set(result["failed_invariants"]) == {"log", "progress"}
    reasons = {f["invariant"]: f["reason"] for f in result["failures"]}
    assert reasons["progress"] == "no progress: heartbeat step stayed at 12 for 60s"
    assert "did not grow" in reasons["log"]
    assert "NOT healthy" in result["diagnosis"] and "progress: no progress: heartbeat step stayed at 12" in result["diagnosis"]
    assert "  | step 12 epoch 0 loss 3.2100" in result["diagnosis"]


def test_fresh_heartbeat_that_stops_advancing_fails_after_the_window(tmp_path):
    (tmp_path / "job.log").write_text("step 7\n")
    write_heartbeat(tmp_path / "heartbeat.json", 7)
    started = time.monotonic()
    result = check_health(LocalHost(), params(tmp_path, progress_window=1, timeout=4), lambda: dict(ACTIVE))
    # Healthy at first (the heartbeat is fresh), so it is reported healthy: a snapshot, not a watch.
    assert result["healthy"]
    tracker = HealthTracker(params(tmp_path, progress_window=1))
    obs = {"wall": time.time() + 1.5, "log_exists": True, "log_size": 7, "log_mtime": time.time() + 1.5, "unit": {**ACTIVE, "main_pid_alive": True},
           "heartbeat": json.loads((tmp_path / "heartbeat.json").read_text()), "heartbeat_error": None, "heartbeat_pid_alive": True,
           "gpus": [], "gpu_processes": [], "gpu_error": None, "gpu_error_kind": None}  # fmt: skip
    assert tracker.update(obs, now=0.0) == [{"invariant": "progress", "reason": "no progress: heartbeat step stayed at 7 for 2s", "final": True}]
    assert time.monotonic() - started < 3


def test_missing_log_and_heartbeat(tmp_path):
    result = check_health(LocalHost(), params(tmp_path, progress_window=1, timeout=3), lambda: dict(ACTIVE))
    assert set(result["failed_invariants"]) == {"log", "progress"}
    assert f"log file {tmp_path / 'job.log'} does not exist" in result["diagnosis"]
    assert f"no heartbeat: heartbeat file {tmp_path / 'heartbeat.json'} does not exist" in result["diagnosis"]
    assert f"log {tmp_path / 'job.log'}: missing" in result["diagnosis"]
    assert 0.9 <= result["elapsed_s"] < 3  # failing for a whole window is final


def test_dead_unit_shows_the_trainers_error(tmp_path):
    backend = DaemonBackend(LocalHost())
    spec = {"name": "dead", "command": ["sh", "-c", "echo 'Traceback...' ; echo 'dflash: error: data.train_path /data/x.jsonl does not exist; "
            "fix data.train_path' >&2; exit 2"], "log_path": str(tmp_path / "job.log"), "state_dir": str(tmp_path / "state"),
            "working_directory": str(tmp_path)}  # fmt: skip
    backend.start(spec)
    wait_for(lambda: backend.status(spec)["active_state"] == "failed")
    started = time.monotonic()
    result = check_health(LocalHost(), params(tmp_path, progress_window=30, timeout=30), lambda: {**backend.status(spec), "backend": "daemon"})
    assert time.monotonic() - started < 2  # a dead unit is final: no waiting for the timeout
    assert "unit" in result["failed_invariants"]
    assert result["unit"]["exit_status"] == 2
    text = result["diagnosis"]
    assert "  - unit: unit failed: exit status 2" in text
    assert "unit: backend=daemon active_state=failed sub_state=failed main_pid=- exit_status=2" in text
    assert "  | dflash: error: data.train_path /data/x.jsonl does not exist; fix data.train_path" in text


def test_heartbeat_of_a_dead_trainer_is_not_progress(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead_pid = int(proc.stdout)
    (tmp_path / "job.log").write_text("x\n")
    write_heartbeat(tmp_path / "heartbeat.json", 500, pid=dead_pid)  # left over from the previous run
    result = check_health(LocalHost(), params(tmp_path, progress_window=1, timeout=2), lambda: dict(ACTIVE))
    reasons = {f["invariant"]: f["reason"] for f in result["failures"]}
    assert f"trainer pid {dead_pid} is not running" in reasons["progress"]


def test_finished_job_is_healthy(tmp_path):
    (tmp_path / "job.log").write_text("done\n")
    write_heartbeat(tmp_path / "heartbeat.json", 100, status="finished", age=3600)
    inactive = {**ACTIVE, "active_state": "inactive", "sub_state": "dead", "main_pid": None, "exit_status": 0}
    result = check_health(LocalHost(), params(tmp_path), lambda: dict(inactive))
    assert result["healthy"] and result["finished"] and "(finished)" in result["diagnosis"]
    assert result["acceptance_length"] is None and "last eval" not in result["diagnosis"]


def test_last_eval_reports_the_real_acceptance_length_beside_the_simulated_tau(tmp_path):
    (tmp_path / "job.log").write_text("done\n")
    write_heartbeat(tmp_path / "heartbeat.json", 100, status="finished", age=10, eval_step=100, eval_tau=6.7,
                    eval_acceptance_length=1.25)
    inactive = {**ACTIVE, "active_state": "inactive", "sub_state": "dead", "main_pid": None, "exit_status": 0}
    result = check_health(LocalHost(), params(tmp_path), lambda: dict(inactive))
    assert result["acceptance_length"] == 1.25 and result["eval_tau"] == 6.7
    assert "last eval (step 100): simulated tau=6.7 real acceptance length=1.25" in result["diagnosis"]


def test_trainer_reported_failure(tmp_path):
    (tmp_path / "job.log").write_text("x\n")
    write_heartbeat(tmp_path / "heartbeat.json", 3, status="failed")
    result = check_health(LocalHost(), params(tmp_path, progress_window=30, timeout=30), lambda: dict(ACTIVE))
    assert result["failures"] == [{"invariant": "progress", "reason": "trainer reported status 'failed' at step 3"}]
    assert result["elapsed_s"] < 2


GPU_CSV = "0, GPU-0, NVIDIA H200, 580.159.04, 143771, {0}, 90, Disabled\n1, GPU-1, NVIDIA H200, 580.159.04, 143771, {1}, 0, Disabled\n"


def test_gpu_below_threshold_with_table(tmp_path, fake_host):
    trainer = Trainer(tmp_path)
    trainer.start()
    try:
        host = fake_host({"--query-gpu": (0, GPU_CSV.format(70000, 3), ""), "--query-compute-apps": (0, "GPU-0, 4242, python, 69000\n", "")})
        host.now, host.sleep = time.monotonic, time.sleep  # the trainer thread runs in real time
        result = check_health(host, params(tmp_path, gpu_ids=[0, 1], gpu_min_memory_mib=8192, progress_window=2, timeout=5, poll_interval=0.1),
                              lambda: dict(ACTIVE))  # fmt: skip
    finally:
        trainer.running = False
    assert result["failed_invariants"] == ["gpu"]
    assert result["failures"][0]["reason"] == "GPU memory below 8192 MiB (model not loaded?): GPU 1: 3 MiB"
    assert "70000/143771" in result["diagnosis"] and "4242 python 69000MiB" in result["diagnosis"]


def test_gpu_missing_nvidia_smi_or_absent_gpu_is_final(tmp_path, fake_host):
    (tmp_path / "job.log").write_text("x\n")
    write_heartbeat(tmp_path / "heartbeat.json", 5)
    result = check_health(fake_host(which={}), params(tmp_path, gpu_ids=[0], timeout=60), lambda: dict(ACTIVE))
    assert result["failed_invariants"] == ["gpu"] and "nvidia-smi not found" in result["diagnosis"]
    host = fake_host({"--query-gpu": (0, GPU_CSV.format(70000, 70000), "")})
    result = check_health(host, params(tmp_path, gpu_ids=[0, 5], timeout=60), lambda: dict(ACTIVE))
    assert result["failures"][0]["reason"] == "GPU(s) [5] not visible to nvidia-smi (visible: [0, 1])"


@pytest.mark.parametrize("timeout", [0])
def test_zero_timeout_is_one_snapshot(tmp_path, timeout):
    started = time.monotonic()
    result = check_health(LocalHost(), params(tmp_path, timeout=timeout), lambda: dict(ACTIVE))
    assert time.monotonic() - started < 1 and not result["healthy"]
