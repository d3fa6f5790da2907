# Copyright: dflash authors
# Apache-2.0
"""Lifecycle of a named training job: a systemd transient unit, or a daemon where systemd is absent.

Used by the dflash_unit module (start/stop/restart) and the dflash_health module (status).
Every function takes a ``host`` (see dflash_host) so the logic runs unchanged in tests.
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import json
import os
import pwd
import re
import shutil
import signal
import stat as stat_module
import sys
import uuid

from ansible.module_utils import dflash_supervisor
from ansible.module_utils.dflash_gpu import GpuQueryError, gpus_above, query_gpus
from ansible.module_utils.dflash_host import read_text, tail_lines

# Root's own: outside the trainer account's home (/var/lib/dflash), which that account could rewrite.
DEFAULT_STATE_ROOT = "/var/lib/dflash-units"
# Job names become unit names, file names and systemd words: nothing a shell or systemd would interpret.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
# Paths that go into unit properties: no spaces, quotes, '$', '%', ';', '`' or newlines.
PATH_PATTERN = re.compile(r"^/[A-Za-z0-9_./+:@-]*$")
ENV_KEY_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RUNNING_STATES = ("active", "activating", "deactivating", "reloading")
ACTIONS = ("none", "started", "restarted", "stopped", "removed")

class UnitError(Exception):
    pass


# --------------------------------------------------------------------------- spec and hash


def check_name(name):
    """A job name is letters, digits, '-' and '_' (at most 64, starting with a letter or digit)."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise UnitError(
            f"name {name!r} is not a valid job name: use 1-64 letters, digits, '-' or '_', starting with a letter or digit"
        )
    return name


def check_path(what, path):
    """An absolute path of plain characters (it is written into unit properties)."""
    if path is None:
        return None
    if not PATH_PATTERN.match(path) or "/../" in path + "/" or "\n" in path:
        raise UnitError(
            f"{what} {path!r} must be an absolute path of letters, digits and '_./+:@-' "
            "(no spaces, quotes, '$', '%' or '..'): choose another path"
        )
    return path


def unit_name(name):
    return name if name.endswith(".service") else name + ".service"


def default_state_dir(name):
    return os.path.join(DEFAULT_STATE_ROOT, name)


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


def remove_files(directory, names):
    """Remove these files of ``directory`` where they exist (the records of an earlier launch)."""
    for name in names:
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass


def make_state_dir(path):
    check_root_owned(path)
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    check_root_owned(path)


def quote_env_value(value):
    """``value`` as a double-quoted EnvironmentFile= value that systemd and parse_environment_file read back
    unchanged. A newline cannot be written safely: refuse it."""
    value = str(value)
    if "\n" in value or "\r" in value or "\0" in value:
        raise UnitError("environment values must be one line (no newline or NUL)")
    return '"' + re.sub(r'([\\"$`])', r"\\\1", value) + '"'


def environment_file_text(environment):
    lines = []
    for key, value in sorted((environment or {}).items()):
        if not ENV_KEY_PATTERN.match(key):
            raise UnitError(f"environment variable name {key!r} is not valid: use letters, digits and '_'")
        try:
            lines.append(f"{key}={quote_env_value(value)}")
        except UnitError:
            raise UnitError(f"environment variable {key}: the value must be one line (no newline or NUL)") from None
    return "".join(line + "\n" for line in lines)


def parse_environment_file(text):
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them (comments, quotes)."""
    env = {}
    for raw in (text or "").splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        key, sep, value = line.partition("=")
        if not sep:
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = re.sub(r'\\([\\"$`])', r"\1", value[1:-1])  # the escapes systemd reads in double quotes
        elif len(value) >= 2 and value[0] == value[-1] == "'":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def config_hash(command, environment=None, environment_file_text=None, config_text=None, working_directory=None, user=None,
                supervision=None):
    """Identity of a launch: what the process would see and how it is supervised. Same hash + running = leave it alone."""
    document = {
        "command": list(command or []),
        "environment": dict(sorted((environment or {}).items())),
        "environment_file": environment_file_text,
        "config": config_text,
        "working_directory": working_directory,
        "user": user,
    }
    if supervision:  # absent = the hash of earlier releases, so an upgrade alone restarts nothing
        document["supervision"] = supervision
    blob = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def plan_action(state, running, present, current_hash, previous_hash):
    """What to do for ``state`` given the observed unit. Returns one of ACTIONS.

    started:   running with the same hash -> none; running with another hash -> restarted;
               not running -> started (through the same stop/release/clear sequence).
    restarted: always the sequence (restarted if it was running, else started).
    stopped:   running -> stopped, else none.
    absent:    anything left (running unit, failed unit, state) -> removed, else none.
    """
    if state == "started":
        if running:
            return "none" if current_hash == previous_hash else "restarted"
        return "started"
    if state == "restarted":
        return "restarted" if running else "started"
    if state == "stopped":
        return "stopped" if running else "none"
    if state == "absent":
        return "removed" if (running or present) else "none"
    raise UnitError(f"unknown state {state!r}: use started, restarted, stopped or absent")


# --------------------------------------------------------------------------- backend choice


def systemd_is_init(run_dir="/run/systemd/system", init_comm_path="/proc/1/comm"):
    """True when systemd manages this (container's) PID namespace."""
    if not os.path.isdir(run_dir):
        return False
    comm = (read_text(init_comm_path, "") or "").strip()
    return comm == "systemd"


def resolve_backend(requested, run_dir="/run/systemd/system", init_comm_path="/proc/1/comm"):
    if requested in ("systemd", "daemon"):
        return requested
    if requested != "auto":
        raise UnitError(f"backend {requested!r} is not one of auto, systemd, daemon")
    return "systemd" if systemd_is_init(run_dir, init_comm_path) else "daemon"


def get_backend(name, host):
    return {"systemd": SystemdBackend, "daemon": DaemonBackend}[name](host)


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


# --------------------------------------------------------------------------- systemd


SHOW_PROPERTIES = ("LoadState", "ActiveState", "SubState", "MainPID", "ExecMainStatus", "ExecMainCode", "Result", "NRestarts")

# Run by systemd as root after every end of the job (a restart included), with the state directory as $0:
# the exit status (systemd unloads a transient unit that ends cleanly, and its status with it), one line
# per end in `events` (time, result, how it ended: the restart and watchdog counts), and the reason the
# on-failure hook reports. A fixed script: the only variable part, the directory, is an argument.
RECORD_EXIT_SCRIPT = (
    'echo "$EXIT_CODE $EXIT_STATUS" > "$0/exit_status"; '
    'echo "$(date +%s) $SERVICE_RESULT $EXIT_CODE $EXIT_STATUS" >> "$0/events"; '
    'echo "DFLASH_REASON=$SERVICE_RESULT: $EXIT_CODE $EXIT_STATUS" > "$0/reason.env"'
)
HOOK_UNIT_DIR = "/run/systemd/system"
# Bad input (exit 2) does not fix itself: never restarted.
NO_RESTART_EXIT_STATUS = (2,)


def parse_systemctl_show(text):
    props = {}
    for line in (text or "").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            props[key.strip()] = value.strip()
    status = empty_status()
    status["load_state"] = props.get("LoadState") or "not-found"
    status["active_state"] = props.get("ActiveState") or "inactive"
    status["sub_state"] = props.get("SubState") or "dead"
    status["result"] = props.get("Result") or None
    try:
        pid = int(props.get("MainPID", "0") or 0)
    except ValueError:
        pid = 0
    status["main_pid"] = pid or None
    try:
        status["restarts"] = int(props.get("NRestarts", "0") or 0)
    except ValueError:
        status["restarts"] = 0
    # ExecMainCode is a CLD_* code: 1 exited (status = exit code), 2 killed / 3 dumped
    # (status = signal number, reported shell-style as 128+N); 0 = still running/never ran.
    try:
        code = int(props.get("ExecMainCode", "0") or 0)
        value = int(props.get("ExecMainStatus", "0") or 0)
    except ValueError:
        code, value = 0, 0
    if status["load_state"] == "not-found" or code == 0:
        status["exit_status"] = None
    elif code == 1:
        status["exit_status"] = value
    else:
        status["exit_status"] = 128 + value
    return status


def systemd_quote(word):
    """One word of a systemd command line (a validated path: nothing to escape but to be sure)."""
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def hook_unit_name(name):
    return f"{name}-on-failure.service"


def restart_properties(spec):
    restart = spec.get("restart") or {}
    if restart.get("policy", "no") == "no":
        return ["-p", "Restart=no"]
    return [
        "-p", "Restart=" + restart["policy"],
        "-p", f"RestartSec={int(restart.get('delay', 10))}s",
        "-p", f"StartLimitBurst={int(restart.get('burst', 3))}",
        "-p", f"StartLimitIntervalSec={int(restart.get('interval', 600))}s",
        "-p", "RestartPreventExitStatus=" + " ".join(str(c) for c in NO_RESTART_EXIT_STATUS),
    ]  # fmt: skip


def systemd_run_args(spec, systemd_run="systemd-run"):
    """The systemd-run command line for ``spec`` (no --collect: a failed unit keeps its exit status).

    Nothing secret and nothing a shell reads: the environment goes through a root-only file in the state
    directory, ``$`` in the command is escaped (systemd would expand it), the exit is recorded by a fixed script."""
    state_dir = spec["state_dir"]
    args = [
        systemd_run,
        "--unit=" + unit_name(spec["name"]),
        "--description=dflash job " + spec["name"],
        "-p", "Type=exec",
        "-p", "KillMode=mixed",
        "-p", f"TimeoutStopSec={int(spec.get('stop_timeout', 90))}s",
        "-p", "StandardOutput=append:" + spec["log_path"],
        "-p", "StandardError=append:" + spec["log_path"],
    ]  # fmt: skip
    args += restart_properties(spec)
    watchdog = spec.get("watchdog") or {}
    if watchdog.get("interval"):
        # The unit's interval is the start-up one (target load, compile); the trainer tightens it to
        # `interval` with WATCHDOG_USEC= once it trains (dflash/notify.py).
        start = max(int(watchdog.get("start_interval") or 0), int(watchdog["interval"]))
        args += ["-p", f"WatchdogSec={start}s", "-p", "NotifyAccess=main"]
    if spec.get("on_failure"):
        args += ["-p", "OnFailure=" + hook_unit_name(spec["name"])]
    args += ["-p", f"ExecStopPost=+/bin/sh -c {systemd_quote(RECORD_EXIT_SCRIPT)} {systemd_quote(state_dir)}"]
    if spec.get("environment_file"):
        args += ["-p", "EnvironmentFile=" + spec["environment_file"]]
    # Read after the user's file: it overrides it.
    args += ["-p", "EnvironmentFile=" + os.path.join(state_dir, "environment")]
    if spec.get("working_directory"):
        args += ["-p", "WorkingDirectory=" + spec["working_directory"]]
    if spec.get("user"):
        args += ["-p", "User=" + spec["user"]]
    args.append("--")
    args += [word.replace("$", "$$") for word in spec["command"]]
    return args


def unit_environment(spec):
    """What the job gets on top of its environment file (the module's `environment` and the watchdog's)."""
    env = {k: str(v) for k, v in (spec.get("environment") or {}).items()}
    watchdog = spec.get("watchdog") or {}
    if watchdog.get("interval"):
        env["DFLASH_WATCHDOG_SEC"] = str(int(watchdog["interval"]))
        env["DFLASH_WATCHDOG_START_SEC"] = str(max(int(watchdog.get("start_interval") or 0), int(watchdog["interval"])))
    return env


def hook_unit_text(spec):
    """The unit systemd starts (OnFailure=) when the job's restarts are exhausted: the operator's command with
    DFLASH_JOB, DFLASH_REASON (the last end: result, exit) and systemd's MONITOR_* variables."""
    words = " ".join(systemd_quote(w.replace("$", "$$").replace("%", "%%")) for w in spec["on_failure"])
    return (
        "# Written by dflash_unit: the failure hook of " + unit_name(spec["name"]) + "\n"
        "[Unit]\n"
        f"Description=dflash job {spec['name']}: restarts exhausted, run the failure hook\n"
        "[Service]\n"
        "Type=oneshot\n"
        f"Environment=DFLASH_JOB={spec['name']}\n"
        f"EnvironmentFile=-{os.path.join(spec['state_dir'], 'reason.env')}\n"
        f"StandardOutput=append:{spec['log_path']}\n"
        f"StandardError=append:{spec['log_path']}\n"
        f"ExecStart={words}\n"
    )


def read_events(state_dir):
    """The ends recorded since the launch: [{time, result, exit}] (oldest first)."""
    events = []
    for line in (read_text(os.path.join(state_dir, "events"), "") or "").splitlines():
        words = line.split()
        if len(words) >= 2 and words[0].isdigit():
            events.append({"time": int(words[0]), "result": words[1], "exit": " ".join(words[2:]) or None})
    return events


def add_restart_facts(status, state_dir):
    """restarts, watchdog_kills, last_exit_reason and crash_loop (restarts exhausted) of a status dict."""
    events = read_events(state_dir)
    if status.get("restarts") is None:
        status["restarts"] = 0
    status["watchdog_kills"] = sum(1 for e in events if e["result"] == "watchdog")
    last = next((e for e in reversed(events) if e["result"] != "success"), None)
    status["last_exit_reason"] = f"{last['result']} ({last['exit']})" if last else None
    status["crash_loop"] = bool(status["active_state"] == "failed" and status.get("restarts"))
    return status


class SystemdBackend:
    name = "systemd"

    def __init__(self, host):
        self.host = host

    def _systemctl(self, *args):
        return self.host.run(["systemctl", *args])

    def status(self, spec):
        rc, out, err = self._systemctl("show", unit_name(spec["name"]), "--property=" + ",".join(SHOW_PROPERTIES))
        if rc != 0:
            raise UnitError(f"systemctl show {unit_name(spec['name'])} failed (exit {rc}): {err.strip() or out.strip()}")
        status = parse_systemctl_show(out)
        if status["exit_status"] is None and not is_running(status):
            # A transient unit that exited 0 is unloaded by systemd; ExecStopPost recorded its status.
            status["exit_status"] = read_exit_status(spec["state_dir"])
        return add_restart_facts(status, spec["state_dir"])

    def present(self, spec, status):
        return status["load_state"] != "not-found" or os.path.isdir(spec["state_dir"])

    def start(self, spec):
        # systemd opens the log (append:) but does not create its directory.
        log_dir = os.path.dirname(spec["log_path"])
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        state_dir = spec["state_dir"]
        make_state_dir(state_dir)
        remove_files(state_dir, ("exit_status", "events", "reason.env"))
        self.host.atomic_write(os.path.join(state_dir, "environment"), environment_file_text(unit_environment(spec)), mode=0o600)
        hook = os.path.join(HOOK_UNIT_DIR, hook_unit_name(spec["name"]))
        if spec.get("on_failure"):
            os.makedirs(HOOK_UNIT_DIR, exist_ok=True)
            self.host.atomic_write(hook, hook_unit_text(spec), mode=0o644)
            self._systemctl("daemon-reload")
        elif os.path.exists(hook):
            os.unlink(hook)
            self._systemctl("daemon-reload")
        # A failed unit of the same name would block the new one (and keep its start-limit count).
        self._systemctl("reset-failed", unit_name(spec["name"]))
        rc, out, err = self.host.run(systemd_run_args(spec))
        if rc != 0:
            raise UnitError(
                f"systemd-run could not start {unit_name(spec['name'])} (exit {rc}): {err.strip() or out.strip()}"
            )

    def stop(self, spec):
        before = self.status(spec)
        rc, out, err = self._systemctl("stop", unit_name(spec["name"]))
        if rc != 0 and before["load_state"] != "not-found":
            raise UnitError(f"systemctl stop {unit_name(spec['name'])} failed (exit {rc}): {err.strip() or out.strip()}")
        # systemctl stop waits for TimeoutStopSec + SIGKILL of the cgroup; confirm the unit is gone.
        status = wait_until(
            self.host,
            lambda: self.status(spec),
            lambda s: not is_running(s),
            timeout=float(spec.get("stop_timeout", 90)) + 30,
        )
        if is_running(status):
            raise UnitError(f"{unit_name(spec['name'])} is still {status['active_state']} after systemctl stop")
        if status["exit_status"] is not None:
            write_exit_status(self.host, spec["state_dir"], status["exit_status"])
        return status

    def remove(self, spec):
        self._systemctl("reset-failed", unit_name(spec["name"]))
        hook = os.path.join(HOOK_UNIT_DIR, hook_unit_name(spec["name"]))
        if os.path.exists(hook):
            os.unlink(hook)
            self._systemctl("daemon-reload")


# --------------------------------------------------------------------------- daemon


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


def _signal_job(record, sig):
    """Signal the job: its whole process group while the leader lives, plus every marked process."""
    members = job_processes(record)
    leader = int(record["pid"])
    if leader in members:
        _signal(leader, sig, group=True)
    for pid in members:
        stat = proc_stat(pid)
        if stat is not None and stat[1] != leader:  # one signal each: the group got it already
            _signal(pid, sig)
    return members


def _signal(pid, sig, group=False):
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except OSError as exc:
        if exc.errno != errno.ESRCH:
            raise


def build_daemon_environment(spec, pw):
    env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "HOME": pw.pw_dir, "USER": pw.pw_name, "LOGNAME": pw.pw_name, "SHELL": pw.pw_shell or "/bin/sh"}
    if spec.get("environment_file"):
        env.update(parse_environment_file(read_text(spec["environment_file"], "")))
    env.update(unit_environment(spec))
    return env


def _user_entry(user):
    if not user:
        return pwd.getpwuid(os.getuid())
    try:
        return pwd.getpwnam(user)
    except KeyError:
        raise UnitError(f"user {user!r} does not exist on this host: create it (the venv role does) or change user") from None


class DaemonBackend:
    """A job detached from the caller: new session, own process group, pidfile, log redirection, and a
    supervisor (dflash_supervisor) that restarts it on failure, runs its watchdog and its failure hook."""

    name = "daemon"

    def __init__(self, host):
        self.host = host

    def _pidfile(self, spec):
        return os.path.join(spec["state_dir"], "pid")

    def _record(self, spec):
        text = read_text(self._pidfile(spec))
        if not text:
            return None
        try:
            record = json.loads(text)
        except ValueError:
            return None
        return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None

    def _alive(self, record):
        return bool(record) and int(record["pid"]) in job_processes(record)

    def status(self, spec):
        record = self._record(spec)
        status = empty_status()
        if record is None and not os.path.isdir(spec["state_dir"]):
            return status
        status["load_state"] = "loaded"
        status["restarts"] = int((record or {}).get("restarts") or 0)
        exit_status = read_exit_status(spec["state_dir"])
        supervised = record is not None and pid_alive(record.get("supervisor_pid"))
        if self._alive(record):
            status.update(active_state="active", sub_state="running", main_pid=int(record["pid"]))
        elif supervised and not os.path.exists(os.path.join(spec["state_dir"], "stopping")) and exit_status is not None \
                and (spec.get("restart") or {}).get("policy", "no") != "no":
            # Between two runs: the supervisor waits the restart delay (systemd: activating/auto-restart).
            status.update(active_state="activating", sub_state="auto-restart", exit_status=exit_status)
        elif supervised:
            # The job is gone and its supervisor is about to record the exit status.
            status.update(active_state="deactivating", sub_state="stop-post")
        elif exit_status is not None:
            status["exit_status"] = exit_status
            if exit_status == 0:
                status.update(active_state="inactive", sub_state="dead", result="success")
            else:
                status.update(active_state="failed", sub_state="failed", result="exit-code")
        elif record is not None:
            # Gone without a recorded status: the supervisor was killed (e.g. by the OOM killer).
            status.update(active_state="failed", sub_state="failed", result="signal")
        return add_restart_facts(status, spec["state_dir"])

    def present(self, spec, status):
        return os.path.isdir(spec["state_dir"])

    def start(self, spec):
        pw = _user_entry(spec.get("user"))
        state_dir = spec["state_dir"]
        make_state_dir(state_dir)
        log_dir = os.path.dirname(spec["log_path"])
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        remove_files(state_dir, ("exit_status", "events", "reason.env", "stopping", "failed"))
        token = uuid.uuid4().hex
        env = build_daemon_environment(spec, pw)
        workdir = spec.get("working_directory") or pw.pw_dir or "/"
        if not os.path.isdir(workdir):
            raise UnitError(f"working_directory {workdir!r} does not exist: create it or change working_directory")
        drop = spec.get("user") and os.getuid() == 0 and pw.pw_uid != 0
        options = {
            "name": spec["name"], "state_dir": state_dir, "token": token, "workdir": workdir,
            "uid": pw.pw_uid, "gid": pw.pw_gid, "user": pw.pw_name if drop else None,
            "restart": spec.get("restart") or {"policy": "no"}, "watchdog": spec.get("watchdog") or {},
            "on_failure": spec.get("on_failure") or None,
        }  # fmt: skip
        read_fd, write_fd = os.pipe()
        argv = [sys.executable, "-I", "-c", inspect.getsource(dflash_supervisor), state_dir, str(write_fd),
                json.dumps(options), "--", *spec["command"]]  # fmt: skip
        child = os.fork()
        if child == 0:  # first child: new session, fork the supervisor, leave
            try:
                os.close(read_fd)
                os.setsid()
                if os.fork() == 0:
                    _exec_supervisor(argv, env, spec["log_path"], write_fd)
            finally:
                os._exit(0)
        os.close(write_fd)
        data = b""
        while True:
            chunk = os.read(read_fd, 64)
            if not chunk:
                break
            data += chunk
        os.close(read_fd)
        os.waitpid(child, 0)
        if not data:
            raise UnitError(f"could not start the daemon for {spec['name']}: see {spec['log_path']}")

    def stop(self, spec):
        record = self._record(spec)
        status = self.status(spec)
        if record is None:
            return status
        if os.path.isdir(spec["state_dir"]):  # the supervisor restarts nothing from now on
            self.host.atomic_write(os.path.join(spec["state_dir"], "stopping"), "")
        timeout = float(spec.get("stop_timeout", 90))
        if _signal_job(record, signal.SIGTERM):
            deadline = self.host.now() + timeout
            while job_processes(record) and self.host.now() < deadline:
                self.host.sleep(0.2)
            if _signal_job(record, signal.SIGKILL):
                deadline = self.host.now() + 10
                while job_processes(record) and self.host.now() < deadline:
                    self.host.sleep(0.1)
                if job_processes(record):
                    raise UnitError(f"processes {job_processes(record)} of {spec['name']} survived SIGKILL")
        # The supervisor records the status right after the job is reaped, then ends.
        deadline = self.host.now() + 5
        while (read_exit_status(spec["state_dir"]) is None or pid_alive(record.get("supervisor_pid"))) \
                and self.host.now() < deadline:
            self.host.sleep(0.05)
        return self.status(spec)

    def remove(self, spec):
        pass


def _exec_supervisor(argv, env, log_path, pipe_fd):
    """In the forked supervisor: detach from the caller's fds, exec the supervisor. Never returns."""
    try:
        os.umask(0o022)
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        # Nothing of the caller (Ansible's pipes!) may stay open, or it would wait for the job.
        os.closerange(3, pipe_fd)
        os.closerange(pipe_fd + 1, 65536)
        os.set_inheritable(pipe_fd, True)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.chdir("/")
        os.execve(argv[0], argv, env)
    except BaseException as exc:  # noqa: BLE001 - report anything into the job's log
        try:
            os.write(2, f"dflash-unit: cannot start the supervisor: {exc}\n".encode())
        finally:
            os._exit(127)


# --------------------------------------------------------------------------- the restart sequence


def wait_until(host, probe, done, timeout, interval=0.5):
    deadline = host.now() + timeout
    value = probe()
    while not done(value) and host.now() < deadline:
        host.sleep(interval)
        value = probe()
    return value


def wait_for_gpu_release(host, gpu_ids, threshold_mib, timeout, interval=2.0):
    """Wait until every GPU in ``gpu_ids`` uses <= threshold_mib. Returns a report dict."""
    report = {"gpu_ids": list(gpu_ids or []), "released": True, "waited_s": 0.0, "skipped": None, "still_used": []}
    if not gpu_ids:
        report["skipped"] = "no gpu_ids"
        return report
    start = host.now()
    try:
        gpus, _ = query_gpus(host, processes=False)
    except GpuQueryError as exc:
        if exc.kind == "missing":
            report["skipped"] = "nvidia-smi not found"
            return report
        raise
    busy = gpus_above(gpus, gpu_ids, threshold_mib)
    while busy and host.now() - start < timeout:
        host.sleep(interval)
        gpus, _ = query_gpus(host, processes=False)
        busy = gpus_above(gpus, gpu_ids, threshold_mib)
    report["waited_s"] = round(host.now() - start, 1)
    report["still_used"] = [{"index": i, "used_mib": used} for i, used in busy]
    report["released"] = not busy
    return report


def clear_directory(path):
    """Empty ``path`` (keep the directory itself: it may be a mount or have set ownership)."""
    if not path:
        return False
    path = os.path.abspath(path)
    if path == "/" or len([p for p in path.split("/") if p]) < 2:
        raise UnitError(f"refusing to clear compile_cache_dir {path!r}: give a dedicated directory at least two levels deep")
    if not os.path.isdir(path):
        return False
    entries = os.listdir(path)
    for entry in entries:
        full = os.path.join(path, entry)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        else:
            os.unlink(full)
    return bool(entries)


def check_spec(spec):
    """Names and paths that end up in unit properties and file names: strict, or one readable error."""
    check_name(spec["name"])
    for key in ("state_dir", "log_path", "environment_file", "working_directory"):
        check_path(key, spec.get(key))
    for word in spec.get("on_failure") or []:
        if "\n" in word or "\0" in word:
            raise UnitError("on_failure: an argument holds a newline or NUL; give the command as plain words")


def crash_loop_message(spec, status):
    tail = "".join(f"\n  {line}" for line in (tail_lines(spec.get("log_path") or "", 10) or []))
    return (
        f"{spec['name']} is in a crash loop: restarted {status.get('restarts')} time(s), it failed again each time "
        f"and its restarts are exhausted (last end: {status.get('last_exit_reason') or status.get('result')}); "
        "relaunching the same configuration would fail the same way. Fix the cause (the log below) and deploy the "
        "fix (a changed config, code or environment restarts it), or relaunch it unchanged with state=restarted "
        f"(dflash_job_state=restarted). Last log lines of {spec.get('log_path')}:{tail}"
    )


def ensure(spec, state, backend, host, check_mode=False):
    """Bring the job to ``state``. Returns the module result (without diff)."""
    check_spec(spec)
    status = backend.status(spec)
    running = is_running(status)
    hash_file = os.path.join(spec["state_dir"], "config_hash")
    previous_hash = (read_text(hash_file, "") or "").strip() or None
    current_hash = spec.get("config_hash")
    if state == "started" and status.get("crash_loop") and current_hash == previous_hash:
        raise UnitError(crash_loop_message(spec, status))
    action = plan_action(state, running, backend.present(spec, status), current_hash, previous_hash)
    result = {
        "changed": action != "none",
        "action": action,
        "backend": backend.name,
        "config_hash": current_hash,
        "previous_hash": previous_hash,
        "gpu_release": None,
        "compile_cache_cleared": False,
        "status_before": status,
    }
    if action != "none" and not check_mode:
        if action in ("started", "restarted"):
            backend.stop(spec)
            result["gpu_release"] = release = wait_for_gpu_release(
                host, spec.get("gpu_ids"), spec.get("gpu_release_threshold_mib", 1024), spec.get("gpu_release_timeout", 120)
            )
            if not release["released"]:
                held = ", ".join("GPU {index}: {used_mib} MiB".format(**g) for g in release["still_used"])
                raise UnitError(
                    f"the GPUs of {spec['name']} did not release their memory within "
                    f"{spec.get('gpu_release_timeout', 120)}s after the stop ({held}); a process outside the "
                    "job holds them (see nvidia-smi) - end it, or raise gpu_release_timeout"
                )
            result["compile_cache_cleared"] = clear_directory(spec.get("compile_cache_dir"))
            backend.start(spec)
            host.atomic_write(hash_file, current_hash + "\n")
            # Let an immediate crash show up in the returned state.
            host.sleep(spec.get("settle_time", 1.0))
        elif action == "stopped":
            backend.stop(spec)
            result["gpu_release"] = wait_for_gpu_release(
                host, spec.get("gpu_ids"), spec.get("gpu_release_threshold_mib", 1024), spec.get("gpu_release_timeout", 120)
            )
        elif action == "removed":
            backend.stop(spec)
            backend.remove(spec)
            if os.path.isdir(spec["state_dir"]):
                shutil.rmtree(spec["state_dir"])
    after = backend.status(spec) if not check_mode else status
    result.update(
        active_state=after["active_state"],
        sub_state=after["sub_state"],
        main_pid=after["main_pid"],
        exit_status=after["exit_status"],
        restarts=after.get("restarts") or 0,
        watchdog_kills=after.get("watchdog_kills") or 0,
        last_exit_reason=after.get("last_exit_reason"),
    )
    return result
