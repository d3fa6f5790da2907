# Copyright: dflash authors
# Apache-2.0
"""dflash_wait: wait for a background task (started with ``async: N, poll: 0``) and say what it waits for.

Ansible prints a task's result only when the task ends, so a long task (debootstrap, pip, a kernel build, the health
window) sits silent for minutes. Started in the background instead, it is waited for by this action, which prints one
line every ``interval`` seconds while the task runs::

    [dflash-local] 20s waiting for pip in the container (torch, the trainer's dependencies): Collecting tokenizers<1,>=0.21

The line names what it waits for and what is happening: the newest line of ``log`` that matches ``pattern``, the
log's growth since the line before, and with ``heartbeat`` the trainer's step and status. Both are read on the target
by the dflash_progress module (library/), as root reads every file the trainer account may write: no link followed,
never waiting on a FIFO, a size cap, the heartbeat's types checked, control characters escaped; it ends itself after
``READ_TIMEOUT`` seconds, and the results-file check runs under ``timeout``: no remote command of the wait is
unbounded. The task's own result is this task's result (as ``ansible.builtin.async_status`` returns it, ``finished``
true): a failure fails here with the task's message, once.

Options:
  jid (str, required): the ``ansible_job_id`` of the background task.
  what (str, required): what it waits for, as the operator reads it.
  log (path): a file on the target whose newest matching line is shown (pip's ``--log``, a job's log).
  pattern (str): a regular expression (Python's ``re``; ``grep -E``'s common forms) a line of ``log`` must match to be
    shown; default any non-blank line.
  heartbeat (path): a JSON file on the target with ``step`` and ``status`` (the trainer's heartbeat).
  interval (int): seconds between two lines (default 10).
  timeout (int): seconds to wait at most (default 3600); the task goes on in the background after that.

This file is found next to the playbooks (Ansible loads ``action_plugins/`` beside a playbook) and through
``action_plugins`` in ansible.cfg for the roles' tasks run on their own.
"""

from __future__ import annotations

import json
import re
import shlex
import time

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display
from ansible.utils.vars import merge_hash

display = Display()

# How often the task is checked at most, in seconds (a task that ends is noticed within this; each check reads the
# task's results file on the target with one shell command, and async_status runs once the task has ended).
CHECK_MAX = 3.0
# How much of the log's end is searched each time (a pip log is verbose; its newest matching line is near the end).
TAIL_BYTES = 65536
# Seconds any one remote command of the wait may take: the results file's `cat` runs under `timeout`, the
# progress module ends itself after READ_TIMEOUT.
CHECK_TIMEOUT = 10
READ_TIMEOUT = 20
NO_PROGRESS = {"size": None, "line": None, "heartbeat": None, "heartbeat_error": None, "log_error": None}


def human_bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def printable(text: str) -> str:
    """``text`` with every control character escaped (module_utils/dflash_host.printable: what reaches the screen is
    escaped on the target already; this is the controller's own guard)."""
    return "".join(c if c.isprintable() or c == "\t" else f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
                   for c in text)


def progress_args(log: str | None, pattern: str, heartbeat: str | None) -> dict:
    """The dflash_progress module's arguments."""
    args = {"pattern": pattern, "tail_bytes": TAIL_BYTES, "timeout": READ_TIMEOUT}
    if log:
        args["log"] = log
    if heartbeat:
        args["heartbeat"] = heartbeat
    return args


def parse_progress(result: dict) -> dict:
    """{'size', 'line', 'heartbeat', 'heartbeat_error', 'log_error'} of the dflash_progress module's result (a failed
    or odd result reads as nothing known yet)."""
    if not isinstance(result, dict) or result.get("failed"):
        return dict(NO_PROGRESS)
    out = {key: result.get(key) for key in NO_PROGRESS}
    beat = out["heartbeat"]
    if not (isinstance(beat, dict) and isinstance(beat.get("step"), int)):
        out["heartbeat"] = None
    if not isinstance(out["size"], int) or isinstance(out["size"], bool):
        out["size"] = None
    return out


def still_running(text: str) -> bool:
    """Whether an async results file's content is the async wrapper's mark of a running task (`started` and not
    `finished`); a finished task's file holds its module's result, which only async_status reads as Ansible does."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and bool(data.get("started")) and not data.get("finished")


# pip's --log lines start with a timestamp: 2026-12-04T01:10:00,123 Collecting ...
_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[,.]\d+\s+")


def describe(progress: dict, previous_size: int | None, has_log: bool, has_heartbeat: bool) -> str:
    """What is happening, in one line: the heartbeat's step, the log's growth and its newest line."""
    parts = []
    if has_heartbeat:
        beat = progress["heartbeat"]
        if beat is not None:
            parts.append(f"heartbeat step {beat.get('step', '?')} ({beat.get('status') or '?'})")
        elif "invalid heartbeat" in (progress.get("heartbeat_error") or ""):
            parts.append("invalid heartbeat")
        elif "not read" in (progress.get("heartbeat_error") or ""):
            parts.append("heartbeat not read (not a plain file of the trainer's)")
        else:
            parts.append("no heartbeat yet")
    if has_log:
        size = progress["size"]
        if progress.get("log_error"):
            parts.append(f"log {progress['log_error']}: not read")
        elif size is None:
            parts.append("no log yet")
        else:
            grew = "" if previous_size is None else f", +{human_bytes(size - previous_size)}"
            text = f"log {human_bytes(size)}{grew}"
            if progress["line"]:
                line = _TIMESTAMP.sub("", progress["line"])
                text += f": {line[:160]}{'...' if len(line) > 160 else ''}"
            parts.append(text)
    return printable("; ".join(parts))


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = True

    def _status(self, jid: str, async_dir: str, results_file: str, task_vars: dict) -> dict:
        result = self._execute_module(module_name="ansible.legacy.async_status", task_vars=task_vars,
                                      module_args={"jid": jid, "mode": "status", "_async_dir": async_dir})  # fmt: skip
        result = merge_hash({"ansible_job_id": jid, "results_file": results_file,
                             "started": True}, result)  # fmt: skip
        for key in ("started", "finished"):
            result[key] = bool(result.get(key))
        return result

    def _still_running(self, results_file: str) -> bool:
        """The background task's results file (root's, in its async dir) read by one shell command (a module run
        costs about 0.2 s of CPU on the target, `cat` a few ms), under `timeout`: True only while it reads as the
        async wrapper's "started, not finished"."""
        res = self._low_level_execute_command(f"timeout -k 2 {CHECK_TIMEOUT} cat {shlex.quote(results_file)}")
        return res.get("rc") == 0 and still_running(res.get("stdout", ""))

    def _progress(self, args: dict, task_vars: dict) -> dict:
        """The log's newest line and the heartbeat, read on the target by dflash_progress (it ends itself)."""
        result = self._execute_module(module_name="dflash_progress", module_args=args, task_vars=task_vars)
        return parse_progress(result)

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        _, args = self.validate_argument_spec(argument_spec={
            "jid": {"type": "str", "required": True},
            "what": {"type": "str", "required": True},
            "log": {"type": "str"},
            "pattern": {"type": "str", "default": r"\S"},
            "heartbeat": {"type": "str"},
            "interval": {"type": "int", "default": 10},
            "timeout": {"type": "int", "default": 3600},
        })  # fmt: skip
        if args["interval"] < 1 or args["timeout"] < 0:
            raise AnsibleActionFail("dflash_wait: interval must be >= 1 and timeout >= 0")
        host = task_vars.get("inventory_hostname", "?") if task_vars else "?"
        command = (progress_args(args["log"], args["pattern"], args["heartbeat"])
                   if args["log"] or args["heartbeat"] else None)  # fmt: skip

        async_dir = self._remote_expand_user(self.get_shell_option("async_dir", default="~/.ansible_async"))
        results_file = self._connection._shell.join_path(async_dir, args["jid"])
        start = time.monotonic()
        next_line = start + args["interval"]
        # Checked soon at first (a task that is nearly done ends the wait early), then every CHECK_MAX seconds.
        check_every = 1.0
        previous_size = None
        if command:
            previous_size = self._progress(command, task_vars)["size"]
        while True:
            # Polled cheaply; once the file reads otherwise (finished, failed, not there), async_status says what
            # it is and its result is this task's.
            if not self._still_running(results_file):
                status = self._status(args["jid"], async_dir, results_file, task_vars)
                if status["finished"] or status.get("failed"):
                    return merge_hash(result, status)
            now = time.monotonic()
            if now - start >= args["timeout"]:
                return merge_hash(result, {
                    "failed": True, "finished": False, "ansible_job_id": args["jid"],
                    "msg": f"gave up waiting for {args['what']} after {args['timeout']}s; it goes on in the "
                           f"background on {host} (async job {args['jid']})"})  # fmt: skip
            if now >= next_line:
                text = f"[{printable(host)}] {now - start:.0f}s waiting for {printable(args['what'])}"
                if command:
                    progress = self._progress(command, task_vars)
                    detail = describe(progress, previous_size, bool(args["log"]), bool(args["heartbeat"]))
                    previous_size = progress["size"] if progress["size"] is not None else previous_size
                    text += f": {detail}" if detail else ""
                display.display(text)
                while next_line <= time.monotonic():
                    next_line += args["interval"]
            time.sleep(max(0.0, min(check_every, next_line - time.monotonic())))
            check_every = min(check_every * 2, CHECK_MAX, float(args["interval"]))
