# Copyright: dflash authors
# Apache-2.0
"""The systemd backend: the job as a transient unit (systemd-run), its failure hook unit, its state from systemctl.
"""

from __future__ import annotations

import os

from ansible.module_utils.dflash_unit_records import (
    add_restart_facts,
    empty_status,
    is_running,
    make_state_dir,
    read_exit_status,
    remove_files,
    write_exit_status,
)
from ansible.module_utils.dflash_unit_spec import (
    UnitError,
    environment_file_text,
    unit_environment,
    unit_name,
)

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


def wait_until(host, probe, done, timeout, interval=0.5):
    deadline = host.now() + timeout
    value = probe()
    while not done(value) and host.now() < deadline:
        host.sleep(interval)
        value = probe()
    return value


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
