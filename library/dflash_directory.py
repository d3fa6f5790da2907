#!/usr/bin/python
# Copyright: dflash authors
# Apache-2.0

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_directory
short_description: Create a directory and set its owner and mode without following a link another account made
description:
  - Like M(ansible.builtin.file) with C(state=directory), for paths that an unprivileged account can write (the
    trainer owns its run directory and its home). The path is resolved one component at a time with C(O_NOFOLLOW)
    - a symbolic link is followed only when root owns it; a link owned by any other account, anywhere in the
    path, fails the task naming it and the fix, and nothing is created or changed. Root therefore never chowns or
    writes a directory that the trainer pointed its run directory at.
  - Missing components are created (root's, mode 0755) under their parent's file descriptor; an existing path
    that is not a directory (a file, a FIFO) fails the task. Owner, group and mode are set on the opened
    directory (C(fchown), C(fchmod)), never by path.
  - O(probe) writes a small file into the directory through its descriptor (a link at that name is replaced,
    never followed) and returns what the file held before; O(read_probe) only reads it (regular files only).
version_added: "0.4.0"
author: dflash authors
options:
  path:
    description: The directory (absolute).
    type: path
    required: true
  owner:
    description: Its owner (a user name).
    type: str
    default: root
  group:
    description: Its group (a group name); the owner's primary group when omitted.
    type: str
  mode:
    description: Its mode, an octal string such as C("0755").
    type: str
    default: "0755"
  probe:
    description: Content to write to C(.shared-storage-probe) in the directory (root's, 0644).
    type: str
  read_probe:
    description: Return the content of C(.shared-storage-probe) in the directory as RV(probe).
    type: bool
    default: false
attributes:
  check_mode:
    support: full
    description: Checks the path and reports what would change; creates and changes nothing.
  diff_mode:
    support: none
    description: No diff.
"""

EXAMPLES = r"""
- name: Create the run directory, the trainer's
  dflash_directory:
    path: /var/lib/dflash/runs/dflash-train
    owner: dflash
    mode: "0755"
"""

RETURN = r"""
path:
  description: The directory.
  returned: always
  type: str
probe:
  description: The probe's content (O(read_probe)), or null when there is none.
  returned: when O(read_probe)
  type: str
"""

import grp
import os
import pwd
import stat

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.dflash_host import (
    UnsafeFile,
    file_kind,
    open_directory_nofollow,
    printable,
    write_atomic,
)

PROBE = ".shared-storage-probe"
PROBE_LIMIT = 4096  # a deploy's token: read no more of it
FIX = ("root does not follow it. Remove it (a real directory is created in its place) or point the variable at a "
       "real directory, then run again")


def _read_probe(dir_fd):
    try:
        fd = os.open(PROBE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UnsafeFile(f"{PROBE} cannot be read ({exc.strerror}): it must be a plain file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{PROBE} is not a regular file")
        if st.st_nlink > 1:
            raise UnsafeFile(f"{PROBE} has {st.st_nlink} hard links, which root does not read")
        text = os.read(fd, PROBE_LIMIT).decode("utf-8", "replace")
        # compared with node 0's token (one line); what else the trainer may have put there is escaped
        return printable(text.removesuffix("\n")) + ("\n" if text.endswith("\n") else "")
    finally:
        os.close(fd)


def _write_probe(dir_fd, content):
    # in the directory's fd: a link at the temp name or at PROBE is replaced, never followed
    write_atomic(PROBE, content, 0o644, tmp_name=f"{PROBE}.{os.getpid()}.tmp", dir_fd=dir_fd)


def main():
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "owner": {"type": "str", "default": "root"},
            "group": {"type": "str"},
            "mode": {"type": "str", "default": "0755"},
            "probe": {"type": "str"},
            "read_probe": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    p = module.params
    path = p["path"]
    if not os.path.isabs(path):
        module.fail_json(msg=f"path {path!r} must be absolute")
    try:
        mode = int(p["mode"], 8)
        pw = pwd.getpwnam(p["owner"])
        gid = grp.getgrnam(p["group"]).gr_gid if p["group"] else pw.pw_gid
    except ValueError:
        module.fail_json(msg=f"mode {p['mode']!r} is not an octal mode such as '0755'")
    except KeyError as exc:
        module.fail_json(msg=f"{exc.args[0]}: no such user or group on this host")
    result = {"changed": False, "path": path}
    try:
        try:
            fd, created = open_directory_nofollow(path, create=not module.check_mode)
        except FileNotFoundError:  # check mode: it would be created
            module.exit_json(changed=True, path=path, probe=None)
        try:
            st = os.fstat(fd)
            if not stat.S_ISDIR(st.st_mode):
                module.fail_json(msg=f"{path} is not a directory ({file_kind(st.st_mode)})")
            result["changed"] = created or (st.st_uid, st.st_gid) != (pw.pw_uid, gid) or stat.S_IMODE(st.st_mode) != mode
            if not module.check_mode:
                if (st.st_uid, st.st_gid) != (pw.pw_uid, gid):
                    os.fchown(fd, pw.pw_uid, gid)
                if stat.S_IMODE(st.st_mode) != mode:
                    os.fchmod(fd, mode)
                if p["probe"] is not None:
                    _write_probe(fd, p["probe"])
            if p["read_probe"]:
                result["probe"] = _read_probe(fd)
        finally:
            os.close(fd)
    except UnsafeFile as exc:
        reason = str(exc)
        fix = FIX if "symbolic link" in reason else "root creates a directory there: remove what is there or choose another path"
        module.fail_json(msg=f"refusing {path}: {reason}; {fix}", path=path)
    except OSError as exc:
        module.fail_json(msg=f"cannot create {path}: {exc}", path=path)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
