# Copyright: dflash authors
# Apache-2.0
"""What a job leaves in its root-only state directory and how its state is reported: the systemd-style status
dict, the exit status and the events of every end, the restart facts read from them.
"""

from __future__ import annotations

import os
import signal
import stat as stat_module

from ansible.module_utils.dflash_failures import class_of_exit
from ansible.module_utils.dflash_host import UnsafeFile, file_kind, open_directory_nofollow, read_text
from ansible.module_utils.dflash_unit_spec import DEFAULT_STATE_ROOT, UnitError

RUNNING_STATES = ("active", "activating", "deactivating", "reloading")
# The job's desired state, recorded in its state directory at every launch and stop (`desired`): a job stopped on
# purpose stays stopped across a restart of its container; one meant to run is launched again at boot.
RUNNING, STOPPED = "running", "stopped"
DESIRED_FILE = "desired"


def check_root_owned(path):
    """Refuse a state directory that a non-root account could replace: every existing directory from ``path``
    up to ``/`` must belong to root (or to the account running this) and be writable by nobody else, unless it
    is sticky (like /tmp, where others cannot rename what is ours)."""
    me = os.getuid()
    current = os.path.abspath(path)
    while True:
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            st = None
        if st is not None:
            if stat_module.S_ISLNK(st.st_mode):
                raise UnitError(f"state_dir {path!r}: {current} is a symbolic link; use a real directory owned by root")
            foreign = st.st_uid not in (0, me)
            shared = st.st_mode & 0o022 and not (current != os.path.abspath(path) and st.st_mode & stat_module.S_ISVTX)
            if foreign or shared:
                raise UnitError(
                    f"state_dir {path!r}: {current} is owned by uid {st.st_uid} with mode {stat_module.S_IMODE(st.st_mode):o}; "
                    "root keeps the unit's state there, so only root may write it: use a root-owned directory "
                    f"(default {DEFAULT_STATE_ROOT}/NAME), not one under the trainer account's home"
                )
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent


def check_log_path(path):
    """Root's unit appends the job's output to ``path`` (systemd's ``StandardOutput=append:`` follows a link; the
    daemon's supervisor opens it as root): its directory must be root's, reached through no link of another
    account and writable by no other account (else the trainer could put a link there), and the file, when it
    exists, a regular file with one link. Both backends check it before every start."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, _created = open_directory_nofollow(directory)
    except FileNotFoundError:
        return  # created by the backend's start, root's
    except UnsafeFile as exc:
        raise UnitError(f"log_path {path}: {exc.reason}; root's unit appends the job's output there: use a directory "
                        "of root's (the job role creates it, 0755)") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid not in (0, os.getuid()) or st.st_mode & 0o022:
        who = f"owned by uid {st.st_uid}" if st.st_uid not in (0, os.getuid()) else \
            f"writable by other accounts (mode {stat_module.S_IMODE(st.st_mode):o})"
        raise UnitError(f"log_path {path}: its directory {directory} is {who}: another account (the trainer's) could "
                        "replace the log by a link that root's unit appends through; make the directory root's and "
                        "writable by root only (the job role creates it so), or choose another log_path")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat_module.S_ISREG(st.st_mode):
        raise UnitError(f"log_path {path} is not a regular file ({file_kind(st.st_mode)}): root appends the job's "
                        "output there and does not write through it; remove it or choose another log_path")
    if st.st_nlink > 1:
        raise UnitError(f"log_path {path} has {st.st_nlink} hard links: root appends the job's output there and would "
                        "write into the other file too; remove it or choose another log_path")


def make_state_dir(path):
    check_root_owned(path)
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    check_root_owned(path)


def remove_files(directory, names):
    """Remove these files of ``directory`` where they exist (the records of an earlier launch)."""
    for name in names:
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass


def empty_status():
    return {
        "load_state": "not-found",
        "active_state": "inactive",
        "sub_state": "dead",
        "main_pid": None,
        "exit_status": None,
        "result": None,
        "restarts": None,
    }


def is_running(status):
    return status["active_state"] in RUNNING_STATES


def parse_exit_status(text):
    """``N`` (daemon supervisor) or systemd's ``$EXIT_CODE $EXIT_STATUS`` (``exited 3``, ``killed TERM``)
    as a shell-style status: the exit code, or 128+N for a signal. None when unknown."""
    words = (text or "").split()
    if len(words) == 1 and words[0].lstrip("-").isdigit():
        return int(words[0])
    if len(words) == 2 and words[0] == "exited" and words[1].isdigit():
        return int(words[1])
    if len(words) == 2 and words[0] in ("killed", "dumped"):
        name = words[1].upper()
        if name.isdigit():
            return 128 + int(name)
        try:
            return 128 + int(signal.Signals["SIG" + name.removeprefix("SIG")])
        except KeyError:
            return None
    return None


def read_exit_status(state_dir):
    return parse_exit_status(read_text(os.path.join(state_dir, "exit_status"), ""))


def write_exit_status(host, state_dir, value):
    os.makedirs(state_dir, exist_ok=True)
    host.atomic_write(os.path.join(state_dir, "exit_status"), f"{int(value)}\n")


def read_desired(state_dir):
    """``running``, ``stopped``, or None (never recorded: a job of an earlier release, or none)."""
    value = (read_text(os.path.join(state_dir, DESIRED_FILE), "") or "").strip()
    return value if value in (RUNNING, STOPPED) else None


# A deploy that can roll a new launch back holds the failure hook for the launch's start window (dflash_unit's
# hook_hold): the file holds the deadline (epoch seconds); the hook does not run before it. The rollback's own
# launch, any launch without hook_hold, and the deploy once the launch trains, lift it; the deadline ends the hold
# of a deploy that was killed.
HOOK_HOLD_FILE = "hook-hold"


def set_hook_hold(host, state_dir, seconds, now=None):
    """Hold the failure hook for ``seconds`` from now (``seconds`` <= 0: lift any hold)."""
    import time

    path = os.path.join(state_dir, HOOK_HOLD_FILE)
    if seconds and seconds > 0:
        host.atomic_write(path, f"{int((now or time.time()) + seconds)}\n", mode=0o600)
    elif os.path.lexists(path):
        os.unlink(path)


def write_desired(host, state_dir, value):
    if value not in (RUNNING, STOPPED):
        raise UnitError(f"desired state {value!r} is not one of {RUNNING}, {STOPPED}")
    host.atomic_write(os.path.join(state_dir, DESIRED_FILE), value + "\n", mode=0o600)


def read_events(state_dir):
    """The ends recorded since the launch: [{time, result, exit}] (oldest first)."""
    events = []
    for line in (read_text(os.path.join(state_dir, "events"), "") or "").splitlines():
        words = line.split()
        if len(words) >= 2 and words[0].isdigit():
            events.append({"time": int(words[0]), "result": words[1], "exit": " ".join(words[2:]) or None})
    return events


def add_restart_facts(status, state_dir):
    """restarts, watchdog_kills, last_exit_reason, crash_loop (restarts exhausted) and failure_class of a status dict."""
    events = read_events(state_dir)
    if status.get("restarts") is None:
        status["restarts"] = 0
    status["watchdog_kills"] = sum(1 for e in events if e["result"] == "watchdog")
    last = next((e for e in reversed(events) if e["result"] != "success"), None)
    status["last_exit_reason"] = f"{last['result']} ({last['exit']})" if last else None
    status["crash_loop"] = bool(status["active_state"] == "failed" and status.get("restarts"))
    # the class of the last end when it failed (module_utils/dflash_failures.py; a stop's SIGTERM is a success)
    latest = events[-1] if events else None
    status["failure_class"] = None
    if latest is not None and latest["result"] != "success":
        status["failure_class"] = class_of_exit(parse_exit_status(latest["exit"]))
    elif latest is None and not is_running(status) and status.get("exit_status") not in (None, 0, 143):
        status["failure_class"] = class_of_exit(status["exit_status"])
    return status
