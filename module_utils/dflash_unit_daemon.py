# Copyright: dflash authors
# Apache-2.0
"""The daemon backend, for hosts without systemd: a job detached from the caller under the supervisor process
(module_utils/dflash_supervisor.py, shipped as its source and run with ``python -I -c``).
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import pwd
import signal
import stat
import sys
import uuid

from ansible.module_utils import dflash_supervisor
from ansible.module_utils.dflash_failures import EXIT_CODES, codes_with
from ansible.module_utils.dflash_host import read_text
from ansible.module_utils.dflash_unit_procs import job_processes, pid_alive, proc_stat
from ansible.module_utils.dflash_unit_records import (
    add_restart_facts,
    check_log_path,
    empty_status,
    make_state_dir,
    read_exit_status,
    remove_files,
)
from ansible.module_utils.dflash_unit_spec import UnitError, parse_environment_file, unit_environment

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The supervisor's options (restart, watchdog, the failure hook's arguments), root's alone (0600).
SUPERVISOR_OPTIONS = "supervisor.json"


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
        env.update(parse_environment_file(read_text(spec["environment_file"], "", follow=True)))
    env.update(unit_environment(spec))
    return env


def supervisor_environment():
    """The supervisor's own environment (it runs as root): a fixed PATH of system directories, root's HOME; the job's
    environment goes to it through the options file, never as its own (a failure hook it runs would inherit it)."""
    home = pwd.getpwuid(os.getuid()).pw_dir or "/"
    return {"PATH": dflash_supervisor.SYSTEM_PATH, "HOME": home, "LANG": "C.UTF-8"}


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
        log_dir = os.path.dirname(spec["log_path"])
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        check_log_path(spec["log_path"])  # before anything is written
        make_state_dir(state_dir)
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
            "restart": supervisor_restart(spec.get("restart") or {"policy": "no"}), "watchdog": spec.get("watchdog") or {},
            "classes": {str(code): cls for cls, code in EXIT_CODES.items()},
            "on_failure": spec.get("on_failure") or None, "environment": env,
        }  # fmt: skip
        # The options (the failure hook's arguments and the job's environment among them) go through a root-only
        # file, never argv: anyone can read a process's command line.
        options_file = os.path.join(state_dir, SUPERVISOR_OPTIONS)
        self.host.atomic_write(options_file, json.dumps(options) + "\n", mode=0o600)
        read_fd, write_fd = os.pipe()
        argv = [sys.executable, "-I", "-c", inspect.getsource(dflash_supervisor), state_dir, str(write_fd),
                options_file, "--", *spec["command"]]  # fmt: skip
        child = os.fork()
        if child == 0:  # first child: new session, fork the supervisor, leave
            try:
                os.close(read_fd)
                os.setsid()
                if os.fork() == 0:
                    _exec_supervisor(argv, supervisor_environment(), spec["log_path"], write_fd)
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


def supervisor_restart(restart):
    """The supervisor's restart options: the exit codes never restarted and those restarted at most once, from the
    restart policy per failure class (module_utils/dflash_failures.py)."""
    never = sorted(set(dflash_supervisor.NO_RESTART_EXIT_STATUS) | set(codes_with(restart.get("classes"), "never")))
    return {**restart, "never": never, "once": codes_with(restart.get("classes"), "once")}


def _exec_supervisor(argv, env, log_path, pipe_fd):
    """In the forked supervisor: detach from the caller's fds, exec the supervisor. Never returns."""
    try:
        os.umask(0o022)
        null = os.open(os.devnull, os.O_RDONLY)
        # never through a link or into a FIFO someone put at the log's path (check_log_path said why)
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        if not stat.S_ISREG(os.fstat(log).st_mode):
            raise OSError(f"{log_path} is not a regular file")
        os.set_blocking(log, True)
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
