#!/usr/bin/python
# Copyright: dflash authors
# Apache-2.0

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_lock
short_description: Hold a per-job lock on the managed host across several tasks
description:
  - V(acquired) creates O(path) exclusively (C(O_EXCL)) with the O(owner) token, the O(holder) description and the
    time; if another owner holds it, waits up to O(timeout) seconds, then fails naming the holder and how to clear a
    lock that a killed run left behind. A lock older than O(stale_after) seconds is broken with a warning.
  - V(released) removes O(path) if O(owner) holds it; someone else's lock is left alone (with a warning).
  - Taking a lock that O(owner) already holds changes nothing, so a play may acquire it twice.
  - Keep O(path) on a tmpfs such as C(/run) so that a reboot clears it.
version_added: "0.2.0"
author: dflash authors
options:
  path:
    description: The lock file.
    type: path
    required: true
  state:
    description: Whether the lock should be held (V(acquired)) or not (V(released)).
    type: str
    choices: [acquired, released]
    default: acquired
  owner:
    description: A token unique to the run holding the lock (for example one per play and host).
    type: str
    required: true
  holder:
    description: Who holds it, for the message another run shows while it waits.
    type: str
    default: ""
  timeout:
    description: Seconds to wait for another owner's lock.
    type: int
    default: 600
  stale_after:
    description: Seconds after which a lock counts as left behind by a killed run and is broken.
    type: int
    default: 3600
attributes:
  check_mode:
    support: full
    description: Reports whether the lock is free; takes and removes nothing.
  diff_mode:
    support: none
    description: No diff.
"""

EXAMPLES = r"""
- name: Take the deploy lock of the job
  dflash_lock:
    path: /run/dflash/dflash-train.deploy.lock
    owner: "{{ _deploy_token }}"
    holder: "ansible on {{ lookup('ansible.builtin.pipe', 'hostname') }}"
    timeout: 900

- name: Release it
  dflash_lock:
    path: /run/dflash/dflash-train.deploy.lock
    owner: "{{ _deploy_token }}"
    state: released
"""

RETURN = r"""
held_by:
  description: The lock's holder after the call (O(holder) once acquired), or null when free.
  returned: always
  type: str
waited_s:
  description: Seconds spent waiting for another owner's lock.
  returned: when acquiring
  type: float
broken:
  description: The stale lock that was broken (owner, holder, since), or null.
  returned: when acquiring
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.dflash_host import ModuleHost
from ansible.module_utils.dflash_lock import LockError, acquire, read_lock, release


def main():
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "state": {"type": "str", "default": "acquired", "choices": ["acquired", "released"]},
            "owner": {"type": "str", "required": True, "no_log": False},
            "holder": {"type": "str", "default": ""},
            "timeout": {"type": "int", "default": 600},
            "stale_after": {"type": "int", "default": 3600},
        },
        supports_check_mode=True,
    )
    p = module.params
    holder = p["holder"] or p["owner"]
    if module.check_mode:
        held = read_lock(p["path"])
        module.exit_json(changed=False, held_by=held["holder"] if held else None, waited_s=0.0, broken=None)
    if p["state"] == "released":
        changed, other = release(p["path"], p["owner"])
        if other:
            module.warn(f"lock {p['path']} is held by {other['holder']}, not by this run: left alone")
        module.exit_json(changed=changed, held_by=other["holder"] if other else None)
    try:
        changed, waited, broken = acquire(p["path"], p["owner"], holder, p["timeout"], p["stale_after"], ModuleHost(module))
    except LockError as exc:
        module.fail_json(msg=str(exc))
    except OSError as exc:
        module.fail_json(msg=f"cannot take the lock {p['path']}: {exc}")
    if broken:
        module.warn(f"broke the stale lock {p['path']} of {broken['holder']} (older than {p['stale_after']}s)")
    module.exit_json(changed=changed, held_by=holder, waited_s=waited, broken=broken)


if __name__ == "__main__":
    main()
