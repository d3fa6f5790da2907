#!/usr/bin/python
# Copyright: dflash authors
# Apache-2.0

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_logs
short_description: Read a training job's log - the last lines, or the lines appended since a byte offset
description:
  - Read-only. Returns whole lines only and C(next_offset) just after the last one, so a line still being written is
    returned whole by the next read; pass C(next_offset) back as O(offset) to follow the log.
  - An O(offset) past the end of the file means the log was truncated (rotated); it is then read from the start.
  - Carriage-return redraws (progress bars) are reduced to their last state.
version_added: "0.3.0"
author: dflash authors
options:
  path:
    description: The job's log file. A missing file is not an error (C(exists=false)).
    type: path
    required: true
  offset:
    description: Byte offset to read from (the previous read's C(next_offset)); negative = the last O(lines) lines.
    type: int
    default: -1
  lines:
    description: Lines returned when O(offset) is negative.
    type: int
    default: 40
  max_bytes:
    description: At most this many bytes per read; a follow catches up over several reads.
    type: int
    default: 1048576
extends_documentation_fragment:
  - dflash.read_only
"""

EXAMPLES = r"""
- name: The last 100 lines of the job's log
  dflash_logs:
    path: /var/log/dflash/dflash-train.log
    lines: 100

- name: What was appended since the last read
  dflash_logs:
    path: /var/log/dflash/dflash-train.log
    offset: "{{ previous.next_offset }}"
"""

RETURN = r"""
path:
  description: The file read.
  returned: always
  type: str
exists:
  description: Whether the file exists.
  returned: always
  type: bool
size:
  description: Its size in bytes at the read.
  returned: always
  type: int
next_offset:
  description: Byte offset just after the last returned line; where the next follow read starts.
  returned: always
  type: int
lines:
  description: The lines read, oldest first, without line ends.
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.dflash_logs import read_log

ARGUMENT_SPEC = {
    "path": {"type": "path", "required": True},
    "offset": {"type": "int", "default": -1},
    "lines": {"type": "int", "default": 40},
    "max_bytes": {"type": "int", "default": 1048576},
}


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    if p["max_bytes"] < 1 or p["lines"] < 0:
        module.fail_json(msg=f"max_bytes={p['max_bytes']} must be at least 1 and lines={p['lines']} zero or more")
    try:
        result = read_log(p["path"], p["offset"], p["lines"], p["max_bytes"])
    except OSError as exc:
        module.fail_json(msg=f"cannot read the log {p['path']}: {exc}")
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
