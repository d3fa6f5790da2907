# Copyright: dflash authors
# Apache-2.0
"""Lifecycle of a named training job: a systemd transient unit, or a daemon where systemd is absent.

Used by the dflash_unit module (start/stop/restart) and the dflash_health module (status).
Every function takes a ``host`` (see dflash_host) so the logic runs unchanged in tests.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pwd
import shutil
import signal
import sys
import time
import uuid

from ansible.module_utils.dflash_gpu import GpuQueryError, gpus_above, query_gpus
from ansible.module_utils.dflash_host import read_text

DEFAULT_STATE_ROOT = "/var/lib/dflash/units"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RUNNING_STATES = ("active", "activating", "deactivating", "reloading")
ACTIONS = ("none", "started", "restarted", "stopped", "removed")

# The daemon backend's supervisor: a tiny root process, outside the job's process group,
# that forks the job into its own group, reports the job's pid through a pipe, waits and
# records the exit status (128+N for a signal, SIGKILL included) in the state directory.
# argv: EXIT_FILE PIPE_FD UID GID USER WORKDIR TOKEN -- COMMAND...  ("-" for UID/GID/USER = no change).
# Only the job gets the DFLASH_UNIT_ID=TOKEN marker, so stopping the job never hits the supervisor.
DAEMON_SUPERVISOR = """
import os, signal, sys
exit_file, pipe_fd, uid, gid, user, workdir, token = sys.argv[1:8]
cmd = sys.argv[9:]
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
pid = os.fork()
if pid == 0:
    try:
        os.setpgid(0, 0)
        os.close(int(pipe_fd))
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        if user != "-":
            os.initgroups(user, int(gid))
            os.setgid(int(gid))
            os.setuid(int(uid))
        os.chdir(workdir)
        os.environ["DFLASH_UNIT_ID"] = token
        os.execvp(cmd[0], cmd)
    except BaseException as exc:
        sys.stderr.write("dflash-unit: cannot run %r: %s\\n" % (cmd[0], exc))
        sys.stderr.flush()
        os._exit(127)
try:
    os.setpgid(pid, pid)
except OSError:
    pass
os.write(int(pipe_fd), ("%d %d" % (pid, os.getpid())).encode())
os.close(int(pipe_fd))
status = os.waitpid(pid, 0)[1]
code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
tmp = exit_file + ".tmp"
with open(tmp, "w") as handle:
    handle.write("%d\\n" % code)
    handle.flush()
    os.fsync(handle.fileno())
os.replace(tmp, exit_file)
"""


class UnitError(Exception):
    pass


# --------------------------------------------------------------------------- spec and hash


def unit_name(name):
    return name if "." in name else name + ".service"


def default_state_dir(name):
    return os.path.join(DEFAULT_STATE_ROOT, name)


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
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def config_hash(command, environment=None, environment_file_text=None, config_text=None, working_directory=None, user=None):
    """Identity of a launch: what the process would see. Same hash + running = leave it alone."""
    document = {
        "command": list(command or []),
        "environment": dict(sorted((environment or {}).items())),
        "environment_file": environment_file_text,
        "config": config_text,
        "working_directory": working_directory,
        "user": user,
    }
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
    }


def is_running(status):
    return status["active_state"] in RUNNING_STATES


# --------------------------------------------------------------------------- systemd


SHOW_PROPERTIES = ("LoadState", "ActiveState", "SubState", "MainPID", "ExecMainStatus", "ExecMainCode", "Result")


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


def systemd_run_args(spec, systemd_run="systemd-run"):
    """The systemd-run command line for ``spec`` (no --collect: a failed unit keeps its exit status)."""
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
    # systemd unloads a transient unit that ends cleanly, and its exit status with it: record it
    # ('+' = with full privileges, whatever User= is).
    exit_file = os.path.join(spec["state_dir"], "exit_status")
    args += ["-p", f"ExecStopPost=+/bin/sh -c 'echo $EXIT_CODE $EXIT_STATUS > {exit_file}'"]
    if spec.get("environment_file"):
        args += ["-p", "EnvironmentFile=" + spec["environment_file"]]
    if spec.get("working_directory"):
        args += ["-p", "WorkingDirectory=" + spec["working_directory"]]
    if spec.get("user"):
        args += ["-p", "User=" + spec["user"]]
    for key, value in sorted((spec.get("environment") or {}).items()):
        args.append(f"--setenv={key}={value}")
    args.append("--")
    args += list(spec["command"])
    return args


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
            # A transient unit that exited 0 is unloaded by systemd; stop() recorded its status.
            status["exit_status"] = read_exit_status(spec["state_dir"])
        return status

    def present(self, spec, status):
        return status["load_state"] != "not-found" or os.path.isdir(spec["state_dir"])

    def start(self, spec):
        # systemd opens the log (append:) but does not create its directory.
        log_dir = os.path.dirname(spec["log_path"])
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        if any(c in spec["state_dir"] for c in " '\"\\%$"):
            raise UnitError(f"state_dir {spec['state_dir']!r} must not contain spaces, quotes, '%' or '$' (systemd command line)")
        os.makedirs(spec["state_dir"], mode=0o755, exist_ok=True)
        exit_file = os.path.join(spec["state_dir"], "exit_status")
        if os.path.exists(exit_file):
            os.unlink(exit_file)
        # A failed unit of the same name would block the new one.
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


def proc_stat(pid):
    """(state, pgrp, starttime) of a live /proc entry, or None."""
    text = read_text(f"/proc/{int(pid)}/stat")
    if not text:
        return None
    fields = text[text.rfind(")") + 2 :].split()
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

    The job's leader counts while its pid has the recorded start time; every other process
    must carry the job's DFLASH_UNIT_ID marker in its environment (inherited by all
    descendants, also those that left the process group). A recycled pid or process-group
    number therefore never matches, and nothing is ever matched by name.
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
            if stat[2] == record.get("starttime"):
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
    env.update({k: str(v) for k, v in (spec.get("environment") or {}).items()})
    return env


def _user_entry(user):
    if not user:
        return pwd.getpwuid(os.getuid())
    try:
        return pwd.getpwnam(user)
    except KeyError:
        raise UnitError(f"user {user!r} does not exist on this host: create it (the venv role does) or change user") from None


class DaemonBackend:
    """A job detached from the caller: new session, own process group, pidfile, log redirection."""

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
            return json.loads(text)
        except ValueError:
            return None

    def _alive(self, record):
        if not record:
            return False
        stat = proc_stat(int(record["pid"]))
        # The start time guards against a recycled pid.
        return stat is not None and stat[0] not in ("Z", "X") and stat[2] == record.get("starttime")

    def status(self, spec):
        record = self._record(spec)
        status = empty_status()
        if record is None and not os.path.isdir(spec["state_dir"]):
            return status
        status["load_state"] = "loaded"
        exit_status = read_exit_status(spec["state_dir"])
        if self._alive(record):
            status.update(active_state="active", sub_state="running", main_pid=int(record["pid"]))
        elif record is not None and exit_status is None and pid_alive(record.get("supervisor_pid")):
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
        return status

    def present(self, spec, status):
        return os.path.isdir(spec["state_dir"])

    def start(self, spec):
        pw = _user_entry(spec.get("user"))
        state_dir = spec["state_dir"]
        os.makedirs(state_dir, mode=0o755, exist_ok=True)
        log_dir = os.path.dirname(spec["log_path"])
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        exit_file = os.path.join(state_dir, "exit_status")
        if os.path.exists(exit_file):
            os.unlink(exit_file)
        token = uuid.uuid4().hex
        env = build_daemon_environment(spec, pw)
        workdir = spec.get("working_directory") or pw.pw_dir or "/"
        if not os.path.isdir(workdir):
            raise UnitError(f"working_directory {workdir!r} does not exist: create it or change working_directory")
        drop = spec.get("user") and os.getuid() == 0 and pw.pw_uid != 0
        read_fd, write_fd = os.pipe()
        argv = [sys.executable, "-I", "-c", DAEMON_SUPERVISOR, exit_file, str(write_fd),
                str(pw.pw_uid) if drop else "-", str(pw.pw_gid) if drop else "-", pw.pw_name if drop else "-",
                workdir, token, "--", *spec["command"]]  # fmt: skip
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
        pid, supervisor = (int(x) for x in data.split())
        stat = proc_stat(pid)
        record = {
            "pid": pid,
            "pgid": pid,
            "supervisor_pid": supervisor,
            "token": token,
            "starttime": stat[2] if stat else None,
            "started_at": time.time(),
            "command": list(spec["command"]),
        }
        self.host.atomic_write(self._pidfile(spec), json.dumps(record) + "\n")

    def stop(self, spec):
        record = self._record(spec)
        status = self.status(spec)
        if record is None:
            return status
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
        # The supervisor records the status right after the job is reaped.
        deadline = self.host.now() + 5
        while read_exit_status(spec["state_dir"]) is None and self.host.now() < deadline:
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


def ensure(spec, state, backend, host, check_mode=False):
    """Bring the job to ``state``. Returns the module result (without diff)."""
    status = backend.status(spec)
    running = is_running(status)
    hash_file = os.path.join(spec["state_dir"], "config_hash")
    previous_hash = (read_text(hash_file, "") or "").strip() or None
    current_hash = spec.get("config_hash")
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
    )
    return result
