"""Hang evidence in the health check: a hung job's diagnosis and result name the stuck rank and its top frames from
the stack files this launch dumped; the check asks a real trainer rank for a dump first; `dflash ops status` shows
the stuck rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ansible.module_utils.dflash_health import check_health
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_stacks import catches, read_stacks
from test_ansible_health import ACTIVE, params, write_heartbeat
from test_ansible_unit_daemon import wait_for

from dflash.ops.results import EventCollector

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 120.0

TP = "/venv/lib/python3.11/site-packages/"
COLLECTIVE = [(TP + "torch/distributed/distributed_c10d.py", 2501, "all_reduce"),
              (TP + "dflash/distributed/ranks.py", 120, "reduce_step"), (TP + "dflash/train.py", 520, "train_step"),
              (TP + "dflash/train.py", 600, "run")]
DATA_READ = [(TP + "dflash/data/chat.py", 77, "read_batch"), (TP + "dflash/train.py", 498, "next"),
             (TP + "dflash/train.py", 515, "train_step")]


def write_rank(run: Path, rank: int, frames):
    text = (f"# dflash stacks: rank {rank} pid {100 + rank} started 2026-12-03T22:00:00Z (1796335200.000)\n"
            "Current thread 0x00007f0000000001 (most recent call first):\n"
            + "".join(f'  File "{file}", line {line} in {func}\n' for file, line, func in frames))
    (run / "stacks").mkdir(parents=True, exist_ok=True)
    (run / "stacks" / f"rank-{rank}.txt").write_text(text)


def hung_job(tmp_path):
    (tmp_path / "job.log").write_text("step 12 epoch 0 loss 3.2100\n")
    os.utime(tmp_path / "job.log", (time.time() - 100, time.time() - 100))
    write_heartbeat(tmp_path / "heartbeat.json", 12, age=60)


def test_a_hung_jobs_diagnosis_names_the_stuck_rank_and_its_top_frames(tmp_path, fake_host):
    hung_job(tmp_path)
    for rank in (0, 1):
        write_rank(tmp_path, rank, COLLECTIVE)
    write_rank(tmp_path, 2, DATA_READ)
    result = check_health(fake_host(), params(tmp_path, progress_window=1), lambda: dict(ACTIVE))
    assert result["state"] == "hung"
    lines = [line for line in result["diagnosis"].splitlines() if line.startswith("stacks: ")]
    assert len(lines) == 3
    assert lines[2].startswith("stacks: rank 2 (stuck): top frames read_batch (dflash/data/chat.py:77) <- "
                               "next (dflash/train.py:498) <- train_step (dflash/train.py:515) (dumped ")
    assert lines[0].startswith("stacks: rank 0: top frames all_reduce (torch/distributed/distributed_c10d.py:2501)")
    assert [(r["rank"], r["stuck"]) for r in result["stacks"]] == [(0, False), (1, False), (2, True)]
    assert result["stacks"][2]["frames"][0] == "read_batch (dflash/data/chat.py:77)"
    # dflash ops status: the container line names the stuck rank, the diagnosis carries every rank's line
    collector = EventCollector()
    collector.add({"event": "runner_on_ok", "event_data": {"host": "c1", "task": "Read the job's health",
                                                           "res": result, "resolved_action": "dflash_health"}})
    ops = collector.result("status", "status.yml", "inventories/x", "successful", 0)
    container = ops.containers["c1"]
    assert container.state == "hung" and container.stacks == result["stacks"]
    assert "c1 hung, step 12" in ops.message
    assert "stuck rank 2 at read_batch (dflash/data/chat.py:77) <- next" in ops.message
    assert "stacks: rank 2 (stuck)" in (container.diagnosis or "")
    # stop.yml reads the health first (the dump), then stops: the job reads as stopped, its evidence stays
    collector.add({"event": "runner_on_ok", "event_data": {
        "host": "c1", "task": "Stop the trainer unit", "resolved_action": "dflash_unit",
        "res": {"action": "stopped", "active_state": "inactive", "sub_state": "dead", "exit_status": 0}}})
    stopped = collector.result("stop", "stop.yml", "inventories/x", "successful", 0)
    assert stopped.containers["c1"].state == "stopped"
    assert "stuck rank 2 at read_batch" in stopped.message and "dflash_job_state=restarted" not in stopped.message


def test_stacks_written_before_this_launch_are_not_its_evidence(tmp_path, fake_host):
    hung_job(tmp_path)
    write_rank(tmp_path, 0, DATA_READ)
    old = time.time() - 7200  # the launch was an hour ago (ACTIVE): this dump belongs to an earlier one
    os.utime(tmp_path / "stacks" / "rank-0.txt", (old, old))
    result = check_health(fake_host(), params(tmp_path, progress_window=1), lambda: dict(ACTIVE))
    assert result["state"] == "hung" and result["stacks"] == []
    assert "stacks: no dump from this launch" in result["diagnosis"]


def test_a_healthy_job_shows_no_stacks(tmp_path, fake_host):
    (tmp_path / "job.log").write_text("step 12\n")
    write_heartbeat(tmp_path / "heartbeat.json", 12)
    write_rank(tmp_path, 0, DATA_READ)
    result = check_health(fake_host(), params(tmp_path, timeout=0, progress_window=60), lambda: dict(ACTIVE))
    assert result["state"] == "training" and result["stacks"] == []
    assert "stacks:" not in result["diagnosis"]


RANK = """
import sys, time
from dflash.runtime import stacks
stacks.install(sys.argv[1], 0)

def stuck_in_collective():
    time.sleep(600)

stuck_in_collective()
"""


def test_the_check_asks_a_hung_trainer_for_its_stacks(tmp_path):
    """The unit's main process is a real trainer rank: the hung verdict sends it SIGUSR1 and reads the dump."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path)], env=env)
    try:
        assert wait_for(lambda: catches(rank.pid, signal.SIGUSR1), timeout=BOUND_S)
        hung_job(tmp_path)
        write_heartbeat(tmp_path / "heartbeat.json", 12, age=60, pid=rank.pid)
        unit = {**ACTIVE, "main_pid": rank.pid}
        result = check_health(LocalHost(), params(tmp_path, progress_window=1, stacks_wait=BOUND_S),
                              lambda: dict(unit))
        assert result["state"] == "hung", result["diagnosis"]
        assert [r["rank"] for r in result["stacks"]] == [0] and result["stacks"][0]["stuck"]
        assert result["stacks"][0]["frames"][0].startswith("stuck_in_collective (<string>:")
        assert "stacks: rank 0 (stuck): top frames stuck_in_collective" in result["diagnosis"]
        assert rank.poll() is None  # a dump, not a kill
    finally:
        rank.kill()
        rank.wait()


def test_a_restart_request_asks_a_running_trainer_for_its_stacks_whatever_its_state(tmp_path):
    """dump_stacks (the role, before a restart requested with dflash_job_state=restarted): a dump though it trains."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path)], env=env)
    try:
        assert wait_for(lambda: catches(rank.pid, signal.SIGUSR1), timeout=BOUND_S)
        (tmp_path / "job.log").write_text("step 12\n")
        write_heartbeat(tmp_path / "heartbeat.json", 12, pid=rank.pid)
        unit = {**ACTIVE, "main_pid": rank.pid}
        result = check_health(LocalHost(), params(tmp_path, timeout=0, progress_window=60, dump_stacks=True,
                                                  stacks_wait=BOUND_S), lambda: dict(unit))
        assert result["state"] == "training"
        assert [r["rank"] for r in result["stacks"]] == [0]
        assert result["stacks"][0]["frames"][0].startswith("stuck_in_collective (<string>:")
        assert "stacks:" not in result["diagnosis"]  # shown for a hung job only
    finally:
        rank.kill()
        rank.wait()


# A trainer stand-in: its stack handler, one step (READY and the steady watchdog interval), then no more pings.
HANGING = """
import sys, time
from dflash.runtime import stacks
from dflash.runtime.notify import Notifier
stacks.install(sys.argv[1], 0)
Notifier().step(1)

def stuck_in_collective():
    time.sleep(600)

stuck_in_collective()
"""


def test_the_daemon_watchdog_asks_a_hung_trainer_for_its_stacks_before_the_kill(tmp_path):
    from ansible.module_utils.dflash_unit_daemon import DaemonBackend

    backend = DaemonBackend(LocalHost())
    spec = {"name": "stacks-" + tmp_path.name[-20:], "command": [sys.executable, "-c", HANGING, str(tmp_path)],
            "log_path": str(tmp_path / "job.log"), "state_dir": str(tmp_path / "state"), "stop_timeout": 5,
            "working_directory": str(tmp_path), "environment": {"PYTHONPATH": str(ROOT)}, "config_hash": "h1",
            "settle_time": 0, "restart": {"policy": "no"}, "watchdog": {"interval": 1, "start_interval": 300}}
    backend.start(spec)
    try:
        status = wait_for(lambda: (s := backend.status(spec))["watchdog_kills"] and s, timeout=BOUND_S)
        assert status and status["last_exit_reason"] == "watchdog (killed KILL)", backend.status(spec)
        stacks = read_stacks(str(tmp_path))
        assert [r for r in stacks] == [0] and stacks[0]["frames"][0].startswith("stuck_in_collective (<string>:")
        assert stacks[0]["fatal"] is None  # SIGUSR1's dump; the kill itself is SIGKILL
    finally:
        backend.stop(spec)


def test_make_status_shows_every_ranks_top_frames_and_the_stuck_one():
    """roles/job/templates/status.txt.j2 (status.yml, `make status`), rendered as Ansible renders it (trim_blocks)."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters.update(dirname=os.path.dirname, bool=bool)
    template = env.from_string((ROOT / "roles" / "job" / "templates" / "status.txt.j2").read_text())
    stacks = [{"rank": 0, "stuck": False, "frames": ["all_reduce (torch/distributed/distributed_c10d.py:2501)",
                                                     "reduce_step (dflash/distributed/ranks.py:120)"],
               "fatal": None, "path": "/runs/job/stacks/rank-0.txt"},
              {"rank": 1, "stuck": True, "frames": ["read_batch (dflash/data/chat.py:77)"], "fatal": None,
               "path": "/runs/job/stacks/rank-1.txt"}]
    health = {"state": "hung", "ok": False, "failures": [], "hint": "restart it", "step": 12, "epoch": 0,
              "unit": {"backend": "daemon", "active_state": "active", "sub_state": "running", "main_pid": 5,
                       "exit_status": None}, "heartbeat_current": True, "heartbeat": {}, "checkpoint": None,
              "tokens_per_s": None, "tau": None, "loss": None, "gpu_table": None, "log_tail": [], "all_joined": None,
              "lost_node": None, "stacks": stacks}
    text = template.render(dflash_job_health=health, inventory_hostname="c1", dflash_job_name="job",
                           _dflash_job_multinode=False, _dflash_job_gpu_ids=[], dflash_job_log_path="/log")
    lines = text.splitlines()
    assert "stacks     rank 0: all_reduce (torch/distributed/distributed_c10d.py:2501) <- reduce_step " \
           "(dflash/distributed/ranks.py:120)" in lines
    assert "stacks     rank 1 (stuck): read_batch (dflash/data/chat.py:77)" in lines
    assert "           (every thread: /runs/job/stacks/rank-R.txt)" in lines
    assert "stacks" not in template.render(dflash_job_health={**health, "stacks": []}, inventory_hostname="c1",
                                           dflash_job_name="job", _dflash_job_multinode=False,
                                           _dflash_job_gpu_ids=[], dflash_job_log_path="/log")


def test_root_reads_no_fifo_or_link_the_trainer_puts_in_the_stacks_directory(tmp_path):
    """The run directory is the trainer account's: a FIFO named like a stack file (an open() would block), a link
    to /dev/zero (endless) or a `stacks` directory that is a link are skipped, not followed."""
    (tmp_path / "stacks").mkdir()
    os.mkfifo(tmp_path / "stacks" / "rank-0.txt")
    os.symlink("/dev/zero", tmp_path / "stacks" / "rank-1.txt")
    assert read_stacks(str(tmp_path)) == {}
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "stacks").mkdir(parents=True)
    (elsewhere / "stacks" / "rank-0.txt").write_text(
        '# dflash stacks: rank 0 pid 1 started x (1)\nCurrent thread 0x00007f (most recent call first):\n'
        '  File "/x.py", line 3 in stuck\n')
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(elsewhere / "stacks", linked / "stacks")
    assert read_stacks(str(linked)) == {} and read_stacks(str(elsewhere))[0]["frames"] == ["stuck (x.py:3)"]


def test_the_stacks_reader_reads_the_jobs_ranks_only(tmp_path):
    """Ranks 0 to the world size - 1, each named (a directory of the trainer's is never listed): a rank file past the
    world size, or past MAX_RANKS when it is not known, is not read."""
    from ansible.module_utils.dflash_stacks import MAX_RANKS

    (tmp_path / "stacks").mkdir()
    dump = '# dflash stacks: rank {r} pid 1 started x (1)\nCurrent thread 0x00007f (most recent call first):\n  File "/x.py", line 3 in stuck\n'
    for rank in (0, 1, 5, MAX_RANKS):
        (tmp_path / "stacks" / f"rank-{rank}.txt").write_text(dump.format(r=rank))
    assert sorted(read_stacks(str(tmp_path), world_size=2)) == [0, 1]
    assert sorted(read_stacks(str(tmp_path))) == [0, 1, 5]
