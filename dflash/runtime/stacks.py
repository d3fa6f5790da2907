"""Hang evidence: every rank's Python stacks in the run directory, before a hung trainer is killed.

`install(run_dir, rank)` (every trainer rank, first thing) opens `RUN_DIR/stacks/rank-R.txt` for appending, writes
one line naming this start (`# dflash stacks: rank R pid P started ISO (UNIX)`) and has faulthandler append every
thread's stack to it on SIGUSR1 (a dump on request: the role before it restarts or stops a hung job, the health
check of a hung one, `systemctl kill --kill-who=main --signal=SIGUSR1 JOB.service`) and on a fatal signal
(systemd's watchdog sends SIGABRT; a segfault). The launcher of several ranks (`forward`) passes SIGUSR1 on to its
ranks, and on SIGABRT it has them dump before it aborts itself. `module_utils/dflash_stacks.py` reads the files
(the stuck rank, its top frames) for `status.yml` and `dflash ops status`; docs/operations.md, "When a job hangs".
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

from dflash.logs import get_logger

log = get_logger(__name__)

STACKS_DIR = "stacks"
HEADER_PREFIX = "# dflash stacks:"
DUMP_SIGNAL = signal.SIGUSR1
FORWARD_WAIT_S = 1.0  # the launcher's SIGABRT: time for its ranks to write their dumps before it aborts
_FILE = None  # kept open for the process's life: faulthandler writes to its descriptor
_ENABLED = False  # faulthandler.enable() (fatal signals) writes to _FILE
_PREVIOUS_FATAL: str | None = None  # the fatal error that ended this rank's previous start (its last dump), if any
_PREVIOUS_DUMPED = False  # this rank's previous start dumped its stacks (a hang: health, a restart, the watchdog)


def stacks_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / STACKS_DIR / f"rank-{rank}.txt"


def _last_start(path: Path) -> tuple[bool, str | None]:
    """The last start's part of a stack file: whether it holds a dump, and the fatal error of its last fatal dump
    (`Fatal Python error: X`: X, e.g. `Aborted`) or None."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - 256 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return False, None
    text = text.rsplit(HEADER_PREFIX, 1)[-1]
    found = re.findall(r"^Fatal Python error: (.*)$", text, re.M)
    dumped = re.search(r"^(Current thread|Thread) 0x", text, re.M) is not None
    return dumped or bool(found), (found[-1].strip() if found else None)


def install(run_dir: str | os.PathLike, rank: int) -> Path | None:
    """Dump every thread's stack to RUN_DIR/stacks/rank-RANK.txt on SIGUSR1 and on a fatal signal. Never fails
    the run: an unwritable run directory is reported by the trainer itself (one warning here, no dumps)."""
    global _FILE, _PREVIOUS_FATAL, _PREVIOUS_DUMPED, _ENABLED
    path = stacks_path(run_dir, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _PREVIOUS_DUMPED, _PREVIOUS_FATAL = _last_start(path) if path.is_file() else (False, None)
        fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the process's life
        now = time.time()
        fh.write(f"{HEADER_PREFIX} rank {rank} pid {os.getpid()} started "
                 f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now))} ({now:.3f})\n")
        fh.flush()
    except OSError as exc:
        log.warning(f"stacks: cannot write {path} ({exc.strerror or exc}); no stack dumps on SIGUSR1 or a watchdog kill")
        return None
    faulthandler.register(DUMP_SIGNAL, file=fh, all_threads=True, chain=False)
    # one enabled by someone else already (PYTHONFAULTHANDLER, a test runner) keeps its file
    if _ENABLED or not faulthandler.is_enabled():
        faulthandler.enable(file=fh, all_threads=True)
        _ENABLED = True
    old, _FILE = _FILE, fh
    if old is not None:
        old.close()
    return path


def previous_fatal() -> str | None:
    """The fatal error (e.g. `Aborted`: the watchdog's SIGABRT) whose dump ended this rank's previous start."""
    return _PREVIOUS_FATAL


def previous_dumped() -> bool:
    """Whether this rank's previous start dumped its stacks (on SIGUSR1 or a fatal signal)."""
    return _PREVIOUS_DUMPED


def forward(ranks: Callable[[], list[int]]) -> None:
    """The launcher of several ranks: SIGUSR1 goes on to `ranks()` (the pids that have installed their handler);
    SIGABRT (systemd's watchdog) too, then the launcher aborts as it would have without this handler.

    The caller starts its children with SIGUSR1 ignored (`ignore_for_children`), so torchrun, which has no
    handler for it, is not killed by a SIGUSR1 sent to every process of the unit."""

    def dump(signum: int, _frame) -> None:
        for pid in ranks():
            try:
                os.kill(pid, DUMP_SIGNAL)
            except ProcessLookupError:
                pass
        if signum == signal.SIGABRT:
            time.sleep(FORWARD_WAIT_S)
            signal.signal(signal.SIGABRT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGABRT)

    signal.signal(DUMP_SIGNAL, dump)
    signal.signal(signal.SIGABRT, dump)


def ignore_for_children() -> None:
    """SIGUSR1 ignored from now on: children started now inherit that (a rank's `install` replaces it)."""
    signal.signal(DUMP_SIGNAL, signal.SIG_IGN)


def previous_end(run_dir: str | os.PathLike) -> dict | None:
    """What the last heartbeat.json (of the previous start) says about how it ended, read before this start
    overwrites it: {"step", "status", "reason"}; None without one."""
    import json

    try:
        beat = json.loads((Path(run_dir) / "heartbeat.json").read_text())
        step = int(beat["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    status = beat.get("status")
    fatal = previous_fatal()
    if fatal:
        reason = f"killed by a fatal signal ({fatal}; the watchdog sends SIGABRT), stacks in {STACKS_DIR}/"
    elif previous_dumped() and status in ("training", "starting"):
        reason = (f"killed after a stack dump (a hang: the watchdog, or a stop or restart of a hung job), stacks in "
                  f"{STACKS_DIR}/")
    elif status == "stopped":
        reason = "stopped on request"
    elif status == "finished":
        reason = "finished"
    elif status == "failed":
        reason = f"failed: {beat.get('error') or 'unknown error'}"
    else:  # training/starting: it never wrote its end
        reason = f"ended without a clean stop (killed, crashed or hung while {status or 'running'})"
    return {"step": step, "status": status, "reason": reason}


def resume_note(previous: dict | None, resumed_step: int) -> str:
    """The resume line's tail: the previous end's reason, the last step it reported and the steps redone."""
    if previous is None:
        return ""
    redone = max(0, previous["step"] - resumed_step)
    return (f"; previous run: {previous['reason']}, last heartbeat at step {previous['step']}, "
            f"steps redone {redone}")


__all__ = ["DUMP_SIGNAL", "forward", "ignore_for_children", "install", "previous_dumped", "previous_end",
           "previous_fatal", "resume_note", "stacks_path"]
