# Copyright: dflash authors
# Apache-2.0
"""dflash_lock (controller side): take the job's deploy lock, and say so when it is held.

The dflash_lock module (library/) holds the lock file on the target. This action runs it in two steps:

1. without waiting (``wait: false``), recording this deploy's process on the controller in the lock (``controller``:
   host name, boot id, the ansible-playbook pid and its start time);
2. when another deploy holds the lock, it judges that holder from its record. A holder on this controller (same host
   and boot) whose process is gone (a deploy ended by Ctrl-C or a kill, its ``always:`` release never ran) left the
   lock behind: it is taken over at once (``take_over``) with one line saying so. Otherwise one line says who holds it
   since when and that this deploy waits (up to ``timeout`` s), and the module waits as before.

Any other state (``released``) or check mode runs the module once, unchanged.
"""

from __future__ import annotations

import os
import socket
import time

from ansible.plugins.action import ActionBase
from ansible.utils.display import Display
from ansible.utils.vars import merge_hash

display = Display()

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def printable(text) -> str:
    """``text`` with every control character escaped (the lock record is read from the target)."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
                   for c in str(text))  # fmt: skip


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), or None when it does not exist."""
    stat = _read(f"/proc/{int(pid)}/stat")
    if not stat:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def deploy_process() -> int:
    """The ansible-playbook (or ansible-runner's) process of this deploy: the nearest ancestor of this worker whose
    command line names ansible-playbook, else the worker's parent."""
    pid = os.getppid()
    here = pid
    for _ in range(8):
        cmdline = (_read(f"/proc/{here}/cmdline") or "").replace("\0", " ")
        if "ansible-playbook" in cmdline:
            return here
        stat = _read(f"/proc/{here}/stat")
        if not stat:
            break
        here = int(stat.rsplit(")", 1)[1].split()[1])
        if here <= 1:
            break
    return pid


def controller_identity(pid: int | None = None) -> dict:
    """What the lock records of this deploy: the controller's host name and boot id, the process and its start."""
    pid = deploy_process() if pid is None else pid
    return {"host": socket.gethostname(), "boot_id": _read(BOOT_ID), "pid": pid, "start": process_start(pid)}


def holder_gone(held: dict, here: dict) -> str | None:
    """Why the lock's holder is known to be gone (its process on this controller no longer runs), or None when it
    may still run (alive, on another controller, or a lock without a controller record)."""
    ctl = held.get("controller") or {}
    if not ctl.get("pid") or ctl.get("host") != here.get("host") or not ctl.get("boot_id"):
        return None
    if ctl.get("boot_id") != here.get("boot_id"):
        return f"its controller {ctl['host']} rebooted since"
    start = process_start(ctl["pid"])
    if start is None:
        return f"its process {ctl['pid']} on {ctl['host']} no longer runs"
    if ctl.get("start") is not None and start != ctl.get("start"):
        return f"its process {ctl['pid']} on {ctl['host']} ended (the pid is another process's now)"
    return None


def describe_holder(held: dict) -> str:
    ctl = held.get("controller") or {}
    text = str(held.get("holder") or "unknown")
    if ctl.get("pid"):
        text += f" (pid {ctl['pid']} on {ctl.get('host')})"
    since = held.get("since")
    if isinstance(since, (int, float)):
        text += f" since {max(time.time() - since, 0):.0f}s ago"
    return printable(text)


class ActionModule(ActionBase):
    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        if args.get("state", "acquired") != "acquired" or self._task.check_mode:
            return merge_hash(result, self._execute_module(module_name="dflash_lock", module_args=args,
                                                           task_vars=task_vars))  # fmt: skip
        here = controller_identity()
        args["controller"] = here
        first = self._execute_module(module_name="dflash_lock", module_args={**args, "wait": False}, task_vars=task_vars)
        if first.get("failed") or first.get("acquired", True) or not first.get("held"):
            return merge_hash(result, first)
        held = first["held"]
        host = printable(task_vars.get("inventory_hostname", "?") if task_vars else "?")
        path = printable(args.get("path"))
        gone = holder_gone(held, here)
        if gone:
            display.display(f"[{host}] the deploy lock {path} was left by {describe_holder(held)}: {gone}, so that "
                            f"deploy was killed; taking the lock over")
            args["take_over"] = held.get("owner") or ""
        else:
            display.display(f"[{host}] waiting for the deploy lock {path}: held by {describe_holder(held)}, another "
                            f"deploy of this job; waiting up to {args.get('timeout', 600)}s (it is taken as soon as "
                            f"that deploy ends)")
        final = self._execute_module(module_name="dflash_lock", module_args=args, task_vars=task_vars)
        if gone and not final.get("failed"):
            final["taken_over"] = held
        return merge_hash(result, final)
