"""The one torchrun launcher of every multi-rank command (`dflash train`, `dflash regenerate --nproc N`).

* `under_torchrun()` / `rank_env()`: whether this process is a torchrun worker (ours or an external one), its
  rank and world size;
* `command(nproc_per_node, args, rendezvous)`: `python -m torch.distributed.run ... -m dflash ARGS`;
* `run(cmd, grace_s)`: starts torchrun and waits for it. A stop signal (dflash/runtime/stop.py) is passed straight to
  the workers, each once its own handler is installed (before that the signal would kill it), so they stop
  the way their command stops (train: together at a step boundary with a checkpoint; regenerate: after the
  shard being written). Workers still running `grace_s` later: torchrun is terminated (it SIGKILLs its
  workers after WORKER_SHUTDOWN_S); some time after that every worker and torchrun are killed. SIGUSR1 goes
  on to the workers that dump their stacks (dflash/runtime/stacks.py).

What the command does around the launch (checks before it, the meaning of torchrun's exit) stays with the
command: dflash/launch.py for `train`, dflash/regenerate/runner.py for `regenerate`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dflash.logs import get_logger

log = get_logger(__name__)

WORKER_SHUTDOWN_S = 30  # torchrun: SIGTERM -> SIGKILL of the other workers after one of them failed
KILL_AFTER_S = 15  # after torchrun's own shutdown window: every worker and torchrun are SIGKILLed
POLL_S = 0.1  # a stop signal is passed on within this time


def under_torchrun() -> bool:
    """True in a worker started by torchrun (ours or an external one)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_env() -> tuple[int, int]:
    """(rank, world_size) from torchrun's environment; (0, 1) otherwise. The GPU is LOCAL_RANK's."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def command(nproc_per_node: int, args: list[str], rendezvous: list[str] | None = None) -> list[str]:
    """torchrun running `python -m dflash ARGS` per rank; `rendezvous` (multi-node options) or, on one node,
    --standalone (a free local port: no clash with other jobs on this machine). No restarts: a failed rank
    ends the job."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc_per_node),
            "--max-restarts", "0", *(rendezvous if rendezvous is not None else ["--standalone"]),
            "-m", "dflash", *args]


def worker_pids(parent: int) -> list[int]:
    """Direct children of torchrun (its workers), read from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: fields after the last ')' are fixed
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            pids.append(int(entry.name))
    return pids


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` installed (from /proc/PID/status, SigCgt)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def hard_exit(code: int) -> None:
    """A worker's end once its work is written: interpreter teardown can take seconds, or hang (or abort in C++)
    in a process group whose peer is gone, and torchrun only acts on the exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(cmd: list[str], grace_s: float, *, what: str = "the ranks", stop_note: str = "stopping the ranks",
        env: dict[str, str] | None = None, poll: Callable[[int], None] | None = None,
        stopping: Callable[[], None] | None = None) -> int:
    """Run torchrun `cmd` to its end and return its exit status (see the module's docstring for stops).

    `what`: the ranks started, for the log line that shows the command; `stop_note`: what the ranks do on a
    stop and how long they may take (`grace_s`), logged once with the signal.
    `poll(workers)`: called every POLL_S with the number of running workers; `stopping()`: every POLL_S once a
    stop was requested."""
    from dflash.runtime import stacks, stop

    stopped: dict = {}  # signum, at, signalled (worker pids already told)

    def note(signum: int) -> None:
        if not stopped:
            stopped.update(signum=signum, at=time.monotonic(), signalled=set())
            log.warning(f"dflash: signal {signum}: {stop_note}")

    request = stop.install(note)
    if request.requested:  # one arrived while this process started up
        note(request.signum)
    try:
        log.info(f"dflash: starting {what}: {' '.join(cmd)}")
        # torchrun's grace before SIGKILL of the other workers after one failed (also its default)
        env = {**os.environ, **(env or {}), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(WORKER_SHUTDOWN_S)}
        stacks.ignore_for_children()  # torchrun has no SIGUSR1 handler: it inherits SIG_IGN
        proc = subprocess.Popen(cmd, env=env)
        stacks.forward(lambda: [p for p in worker_pids(proc.pid) if catches(p, stacks.DUMP_SIGNAL)])
        escalated = 0
        while True:
            try:
                return_code = proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if poll is not None:
                poll(len(worker_pids(proc.pid)))
            if not stopped:
                continue
            _tell_workers(proc.pid, stopped)
            if stopping is not None:
                stopping()
            waited = time.monotonic() - stopped["at"]
            if escalated == 0 and waited > grace_s:
                log.warning("dflash: ranks did not stop in time; terminating torchrun")
                proc.terminate()  # torchrun SIGKILLs its workers after WORKER_SHUTDOWN_S
                escalated = 1
            elif escalated == 1 and waited > grace_s + WORKER_SHUTDOWN_S + KILL_AFTER_S:
                for pid in worker_pids(proc.pid):
                    kill(pid)
                proc.kill()
                escalated = 2
    finally:
        stop.finished()
    return return_code


def _tell_workers(parent: int, stopped: dict) -> None:
    """Straight to the workers, not torchrun: each stops as its command does and exits, so torchrun's exit is
    theirs; a worker is told once its handler is installed (before that the signal kills it)."""
    for pid in worker_pids(parent):
        if pid not in stopped["signalled"] and catches(pid, stopped["signum"]):
            try:
                os.kill(pid, stopped["signum"])
            except ProcessLookupError:
                pass
            stopped["signalled"].add(pid)


__all__ = ["WORKER_SHUTDOWN_S", "catches", "command", "hard_exit", "kill", "rank_env", "run", "under_torchrun",
           "worker_pids"]
