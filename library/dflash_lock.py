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
  - The lock records O(controller), the deploy's process on the controller. The action plugin of the same name
    (playbooks/action_plugins/dflash_lock.py) fills it in, asks first with O(wait=false), and when the lock's
    holder is a process of this controller that is gone (a deploy killed by Ctrl-C or SIGKILL) takes the lock over
    (O(take_over)) with a line saying so; otherwise it prints who holds the lock and that it waits.
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
  wait:
    description: V(false) returns at once with C(acquired=false) and the holder's record (C(held)) when another owner holds it.
    type: bool
    default: true
  take_over:
    description: The owner token of a lock whose holder is gone; that lock is broken and taken at once.
    type: str
    default: ""
  controller:
    description: The deploy's process on the controller (host, boot_id, pid, start), written into the lock.
    type: dict
    default: {}
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
  description: The stale lock that was broken or taken over (owner, holder, since, controller), or null.
  returned: when acquiring
  type: dict
acquired:
  description: Whether this run holds the lock now (false only with O(wait=false)).
  returned: when acquiring
  type: bool
held:
  description: The other owner's lock record (owner, holder, since, controller) when O(wait=false) did not take it.
  returned: when acquiring with O(wait=false) and another owner holds it
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.dflash_host import ModuleHost
from ansible.module_utils.dflash_lock import LockBusy, LockError, acquire, read_lock, release


def main():
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "state": {"type": "str", "default": "acquired", "choices": ["acquired", "released"]},
            "owner": {"type": "str", "required": True, "no_log": False},
            "holder": {"type": "str", "default": ""},
            "timeout": {"type": "int", "default": 600},
            "stale_after": {"type": "int", "default": 3600},
            "wait": {"type": "bool", "default": True},
            "take_over": {"type": "str", "default": "", "no_log": False},
            "controller": {"type": "dict", "default": {}},
        },
        supports_check_mode=True,
    )
    p = module.params
    holder = p["holder"] or p["owner"]
    if module.check_mode:
        held = read_lock(p["path"])
        module.exit_json(changed=False, held_by=held["holder"] if held else None, waited_s=0.0, broken=None,
                         acquired=False, held=held if held and held["owner"] != p["owner"] else None)
    if p["state"] == "released":
        changed, other = release(p["path"], p["owner"])
        if other:
            module.warn(f"lock {p['path']} is held by {other['holder']}, not by this run: left alone")
        module.exit_json(changed=changed, held_by=other["holder"] if other else None)
    try:
        changed, waited, broken = acquire(p["path"], p["owner"], holder, p["timeout"], p["stale_after"], ModuleHost(module),
                                          wait=p["wait"], take_over=p["take_over"] or None, controller=p["controller"])
    except LockBusy as exc:
        module.exit_json(changed=False, acquired=False, held_by=exc.held["holder"], held=exc.held, waited_s=0.0, broken=None)
    except LockError as exc:
        module.fail_json(msg=str(exc))
    except OSError as exc:
        module.fail_json(msg=f"cannot take the lock {p['path']}: {exc}")
    if broken and broken["owner"] != p["take_over"]:
        module.warn(f"broke the stale lock {p['path']} of {broken['holder']} (older than {p['stale_after']}s)")
    module.exit_json(changed=changed, acquired=True, held_by=holder, waited_s=waited, broken=broken)


if __name__ == "__main__":
    main()
