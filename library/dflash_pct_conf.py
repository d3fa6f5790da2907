#!/usr/bin/python
# Copyright: dflash authors
# Apache-2.0

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_pct_conf
short_description: Keep raw lxc.* lines in a Proxmox container config without chmod (pmxcfs-safe)
description:
  - Makes the main section of O(path) (C(/etc/pve/lxc/VMID.conf)) carry exactly O(lines) among the raw
    C(lxc.*) lines that match one of the O(owned) regular expressions; other keys, other raw lines, the
    C([pve:pending]) section and snapshots are kept as they are.
  - Writes a temp file beside O(path) and renames it, never changing a mode or owner, because pmxcfs
    (C(/etc/pve)) refuses chmod and chown with EPERM, which makes C(lineinfile) and C(copy) fail there.
  - Use C(pct set) for every option Proxmox has (C(devN), C(mpN), C(features), ...); this module is for the
    raw lines Proxmox has no option for (C(lxc.cgroup2.*), C(lxc.mount.entry), C(lxc.prlimit.*)).
  - Takes PVE's per-container config lock (the flock of C(PVE::LXC::Config->lock_config),
    C(LOCK_DIR/pve-config-VMID.lock)) around the read, merge and rename, so a backup, a GUI edit or a C(pct)
    command at the same moment cannot lose this write or have its own lost.
  - A config with a C(lock:) line (a backup, a migration, a snapshot in progress) is not changed; the module
    waits up to O(locked_wait) seconds for the line to go, then fails naming the lock and the fix.
  - Raw lines take effect at the next container start.
version_added: "0.3.0"
author: dflash authors
options:
  path:
    description: The container's config file; it must exist (the container was created).
    type: path
    required: true
  lines:
    description: >-
      The wanted raw lines, C(lxc.KEY: VALUE); C(lxc.KEY = VALUE) is accepted and written with a colon.
    type: list
    elements: str
    default: []
  owned:
    description: >-
      Regular expressions, searched in C(lxc.KEY: VALUE), of the raw lines this task owns; an owned line
      not in O(lines) is removed.
    type: list
    elements: str
    default: []
  lock_dir:
    description: Where PVE keeps its container config locks.
    type: path
    default: /run/lock/lxc
  lock_timeout:
    description: Seconds to wait for PVE's config lock (PVE's own default is 10).
    type: float
    default: 10
  locked_wait:
    description: Seconds to wait for a C(lock:) line in the config (a backup in progress) to go away.
    type: float
    default: 60
attributes:
  check_mode:
    support: full
    description: Reports the change and its diff without writing.
  diff_mode:
    support: full
    description: Before/after of the whole file.
"""

EXAMPLES = r"""
- name: Legacy GPU passthrough lines for container 200
  dflash_pct_conf:
    path: /etc/pve/lxc/200.conf
    lines:
      - "lxc.cgroup2.devices.allow: c 195:0 rw"
      - "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file"
    owned:
      - '^lxc\.cgroup2\.devices\.allow: c 195:'
      - '^lxc\.mount\.entry: /dev/nvidia'
"""

RETURN = r"""
lines:
  description: The raw lines the main section now carries among the owned ones (the desired ones).
  returned: always
  type: list
  elements: str
"""

import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.dflash_pve import (
    ConfigLocked,
    config_lock,
    lock_of,
    merge_raw_lines,
    vmid_of,
    write_content,
)


def update(module, path):
    """(before, after, changed) under PVE's config lock, or fail: a `lock:` line that stays, a lock held too long."""
    params = module.params
    deadline = time.monotonic() + params["locked_wait"]
    vmid = vmid_of(path)
    while True:
        with config_lock(vmid, params["lock_timeout"], params["lock_dir"]):
            with open(path, encoding="utf-8") as f:
                before = f.read()
            held = lock_of(before)
            if not held:
                try:
                    after = merge_raw_lines(before, params["lines"], params["owned"])
                except ValueError as exc:
                    module.fail_json(msg=f"{path}: {exc}")
                changed = after != before
                if changed and not module.check_mode:
                    write_content(path, after)
                return before, after, changed
        if time.monotonic() >= deadline:
            raise ConfigLocked(
                f"container {vmid} is locked ({held}) by a task in progress: nothing was changed. Run again when "
                f"it ends; if no task holds it any more (a failed backup), remove the lock with `pct unlock {vmid}`"
            )
        time.sleep(1)


def main():
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "lines": {"type": "list", "elements": "str", "default": []},
            "owned": {"type": "list", "elements": "str", "default": []},
            "lock_dir": {"type": "path", "default": "/run/lock/lxc"},
            "lock_timeout": {"type": "float", "default": 10},
            "locked_wait": {"type": "float", "default": 60},
        },
        supports_check_mode=True,
    )
    path = module.params["path"]
    if not os.path.isfile(path):
        module.fail_json(msg=f"{path} does not exist: create the container first (pct create), or fix the path")
    try:
        before, after, changed = update(module, path)
    except ConfigLocked as exc:
        module.fail_json(msg=str(exc))
    except OSError as exc:
        module.fail_json(msg=f"could not write {path}: {exc}")
    module.exit_json(
        changed=changed,
        lines=module.params["lines"],
        diff={"before": before, "after": after, "before_header": path, "after_header": path},
    )


if __name__ == "__main__":
    main()
