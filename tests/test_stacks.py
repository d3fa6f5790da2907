"""Hang evidence (dflash/runtime/stacks.py, module_utils/dflash_stacks.py): a real process dumps its stacks on SIGUSR1 and on
the watchdog's SIGABRT, the launcher passes the signal on, the reader names the stuck rank, and the resume line
says how the previous start ended and how many steps are done again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ansible.module_utils
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "module_utils") not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(str(ROOT / "module_utils"))

from ansible.module_utils.dflash_stacks import (  # noqa: E402
    catches,
    describe,
    parse_dumps,
    read_stacks,
    request_dump,
    stuck_ranks,
)

BOUND_S = 120.0  # generous: a loaded machine may take long to start Python

RANK = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGABRT: no core file
from dflash.runtime import stacks
stacks.install(sys.argv[1], int(sys.argv[2]))

def stuck_in_collective():
    time.sleep(600)

stuck_in_collective()
"""

# A launcher: its child (a rank) starts with SIGUSR1 ignored, the launcher passes SIGUSR1/SIGABRT on to it.
LAUNCHER = """
import resource, subprocess, sys, time
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
from dflash.runtime import stacks
stacks.ignore_for_children()
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], "0"])
stacks.forward(lambda: [child.pid])
print(child.pid, flush=True)
while True:
    time.sleep(0.1)
"""


def wait_for(predicate, what):
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"not within {BOUND_S:.0f}s: {what}")


def spawn(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", *args], env=env, stdout=subprocess.PIPE, text=True)


def dumps_of(path: Path):
    return parse_dumps(path.read_text()) if path.exists() else []


def test_a_rank_dumps_its_stacks_on_sigusr1_and_on_the_watchdogs_sigabrt(tmp_path):
    run = tmp_path / "run"
    proc = spawn(RANK, str(run), "0")
    stack_file = run / "stacks" / "rank-0.txt"
    try:
        wait_for(lambda: catches(proc.pid, signal.SIGUSR1), "the rank registered its dump handler")
        assert stack_file.read_text().startswith(f"# dflash stacks: rank 0 pid {proc.pid} started ")
        assert read_stacks(run) == {}  # a start without a dump is no evidence
        proc.send_signal(signal.SIGUSR1)
        stacks = wait_for(lambda: read_stacks(run).get(0, {}).get("frames") and read_stacks(run), "the first dump")
        assert any("stuck_in_collective" in f for f in stacks[0]["frames"]), stacks
        assert stacks[0]["fatal"] is None and proc.poll() is None  # the dump leaves the rank running
        assert stuck_ranks(stacks) == [0]
        assert describe(stacks)[0].startswith("stacks: rank 0 (stuck): top frames stuck_in_collective (<string>:")
        proc.send_signal(signal.SIGABRT)
        proc.wait(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGABRT
    dumps = dumps_of(stack_file)
    assert len(dumps) == 2 and dumps[1]["fatal"] == "Aborted"
    assert read_stacks(run)[0]["fatal"] == "Aborted"
    assert any("stuck_in_collective" in f for f in read_stacks(run)[0]["frames"])
    # the next start of the rank knows how the previous one ended (its resume line says so)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    again = subprocess.run([sys.executable, "-c", "import sys\nfrom dflash.runtime import stacks\nstacks.install(sys.argv[1], 0)\n"
                            "print(stacks.previous_dumped(), stacks.previous_fatal())", str(run)],
                           env=env, capture_output=True, text=True, timeout=BOUND_S)
    assert again.stdout.split() == ["True", "Aborted"], again.stderr
    assert read_stacks(run) == {}  # the new start has not dumped yet


RANK_WITH_A_THREAD = """
import resource, sys, threading, time
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
from dflash.runtime import stacks
stacks.install(sys.argv[1], int(sys.argv[2]))

def stuck_in_data_loader():
    time.sleep(600)

threading.Thread(target=stuck_in_data_loader, daemon=True).start()

def stuck_in_collective():
    time.sleep(600)

stuck_in_collective()
"""


def test_a_dump_holds_every_thread_of_the_rank(tmp_path):
    """A hang is often in another thread than the main one (a data loader, NCCL's watchdog): each dump has all."""
    run = tmp_path / "run"
    proc = spawn(RANK_WITH_A_THREAD, str(run), "0")
    stack_file = run / "stacks" / "rank-0.txt"
    try:
        wait_for(lambda: catches(proc.pid, signal.SIGUSR1), "the rank registered its dump handler")
        proc.send_signal(signal.SIGUSR1)
        # faulthandler writes the whole dump in one go from its signal handler: once the main thread's frame is
        # there, so is every other thread's (a dump of the main thread alone ends the wait too, and fails)
        text = wait_for(lambda: "stuck_in_collective" in stack_file.read_text() and stack_file.read_text(), "the dump")
        assert "stuck_in_data_loader" in text, text
        assert any("stuck_in_collective" in f for f in read_stacks(run)[0]["frames"])
    finally:
        proc.kill()
        proc.wait()


def test_the_launcher_passes_the_dump_signal_on_and_has_its_ranks_dump_before_it_aborts(tmp_path):
    run = tmp_path / "run"
    launcher = spawn(LAUNCHER, RANK, str(run))
    try:
        rank_pid = int(launcher.stdout.readline())
        wait_for(lambda: catches(rank_pid, signal.SIGUSR1), "the rank registered its dump handler")
        # what the role and the health check do: SIGUSR1 to the unit's main process, then wait for the files
        assert request_dump(launcher.pid, str(run), wait=BOUND_S)
        stacks = wait_for(lambda: read_stacks(run).get(0) and read_stacks(run), "the rank's dump")
        assert any("stuck_in_collective" in f for f in stacks[0]["frames"])
        assert launcher.poll() is None
        launcher.send_signal(signal.SIGABRT)  # systemd's watchdog: the launcher is the unit's main process
        launcher.wait(timeout=BOUND_S)
        assert launcher.returncode == -signal.SIGABRT
        assert len(wait_for(lambda: len(dumps_of(run / "stacks" / "rank-0.txt")) == 2
                            and dumps_of(run / "stacks" / "rank-0.txt"), "the rank's second dump")) == 2
    finally:
        for pid in (launcher.pid, locals().get("rank_pid")):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        launcher.wait()


def test_request_dump_never_signals_a_process_without_the_handler(tmp_path):
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        assert not request_dump(sleeper.pid, str(tmp_path))
        assert sleeper.poll() is None  # SIGUSR1 would have killed it
    finally:
        sleeper.kill()
        sleeper.wait()


def _thread(name, frames, current=False):
    head = f"{'Current thread' if current else 'Thread'} 0x00007f{name} (most recent call first):\n"
    return head + "".join(f'  File "{file}", line {line} in {func}\n' for file, line, func in frames)


TP = "/venv/lib/python3.11/site-packages/"
BOOT = [("/usr/lib/python3.11/threading.py", 982, "run"), ("/usr/lib/python3.11/threading.py", 1002, "_bootstrap")]
COLLECTIVE = [(TP + "torch/distributed/distributed_c10d.py", 2501, "all_reduce"),
              (TP + "torch/distributed/c10d_logger.py", 81, "wrapper"),
              (TP + "dflash/training/ranks.py", 120, "reduce_step"), (TP + "dflash/training/trainer.py", 520, "train_step")]
DATA_READ = [(TP + "dflash/data/chat.py", 77, "read_batch"), (TP + "dflash/training/trainer.py", 498, "next"),
             (TP + "dflash/training/trainer.py", 515, "train_step")]


def _write_rank(run: Path, rank: int, main_frames, older_dump=None):
    text = f"# dflash stacks: rank {rank} pid {100 + rank} started 2026-12-03T22:00:00Z (1796335200.000)\n"
    dump = _thread("aaaa", [("/x/dflash/observability.py", 90, "_refresh_starting"), *BOOT]) + "\n" + \
        _thread("bbbb", [*main_frames, ("<frozen runpy>", 88, "_run_code")], current=True)
    if older_dump:
        text = older_dump + text
    (run / "stacks").mkdir(parents=True, exist_ok=True)
    (run / "stacks" / f"rank-{rank}.txt").write_text(text + dump)


def test_the_reader_names_the_rank_that_is_not_where_the_others_wait(tmp_path):
    run = tmp_path / "run"
    for rank in (0, 1, 2):
        _write_rank(run, rank, COLLECTIVE)
    _write_rank(run, 3, DATA_READ)
    stacks = read_stacks(run)
    assert sorted(stacks) == [0, 1, 2, 3]
    assert stacks[3]["frames"] == ["read_batch (dflash/data/chat.py:77)", "next (dflash/training/trainer.py:498)",
                                   "train_step (dflash/training/trainer.py:515)"]
    assert stacks[0]["frames"][0] == "all_reduce (torch/distributed/distributed_c10d.py:2501)"
    assert stuck_ranks(stacks) == [3]  # the odd one out; the others wait for it in the collective
    lines = describe(stacks)
    assert [line.split(":")[0] for line in lines] == ["stacks"] * 4
    assert lines[3].startswith("stacks: rank 3 (stuck): top frames read_batch (dflash/data/chat.py:77) <- next")
    assert "(stuck)" not in "".join(lines[:3])
    # two ranks, one in the collective: the other one is stuck
    os.unlink(run / "stacks" / "rank-2.txt")
    os.unlink(run / "stacks" / "rank-1.txt")
    assert stuck_ranks(read_stacks(run)) == [3]
    # every rank at the same frame: all of them
    _write_rank(run, 3, COLLECTIVE)
    assert stuck_ranks(read_stacks(run)) == [0, 3]
    # a file last written before the launch is not this launch's evidence
    assert read_stacks(run, since=time.time() + 60) == {}


# A two-rank colocated CPU run (gloo) whose rank 1 hangs before its step (DFLASH_FAULT_INJECT=1:4:hang), as dumped on
# SIGUSR1: rank 0 went on to its backward and waits there for DistributedDataParallel's gradient all-reduce.
DDP_BACKWARD = [(TP + "torch/autograd/graph.py", 979, "_engine_run_backward"),
                (TP + "torch/autograd/__init__.py", 395, "backward"), (TP + "torch/_tensor.py", 623, "backward"),
                ("/opt/dflash/current/dflash/training/trainer.py", 529, "train_step")]
HUNG_BEFORE_STEP = [("/opt/dflash/current/dflash/training/ranks.py", 65, "check_fault"),
                    ("/opt/dflash/current/dflash/training/ranks.py", 126, "start_step"),
                    ("/opt/dflash/current/dflash/training/trainer.py", 510, "train_step")]


def test_a_rank_waiting_in_ddps_backward_waits_for_its_peer(tmp_path):
    """Two ranks at different frames: the one in the backward (DDP's all-reduce is waited for in the autograd engine)
    waits in a collective; the other one is the stuck rank (before: both named)."""
    run = tmp_path / "run"
    _write_rank(run, 0, DDP_BACKWARD)
    _write_rank(run, 1, HUNG_BEFORE_STEP)
    stacks = read_stacks(run)
    assert stuck_ranks(stacks) == [1]
    assert stacks[1]["frames"] == ["check_fault (ranks.py:65)", "start_step (ranks.py:126)", "train_step (trainer.py:510)"]
    assert stacks[0]["frames"][0] == "_engine_run_backward (torch/autograd/graph.py:979)"
    # a rank in a torch.distributed collective beside one in the backward: neither is outside a wait
    _write_rank(run, 1, COLLECTIVE)
    assert stuck_ranks(read_stacks(run)) == [0, 1]


def test_the_reader_takes_the_last_dump_of_the_last_start(tmp_path):
    run = tmp_path / "run"
    earlier = "# dflash stacks: rank 0 pid 5 started 2026-12-03T21:00:00Z (1796331600.000)\n" + \
        "Fatal Python error: Aborted\n\n" + _thread("cccc", DATA_READ, current=True)
    _write_rank(run, 0, COLLECTIVE, older_dump=earlier)
    stacks = read_stacks(run)
    assert stacks[0]["dumps"] == 1 and stacks[0]["fatal"] is None and stacks[0]["frames"][0].startswith("all_reduce")
    # the earlier start's dumps only: no evidence for this start
    (run / "stacks" / "rank-0.txt").write_text(earlier + "# dflash stacks: rank 0 pid 6 started 2026 (1.0)\n")
    assert read_stacks(run) == {}


def test_the_resume_line_says_how_the_previous_start_ended_and_the_steps_redone(tiny_config, capsys, monkeypatch):
    from dflash.runtime import stacks
    from dflash.training.trainer import Trainer

    Trainer(tiny_config).setup().run()  # 6 steps, checkpoints at 3 and 6
    run = Path(tiny_config.output_dir)
    capsys.readouterr()
    # the next start was killed after step 9 (its heartbeat said training), before a checkpoint after step 6
    beat = json.loads((run / "heartbeat.json").read_text())
    (run / "heartbeat.json").write_text(json.dumps({**beat, "step": 9, "status": "training"}))
    tiny_config.optim.max_steps = 12
    trainer = Trainer(tiny_config).setup()
    assert trainer.step == 6
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("resumed from "))
    assert line.endswith(" at step 6; previous run: ended without a clean stop (killed, crashed or hung while "
                         "training), last heartbeat at step 9, steps redone 3"), line
    # a start ended by the watchdog's SIGABRT (its rank's stack file ends in a fatal dump): said so
    monkeypatch.setattr(stacks, "_PREVIOUS_FATAL", "Aborted")
    previous = stacks.previous_end(run)
    assert previous["step"] == 0 and previous["reason"].startswith("killed by a fatal signal (Aborted;")
    assert stacks.resume_note(previous, 6).endswith("steps redone 0")
    # a start killed after its stacks were dumped on SIGUSR1 (a hung one: the health check, a restart, the daemon
    # backend's watchdog) while its heartbeat still said training
    monkeypatch.setattr(stacks, "_PREVIOUS_FATAL", None)
    monkeypatch.setattr(stacks, "_PREVIOUS_DUMPED", True)
    assert stacks.previous_end(run)["reason"].startswith("killed after a stack dump (a hang")
    monkeypatch.setattr(stacks, "_PREVIOUS_DUMPED", False)
    # a clean stop
    (run / "heartbeat.json").write_text(json.dumps({**beat, "step": 6, "status": "stopped"}))
    monkeypatch.setattr(stacks, "_PREVIOUS_FATAL", None)
    assert stacks.resume_note(stacks.previous_end(run), 6) == (
        "; previous run: stopped on request, last heartbeat at step 6, steps redone 0")
    # no heartbeat: nothing to add
    (run / "heartbeat.json").unlink()
    assert stacks.resume_note(stacks.previous_end(run), 6) == ""
