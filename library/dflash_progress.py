#!/usr/bin/python
# Copyright: dflash authors
# Apache-2.0

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_progress
short_description: What a background task is doing - the newest matching line of a log and the trainer's step
description:
  - Read-only. What the dflash_wait action (playbooks/action_plugins) shows every O(interval) seconds while it waits
    for a background task - the log's size and newest line matching O(pattern), and the heartbeat's step and status.
  - Both files are read as root reads every file the trainer account may write (module_utils/dflash_untrusted.py) -
    no link another account made is followed, a FIFO or device is never waited on, a file with more than one hard link
    is refused, at most O(tail_bytes) of the log and 64 KiB of the heartbeat are read, the heartbeat's fields are
    type-checked (a file of the wrong shape is an C(invalid heartbeat), said in RV(heartbeat_error)), and control
    characters are escaped.
  - Ends itself after O(timeout) seconds whatever it waits for.
version_added: "0.4.0"
author: dflash authors
options:
  log:
    description: A log on the target (pip's C(--log), a job's log). A missing file is not an error (RV(size) null).
    type: path
  pattern:
    description: A regular expression a line of O(log) must match to be returned (a carriage return ends a line too).
    type: str
    default: \S
  heartbeat:
    description: The trainer's heartbeat file (C(RUN_DIR/heartbeat.json)).
    type: path
  tail_bytes:
    description: How much of the log's end is searched.
    type: int
    default: 65536
  timeout:
    description: Seconds after which the module ends itself (SIGALRM).
    type: int
    default: 20
extends_documentation_fragment:
  - dflash.read_only
"""

EXAMPLES = r"""
- name: What the job is doing
  dflash_progress:
    log: /var/log/dflash/dflash-train.log
    heartbeat: /var/lib/dflash/runs/dflash-train/heartbeat.json
"""

RETURN = r"""
size:
  description: The log's size in bytes, null when it is missing or not read.
  returned: always
  type: int
line:
  description: Its newest line matching O(pattern) (control characters escaped), or null.
  returned: always
  type: str
log_error:
  description: Why the log was not read (C(is not a regular file (fifo))), or null.
  returned: always
  type: str
heartbeat:
  description: The heartbeat's C(step) and C(status), or null (missing, not read or invalid).
  returned: always
  type: dict
heartbeat_error:
  description: Why there is no heartbeat (missing, not read, or an C(invalid heartbeat) and what is wrong with it), or null.
  returned: always
  type: str
"""

import re
import signal

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.dflash_host import unread
from ansible.module_utils.dflash_untrusted import newest_line, read_heartbeat

ARGUMENT_SPEC = {
    "log": {"type": "path"},
    "pattern": {"type": "str", "default": r"\S"},
    "heartbeat": {"type": "path"},
    "tail_bytes": {"type": "int", "default": 65536},
    "timeout": {"type": "int", "default": 20},
}


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    if p["timeout"] > 0:
        signal.alarm(p["timeout"])  # nothing here waits, but a remote command never runs unbounded
    try:
        re.compile(p["pattern"])
    except re.error as exc:
        module.fail_json(msg=f"pattern {p['pattern']!r} is not a regular expression: {exc}")
    result = {"size": None, "line": None, "log_error": None, "heartbeat": None, "heartbeat_error": None}
    if p["log"]:
        try:
            result["size"], result["line"] = newest_line(p["log"], p["pattern"], max(1, p["tail_bytes"]))
        except OSError as exc:  # UnsafeFile among them
            result["log_error"] = unread(exc)
    if p["heartbeat"]:
        beat, result["heartbeat_error"] = read_heartbeat(p["heartbeat"])
        if beat is not None:
            result["heartbeat"] = {"step": beat["step"], "status": beat.get("status")}
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
