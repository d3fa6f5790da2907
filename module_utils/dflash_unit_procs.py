# Copyright: dflash authors
# Apache-2.0
"""A job's processes, known by identity (recorded start time and the job's environment marker), never by name.
"""

from __future__ import annotations

import os

from ansible.module_utils.dflash_host import read_text


def proc_stat_fields(pid):
    """The fields of ``/proc/PID/stat`` after the command name (state, ppid, pgrp, ...), or None."""
    text = read_text(f"/proc/{int(pid)}/stat")
    if not text:
        return None
    return text[text.rfind(")") + 2 :].split()


def proc_stat(pid):
    """(state, pgrp, starttime) of a live /proc entry, or None."""
    fields = proc_stat_fields(pid)
    if not fields:
        return None
    try:
        return fields[0], int(fields[2]), int(fields[19])
    except (IndexError, ValueError):
        return None


def pid_alive(pid):
    if not pid:
        return False
    stat = proc_stat(int(pid))
    return stat is not None and stat[0] not in ("Z", "X")


def _environ_has(pid, marker):
    try:
        with open(f"/proc/{int(pid)}/environ", "rb") as handle:
            return marker in handle.read().split(b"\0")
    except OSError:
        return False


def job_processes(record):
    """Live (non-zombie) processes of the job described by a daemon pidfile ``record``.

    Every process must carry the job's DFLASH_UNIT_ID marker in its environment (inherited by all
    descendants, also those that left the process group), and the leader also the recorded start
    time. A recycled pid or process-group number, or a record naming some other process, therefore
    never matches, and nothing is ever matched by name.
    """
    marker = ("DFLASH_UNIT_ID=" + record["token"]).encode() if record.get("token") else None
    leader = int(record["pid"])
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        stat = proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            continue
        if pid == leader:
            # Identity, not just a number: the recorded start time and the job's own marker.
            if stat[2] == record.get("starttime") and marker is not None and _environ_has(pid, marker):
                found.append(pid)
        elif marker is not None and pid != os.getpid() and _environ_has(pid, marker):
            found.append(pid)
    return sorted(found)
