"""Health invariants, the job's state and the diagnosis on real files and processes: advancing, stalled, a
heartbeat of an earlier launch, GPU memory of other processes, missing log, dead unit, stopped, finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from ansible.module_utils.dflash_health import check_health
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_unit_daemon import DaemonBackend
from test_ansible_unit_daemon import wait_for

# The unit is this test process, launched an hour ago.
ACTIVE = {"load_state": "loaded", "active_state": "active", "sub_state": "running", "main_pid": os.getpid(),
          "exit_status": None, "result": None, "backend": "daemon", "started_at": time.time() - 3600}  # fmt: skip


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
        self.tick()  # the first step is written before the check starts

    def tick(self):
        self.step += 1
        with open(self.tmp_path / "job.log", "a") as log:
            log.write(f"step {self.step} epoch 0 loss 3.2100 acc@1 0.120 tau 1.05 tok/s 1234 lr 6.00e-04 mem 0.10GiB\n")
        write_heartbeat(self.tmp_path / "heartbeat.json", self.step)

    def run(self):
        while self.running:
            time.sleep(0.05)
            self.tick()


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


def test_stalled_heartbeat_is_diagnosed(tmp_path, fake_host):
    (tmp_path / "job.log").write_text("step 12 epoch 0 loss 3.2100\n")
    os.utime(tmp_path / "job.log", (time.time() - 100, time.time() - 100))
    write_heartbeat(tmp_path / "heartbeat.json", 12, age=60)
    host = fake_host()  # a fake clock: time passes only when the check sleeps
    result = check_health(host, params(tmp_path, progress_window=1), lambda: dict(ACTIVE))
    assert host.clock == 0 and result["elapsed_s"] == 0  # a stall longer than the window is final at once
    assert not result["healthy"] and set(result["failed_invariants"]) == {"log", "progress"}
    reasons = {f["invariant"]: f["reason"] for f in result["failures"]}
    assert reasons["progress"] == "no progress: heartbeat step stayed at 12 for 60s"
    assert "last written 100s ago" in reasons["log"]
    assert "NOT healthy" in result["diagnosis"] and "progress: no progress: heartbeat step stayed at 12" in result["diagnosis"]
    assert "  | step 12 epoch 0 loss 3.2100" in result["diagnosis"]


def test_fresh_heartbeat_that_does_not_advance_is_not_progress(tmp_path, fake_host):
    """The recorded GPU deploy: a heartbeat at step 1 with the same time through the whole check is a hang."""
    (tmp_path / "job.log").write_text("step 1\n")
    write_heartbeat(tmp_path / "heartbeat.json", 1)
    # the window is on the fake clock; 30 s leaves room for a loaded machine's real delay before the first look
    # (the heartbeat's age is real time: at load 14 it once passed a 1 s window before the check began)
    result = check_health(fake_host(), params(tmp_path, progress_window=30, timeout=120, poll_interval=1),
                          lambda: dict(ACTIVE))  # fmt: skip
    assert 30 <= result["elapsed_s"] < 120  # final once it stayed a whole window, before the timeout
    assert not result["healthy"] and result["state"] == "hung" and not result["ok"]
    assert "progress" in result["failed_invariants"]
    reasons = {f["invariant"]: f["reason"] for f in result["failures"]}
    assert reasons["progress"].startswith("no progress: heartbeat step stayed at 1 for ")
    assert result["tokens_per_s"] is None  # a hung job shows no rate
    assert "restart it with -e dflash_job_state=restarted" in result["diagnosis"] and result["hint"]


def test_snapshot_reads_a_fresh_heartbeat_as_training_and_an_old_one_as_hung(tmp_path):
    (tmp_path / "job.log").write_text("step 7\n")
    write_heartbeat(tmp_path / "heartbeat.json", 7)
    result = check_health(LocalHost(), params(tmp_path, timeout=0, progress_window=30), lambda: dict(ACTIVE))
    assert result["healthy"] and result["state"] == "training" and result["tokens_per_s"] == 1234.0
    write_heartbeat(tmp_path / "heartbeat.json", 7, age=100)
    os.utime(tmp_path / "job.log", (time.time() - 100, time.time() - 100))
    result = check_health(LocalHost(), params(tmp_path, timeout=0, progress_window=30), lambda: dict(ACTIVE))
    assert result["state"] == "hung" and result["step"] == 7 and result["tokens_per_s"] is None
    reasons = {f["invariant"]: f["reason"] for f in result["failures"]}
    assert reasons["progress"] == "no progress: heartbeat step stayed at 7 for 100s"
    assert reasons["log"].startswith(f"log file {tmp_path / 'job.log'} last written 100s ago")
    assert "for 0s" not in result["diagnosis"]


def test_earlier_launchs_failed_heartbeat_does_not_fail_the_recovery(tmp_path):
    """Item 1: a crash left `status: failed` at step 6000; the relaunched trainer is training."""
    (tmp_path / "job.log").write_text("x\n")
    write_heartbeat(tmp_path / "heartbeat.json", 6000, status="failed", pid=1, age=30, error="No space left on device")
    launched = {**ACTIVE, "started_at": time.time() - 5}
    # Before the new trainer writes its own: starting, not failed.
    result = check_health(LocalHost(), params(tmp_path, timeout=0, progress_window=30), lambda: dict(launched))
    assert result["state"] == "starting" and result["ok"] and result["step"] is None
    assert "not this launch's" in result["failures"][0]["reason"] and "failed" not in result["failed_invariants"][0]
    trainer = Trainer(tmp_path, start_step=6000)
    trainer.start()
    try:
        result = check_health(LocalHost(), params(tmp_path, progress_window=5), lambda: dict(launched))
    finally:
        trainer.running = False
    assert result["healthy"] and result["state"] == "training" and result["step"] > 6000


def test_heartbeat_of_a_process_outside_the_unit_is_not_this_launchs(tmp_path):
    (tmp_path / "job.log").write_text("x\n")
    main, other = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in range(2))
    try:
        write_heartbeat(tmp_path / "heartbeat.json", 40, pid=other.pid)
        unit = {**ACTIVE, "main_pid": main.pid, "started_at": time.time() - 100}  # siblings: not the unit's
        result = check_health(LocalHost(), params(tmp_path, timeout=0, progress_window=30), lambda: dict(unit))
    finally:
        for proc in (main, other):
            proc.kill()
            proc.wait()
    assert not result["heartbeat_current"] and result["step"] is None
    assert f"its pid {other.pid} is not a process of the unit" in result["diagnosis"]


def test_heartbeat_of_a_rank_below_the_main_pid_is_this_launchs(tmp_path):
    """torchrun: the heartbeat is written by rank 0, a child of the unit's MainPID."""
    (tmp_path / "job.log").write_text("x\n")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        write_heartbeat(tmp_path / "heartbeat.json", 40, pid=child.pid)
        result = check_health(LocalHost(), params(tmp_path, timeout=0, progress_window=30), lambda: dict(ACTIVE))
    finally:
        child.kill()
        child.wait()
    assert result["heartbeat_current"] and result["state"] == "training" and child.pid in result["unit_pids"]


def test_missing_log_and_heartbeat(tmp_path, fake_host):
    launched = {**ACTIVE, "started_at": time.time()}
    result = check_health(fake_host(), params(tmp_path, progress_window=30, timeout=120, poll_interval=1),
                          lambda: dict(launched))  # fmt: skip
    assert set(result["failed_invariants"]) == {"log", "progress"}
    assert f"log file {tmp_path / 'job.log'} does not exist" in result["diagnosis"]
    assert f"no heartbeat: heartbeat file {tmp_path / 'heartbeat.json'} does not exist" in result["diagnosis"]
    assert f"log {tmp_path / 'job.log'}: missing" in result["diagnosis"]
    assert 30 <= result["elapsed_s"] < 120  # failing for a whole window is final, before the timeout (fake clock)


def test_dead_unit_shows_the_trainers_error(tmp_path, fake_host):
    backend = DaemonBackend(LocalHost())
    spec = {"name": "dead", "command": ["sh", "-c", "echo 'Traceback...' ; echo 'dflash: error: data.train_path /data/x.jsonl does not exist; "
            "fix data.train_path' >&2; exit 2"], "log_path": str(tmp_path / "job.log"), "state_dir": str(tmp_path / "state"),
            "working_directory": str(tmp_path)}  # fmt: skip
    backend.start(spec)
    wait_for(lambda: backend.status(spec)["active_state"] == "failed")
    host = fake_host()
    result = check_health(host, params(tmp_path, progress_window=30, timeout=30), lambda: {**backend.status(spec), "backend": "daemon"})
    assert host.clock == 0 and result["elapsed_s"] == 0  # a dead unit is final: no waiting for the timeout
    assert "unit" in result["failed_invariants"]
    assert result["unit"]["exit_status"] == 2
    text = result["diagnosis"]
    assert "  - unit: unit failed: exit status 2" in text
    assert "unit: backend=daemon active_state=failed sub_state=failed main_pid=- exit_status=2" in text
    assert "  | dflash: error: data.train_path /data/x.jsonl does not exist; fix data.train_path" in text


def test_heartbeat_of_a_dead_trainer_is_not_progress(tmp_path, fake_host):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead_pid = int(proc.stdout)
    (tmp_path / "job.log").write_text("x\n")
    write_heartbeat(tmp_path / "heartbeat.json", 500, pid=dead_pid)  # left over from the previous run
    result = check_health(fake_host(), params(tmp_path, progress_window=1, timeout=2), lambda: dict(ACTIVE))
    reasons = {f["invariant"]: f["reason"] for f in result["failures"]}
    assert f"its pid {dead_pid} is not a process of the unit" in reasons["progress"]
    assert result["state"] == "hung" and result["step"] is None


def _dead(exit_status, **kw):
    return {**ACTIVE, "active_state": "failed" if exit_status else "inactive", "sub_state": "dead", "main_pid": None,
            "exit_status": exit_status, "started_at": time.time() - 60, **kw}


@pytest.mark.parametrize(
    ("exit_status", "heartbeat", "state"),
    [
        (0, {"step": 52, "status": "stopped"}, "stopped"),  # SIGTERM: checkpointed and exited 0
        (None, None, "stopped"),  # never started
        (1, {"step": 6000, "status": "failed"}, "crashed"),
        (137, {"step": 300, "status": "training"}, "crashed"),
        (2, {"step": 0, "status": "failed"}, "failed-to-start"),
        (2, {"step": 6000, "status": "failed", "age": 3600}, "failed-to-start"),  # the heartbeat is an earlier launch's
        (0, {"step": 100, "status": "finished"}, "finished"),
    ],
)
def test_states_of_a_dead_unit(tmp_path, exit_status, heartbeat, state):
    (tmp_path / "job.log").write_text("x\n")
    if heartbeat:
        write_heartbeat(tmp_path / "heartbeat.json", heartbeat["step"], status=heartbeat["status"], pid=1,
                        age=heartbeat.get("age", 10))
    unit = _dead(exit_status, load_state="not-found" if exit_status is None else "loaded")
    result = check_health(LocalHost(), params(tmp_path, timeout=0, progress_window=30), lambda: dict(unit))
    assert result["state"] == state
    assert result["ok"] == (state in ("stopped", "finished"))


def test_checkpoint_is_reported_beside_a_reset_heartbeat(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-00005235\n")
    (tmp_path / "job.log").write_text("x\n")
    write_heartbeat(tmp_path / "heartbeat.json", 0, status="failed", pid=1)
    result = check_health(LocalHost(), params(tmp_path, timeout=0), lambda: dict(_dead(2)))
    assert result["checkpoint"] == "step-00005235" and result["checkpoint_step"] == 5235
    assert "checkpoint: step-00005235 (the job resumes from it)" in result["diagnosis"]


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


def test_trainer_reported_failure(tmp_path, fake_host):
    (tmp_path / "job.log").write_text("x\n")
    write_heartbeat(tmp_path / "heartbeat.json", 3, status="failed", error="No space left on device")
    host = fake_host()
    result = check_health(host, params(tmp_path, progress_window=30, timeout=30), lambda: dict(ACTIVE))
    assert result["failures"] == [{"invariant": "progress",
                                   "reason": "trainer reported status 'failed' at step 3: No space left on device"}]
    assert host.clock == 0 and result["state"] == "crashed"  # final at the first look


GPU_CSV = "0, GPU-0, NVIDIA H200, 580.159.04, 143771, {0}, 90, Disabled\n1, GPU-1, NVIDIA H200, 580.159.04, 143771, {1}, 0, Disabled\n"


def test_gpu_below_threshold_with_table(tmp_path, fake_host):
    trainer = Trainer(tmp_path)
    trainer.start()
    try:
        # pid 1 exists in every PID namespace and is not the unit's
        host = fake_host({"--query-gpu": (0, GPU_CSV.format(70000, 3), ""), "--query-compute-apps": (0, "GPU-0, 1, python, 69000\n", "")})
        host.now, host.sleep = time.monotonic, time.sleep  # the trainer thread runs in real time
        result = check_health(host, params(tmp_path, gpu_ids=[0, 1], gpu_min_memory_mib=8192, progress_window=2, timeout=5, poll_interval=0.1),
                              lambda: dict(ACTIVE))  # fmt: skip
    finally:
        trainer.running = False
    assert result["failed_invariants"] == ["gpu"]
    assert result["failures"][0]["reason"] == (
        "GPU memory of the unit's processes below 8192 MiB (model not loaded?): "
        "GPU 0: 0 MiB (held by pid(s) 1, not the unit's), "
        "GPU 1: 3 MiB (no processes listed by nvidia-smi: the GPU's total counted)")
    assert "70000/143771" in result["diagnosis"] and "1 python 69000MiB" in result["diagnosis"]


def test_gpu_memory_counts_only_the_units_processes(tmp_path, fake_host):
    trainer = Trainer(tmp_path)
    trainer.start()
    apps = f"GPU-0, {os.getpid()}, python, 69000\nGPU-1, 4242, other-job, 69000\nGPU-1, {os.getpid()}, python, 9000\n"
    try:
        host = fake_host({"--query-gpu": (0, GPU_CSV.format(70000, 78000), ""), "--query-compute-apps": (0, apps, "")})
        host.now, host.sleep = time.monotonic, time.sleep
        result = check_health(host, params(tmp_path, gpu_ids=[0, 1], gpu_min_memory_mib=8192, progress_window=2, timeout=5,
                                           poll_interval=0.1), lambda: dict(ACTIVE))  # fmt: skip
        assert result["healthy"], result["diagnosis"]
        result = check_health(host, params(tmp_path, gpu_ids=[0, 1], gpu_min_memory_mib=10000, progress_window=1, timeout=3,
                                           poll_interval=0.1), lambda: dict(ACTIVE))  # fmt: skip
    finally:
        trainer.running = False
    # 78000 MiB are in use on GPU 1, but only 9000 of them by the unit.
    assert result["failed_invariants"] == ["gpu"] and "GPU 1: 9000 MiB" in result["failures"][0]["reason"]


def test_gpu_missing_nvidia_smi_or_absent_gpu_is_final(tmp_path, fake_host):
    (tmp_path / "job.log").write_text("x\n")
    write_heartbeat(tmp_path / "heartbeat.json", 5)
    result = check_health(fake_host(which={}), params(tmp_path, gpu_ids=[0], timeout=60), lambda: dict(ACTIVE))
    assert "gpu" in result["failed_invariants"] and "nvidia-smi not found" in result["diagnosis"]
    host = fake_host({"--query-gpu": (0, GPU_CSV.format(70000, 70000), "")})
    result = check_health(host, params(tmp_path, gpu_ids=[0, 5], timeout=60), lambda: dict(ACTIVE))
    assert result["failures"][0]["reason"] == "GPU(s) [5] not visible to nvidia-smi (visible: [0, 1])"


@pytest.mark.parametrize("timeout", [0])
def test_zero_timeout_is_one_snapshot(tmp_path, timeout, fake_host):
    host = fake_host()
    result = check_health(host, params(tmp_path, timeout=timeout), lambda: dict(ACTIVE))
    assert host.clock == 0 and not result["healthy"]  # one look, no sleep


def test_a_trainer_that_keeps_saying_starting_is_loading_not_hung(tmp_path, fake_host):
    """Data regeneration outlasts the progress window: a `starting` heartbeat rewritten within the window reads
    `starting` until the start-up allowance, with a quiet log; one that is no longer rewritten is hung."""
    (tmp_path / "job.log").write_text("target: 6 layers\n")
    os.utime(tmp_path / "job.log", (time.time() - 100, time.time() - 100))
    write_heartbeat(tmp_path / "heartbeat.json", 0, status="starting", age=10)
    launched = {**ACTIVE, "started_at": time.time() - 100}
    snapshot = check_health(LocalHost(), params(tmp_path, timeout=0, progress_window=30, start_window=600),
                            lambda: dict(launched))  # fmt: skip
    assert snapshot["state"] == "starting" and snapshot["ok"] and snapshot["failed_invariants"] == ["progress"]
    assert snapshot["failures"][0]["reason"] == ("no progress yet: starting (loading for 100s; start-up allowance "
                                                 "600s)")  # fmt: skip

    write_heartbeat(tmp_path / "heartbeat.json", 0, status="starting")
    host = fake_host()  # waiting (fake clock) longer than the window does not make it final
    watched = check_health(host, params(tmp_path, timeout=90, progress_window=30, start_window=600, poll_interval=5),
                           lambda: dict(launched))  # fmt: skip
    assert host.clock >= 90 and watched["state"] == "starting" and not watched["healthy"]

    beyond = {**ACTIVE, "started_at": time.time() - 700}
    late = check_health(LocalHost(), params(tmp_path, timeout=0, progress_window=30, start_window=600),
                        lambda: dict(beyond))  # fmt: skip
    assert late["state"] == "hung" and not late["ok"]
    assert late["failures"][-1]["reason"] == ("no progress: still starting 700s after the launch, beyond the "
                                              "start-up allowance (600s)")  # fmt: skip

    write_heartbeat(tmp_path / "heartbeat.json", 0, status="starting", age=60)  # no longer rewritten: frozen
    frozen = check_health(LocalHost(), params(tmp_path, timeout=0, progress_window=30, start_window=600),
                          lambda: dict(launched))  # fmt: skip
    assert frozen["state"] == "hung" and "log" in frozen["failed_invariants"]
    assert "heartbeat status 'starting', step 0 for 60s" in frozen["diagnosis"]


# above any kernel's pid_max (2**22): a pid that exists in no PID namespace here
HOST_PID = 4194399


def test_gpu_pids_that_do_not_exist_here_are_host_pids_and_the_total_counts(tmp_path, fake_host):
    """A driver that reports the node's pids inside a container: no listed pid exists in the container's
    namespace, so none can be matched to the unit: the GPU's total counts, with a note (as with no pid listed).
    Beside a pid of the unit, such a pid is foreign and not counted."""
    trainer = Trainer(tmp_path)
    trainer.start()
    try:
        apps = f"GPU-0, {HOST_PID}, python, 69000\nGPU-1, {HOST_PID + 1}, python, 60000\nGPU-1, {os.getpid()}, python, 9000\n"
        host = fake_host({"--query-gpu": (0, GPU_CSV.format(70000, 69000), ""), "--query-compute-apps": (0, apps, "")})
        host.now, host.sleep = time.monotonic, time.sleep
        result = check_health(host, params(tmp_path, gpu_ids=[0, 1], gpu_min_memory_mib=10000, progress_window=2, timeout=3,
                                           poll_interval=0.1), lambda: dict(ACTIVE))  # fmt: skip
    finally:
        trainer.running = False
    assert result["failed_invariants"] == ["gpu"], result["diagnosis"]
    reason = result["failures"][0]["reason"]
    assert "GPU 0" not in reason  # 70000 MiB counted: every listed pid is the node's
    assert "GPU 1: 9000 MiB" in reason  # the unit's own process only; the foreign 60000 MiB not


def test_the_note_names_the_host_pids():
    from ansible.module_utils.dflash_health import unit_gpu_memory

    obs = {"unit_pids": [os.getpid()], "gpu_pids_here": [], "gpus": [{"index": 0, "uuid": "GPU-0", "memory_used_mib": 5000}],
           "gpu_processes": [{"gpu_uuid": "GPU-0", "pid": HOST_PID, "used_memory_mib": 5000}]}  # fmt: skip
    assert unit_gpu_memory(obs, [0]) == {0: (5000, f"nvidia-smi lists pid(s) {HOST_PID} that do not exist in this "
                                                   "container (host pids): the GPU's total counted")}  # fmt: skip
