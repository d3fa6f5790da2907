# Copyright: dflash authors
# Apache-2.0
"""The systemd backend: the job as a transient unit (systemd-run), its exit recorder (a drop-in), its failure hook
unit, its boot relaunch unit, its state from systemctl.

Durable jobs: every launch records the exact systemd-run argument list in the root-only state directory
(``launch.argv``) with copies of the recorder drop-in and the hook unit, and enables a persistent unit
``dflash-boot-NAME.service`` that, at the container's next boot, runs that launch again when the desired state
recorded there is ``running``. A per-boot marker in /run (a tmpfs, empty after every boot of the container) says
that this boot launched the job; a job meant to run, not running and without the marker was lost to a restart.
"""

from __future__ import annotations

import os
import time

from ansible.module_utils.dflash_failures import EXIT_CODES, SIGNAL, codes_with
from ansible.module_utils.dflash_host import read_text, write_atomic
from ansible.module_utils.dflash_unit_records import (
    HOOK_HOLD_FILE,
    RUNNING,
    add_restart_facts,
    check_log_path,
    empty_status,
    is_running,
    make_state_dir,
    read_desired,
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


# Run by systemd as root after every end of the job (a restart included), with the state directory as $0, the
# unit's name as $1 and the exit codes of the restart policy `once` as $2 (empty: none, or no restarts): the exit
# status (systemd unloads a transient unit that ends cleanly, and its status with it), one line per end in `events`
# (time, result, how it ended: the restart and watchdog counts), and the reason the on-failure hook reports.
# A fixed script: the variable parts (the directory, the unit, the codes) are arguments.
# The failure class of the end (module_utils/dflash_failures.py) goes into reason.env as DFLASH_FAILURE_CLASS.
FAILURE_CLASS_CASE = (
    'case "$EXIT_CODE:$EXIT_STATUS" in exited:0) c= ;; '
    + " ".join(f"exited:{code}) c={cls} ;;" for cls, code in sorted(EXIT_CODES.items(), key=lambda item: item[1]))
    + f" exited:*) c=unknown ;; killed:*|dumped:*) c={SIGNAL} ;; *) c= ;; esac; "
)
# The policy `once` (systemd has no restart count per exit code): the second end of this launch by a `once` code
# (counted in `events`, which every launch starts empty) stops the unit. A stop job that runs while the unit is
# still in its stop-post phase (this script) cancels the pending restart (systemd's forbid_restart) and leaves the
# unit `failed` with its exit status, and OnFailure= runs; --no-block, or the stop would wait for this script. The
# script waits (at most 10 s) until that job runs: queued only, it would meet the unit in `auto-restart`, whose
# stop leaves it inactive, without the failure hook. One line in the job's log (the unit's stdout) says why.
# Every command by its absolute path (the unit's PATH is the job's): /bin/ is the same on merged and split /usr.
SYSTEMCTL, DATE, GREP, SLEEP = "/bin/systemctl", "/bin/date", "/bin/grep", "/bin/sleep"


def once_script(systemctl=SYSTEMCTL):
    return (
        'if [ "$EXIT_CODE" = exited ] && [ -n "$1" ]; then for o in $2; do '
        f'if [ "$o" = "$EXIT_STATUS" ] && [ "$({GREP} -c " exited $o\\$" "$0/events")" -ge 2 ]; then '
        'echo "dflash-unit: $c (exit $o) ended the job again since its launch: not restarted (restart policy once)"; '
        f'{systemctl} stop --no-block "$1"; i=0; '
        f'while [ "$i" -lt 100 ] && ! {systemctl} list-jobs --no-legend "$1" 2>/dev/null | {GREP} -q " running"; '
        f'do {SLEEP} 0.1; i=$((i + 1)); done; '
        "fi; done; fi"
    )


def record_exit_script(systemctl=SYSTEMCTL):
    """The recorder's script (run as root; ``systemctl``: a test points it at a double)."""
    return (
        'echo "$EXIT_CODE $EXIT_STATUS" > "$0/exit_status"; '
        f'echo "$({DATE} +%s) $SERVICE_RESULT $EXIT_CODE $EXIT_STATUS" >> "$0/events"; '
        + FAILURE_CLASS_CASE
        + 'echo "DFLASH_REASON=$SERVICE_RESULT: $EXIT_CODE $EXIT_STATUS" > "$0/reason.env"; '
        'echo "DFLASH_FAILURE_CLASS=$c" >> "$0/reason.env"; '
        + once_script(systemctl)
    )


RECORD_EXIT_SCRIPT = record_exit_script()
# Root's environment for what runs as root on the job's behalf (the recorder, the failure hook): a fixed PATH of
# system directories, root's HOME, and the documented DFLASH_* variables only - never the job's environment (its HOME
# is the trainer's: a .curlrc or a Python .pth there would act as root).
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
ROOT_ENVIRONMENT = {"PATH": SYSTEM_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
# systemd runs ExecStopPost= in the unit's environment (the job's): the recorder starts by running its script again
# under `env -i` with root's environment and the three variables systemd gives it ($3 is the script, $0-$2 its
# arguments).
CLEAN_RECORDER = (
    "exec /usr/bin/env -i " + " ".join(f"{k}={v}" for k, v in ROOT_ENVIRONMENT.items())
    + ' EXIT_CODE="$EXIT_CODE" EXIT_STATUS="$EXIT_STATUS" SERVICE_RESULT="$SERVICE_RESULT" /bin/sh -c "$3" "$0" "$1" "$2"'
)


# Runtime units and drop-ins (a tmpfs: gone after a reboot of the container, written again by the boot unit).
HOOK_UNIT_DIR = "/run/systemd/system"
# Persistent units: the boot relaunch unit.
BOOT_UNIT_DIR = "/etc/systemd/system"
# One file per job launched in this boot of the container.
BOOT_MARKER_DIR = "/run/dflash-units"
# Where systemd keeps the unit files of transient units.
TRANSIENT_UNIT_DIR = "/run/systemd/transient"
RECORD_DROPIN = "50-dflash-record.conf"
# What the state directory keeps for the boot relaunch.
LAUNCH_ARGV_FILE = "launch.argv"
RECORD_COPY_FILE = "record.conf"
HOOK_COPY_FILE = "on-failure.service"
RELAUNCH_SCRIPT_FILE = "relaunch"

# Run at boot by dflash-boot-NAME.service as root, with the state directory, the job's name, the runtime unit
# directory and the boot marker directory: unless the job was stopped on purpose, restore the runtime files of its
# unit (the exit recorder, the failure hook) and run its last launch again (the systemd-run arguments recorded,
# NUL-separated); the marker of this boot only once it started. A fixed script: the variable parts are arguments.
RELAUNCH_SCRIPT = """#!/bin/sh
# Written by dflash_unit: at boot, launch the job again from its last deployed launch.
set -eu
state=$1
name=$2
units=$3
markers=$4
desired=$(cat "$state/desired" 2>/dev/null || true)
if [ "$desired" != running ]; then
    echo "dflash job $name: desired state '$desired', not relaunched"
    exit 0
fi
mkdir -p "$units/$name.service.d"
install -m 0644 "$state/record.conf" "$units/$name.service.d/50-dflash-record.conf"
if [ -f "$state/on-failure.service" ]; then
    install -m 0600 "$state/on-failure.service" "$units/$name-on-failure.service"
fi
systemctl daemon-reload
systemctl reset-failed "$name.service" 2>/dev/null || true
rm -f "$state/exit_status" "$state/events" "$state/reason.env"
# A GPU job waits (bounded) for its GPUs: after a reboot of an NVSwitch node CUDA sees none until the fabric
# manager is done, and the trainer would exit as bad input (exit 2, never restarted).
want=$(sed -n 's/^CUDA_VISIBLE_DEVICES=//p' "$state/environment" 2>/dev/null | tr -d "\\"'" | tr ',' ' ' | wc -w)
if [ "$want" -gt 0 ] && command -v nvidia-smi >/dev/null 2>&1; then
    limit=${DFLASH_BOOT_GPU_WAIT_S:-600}
    waited=0
    while :; do
        seen=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
        fabric=$(nvidia-smi -q 2>/dev/null | awk '/^ *Fabric *$/ { f = 1; next } f && /State/ { sub(/.*: */, ""); print; f = 0 }' | grep -v -x -e Completed -e N/A -e 'Not Supported' | sort | uniq -c | tr -s ' ' | tr '\\n' ';' || true)
        missing=''
        [ "$seen" -ge "$want" ] || missing="$seen of its $want GPUs visible"
        [ -z "$fabric" ] || missing="${missing:+$missing, }fabric state:$fabric"
        [ -z "$missing" ] && break
        if [ "$waited" -ge "$limit" ]; then
            echo "dflash job $name: GPUs still not ready after $limit s ($missing); launching anyway"
            break
        fi
        [ "$waited" -gt 0 ] || echo "dflash job $name: waiting up to $limit s for its GPUs ($missing)"
        sleep 5
        waited=$((waited + 5))
    done
fi
xargs -0 -x -a "$state/launch.argv" env --
mkdir -p -m 0755 "$markers"
date +%s > "$markers/$name.launched"
echo "dflash job $name: relaunched from its last deployed launch"
"""


# Bad input (exit 2) does not fix itself: never restarted (with the other classes of the policy `never`).
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


def boot_unit_name(name):
    return f"dflash-boot-{name}.service"


def record_dropin_text(spec):
    """The drop-in that records every end of the job. A drop-in, not a property of the transient unit: systemd 252
    writes a transient unit's ``ExecStopPost=+...`` back as ``ExecStopPostEx=``, which it does not read, so a
    ``daemon-reload`` would drop the recorder; drop-ins of /run/systemd/system are read again at every reload.
    ``-``: a failed recorder never turns a clean end into a failure. It runs its script in root's environment
    (CLEAN_RECORDER), never the job's."""
    script = RECORD_EXIT_SCRIPT.replace("%", "%%")
    once = " ".join(str(code) for code in once_exit_status(spec.get("restart") or {}))
    return (
        "# Written by dflash_unit: records every end of " + unit_name(spec["name"]) + "\n"
        "[Service]\n"
        f"ExecStopPost=-+/bin/sh -c {systemd_quote(CLEAN_RECORDER)} {systemd_quote(spec['state_dir'])} "
        f"{systemd_quote(unit_name(spec['name']))} {systemd_quote(once)} {systemd_quote(script)}\n"
    )


def boot_unit_text(spec, runtime_unit_dir=HOOK_UNIT_DIR, marker_dir=BOOT_MARKER_DIR):
    """The persistent unit that launches the job again at boot (when its desired state is running)."""
    state_dir = spec["state_dir"]
    return (
        "# Written by dflash_unit: relaunches " + unit_name(spec["name"]) + " at boot unless it was stopped on purpose\n"
        "[Unit]\n"
        f"Description=dflash job {spec['name']}: launch it again after a boot\n"
        "Wants=network-online.target\n"
        "After=network-online.target local-fs.target\n"
        f"ConditionPathExists={os.path.join(state_dir, LAUNCH_ARGV_FILE)}\n"
        "[Service]\n"
        "Type=oneshot\n"
        f"ExecStart=/bin/sh {systemd_quote(os.path.join(state_dir, RELAUNCH_SCRIPT_FILE))} "
        f"{systemd_quote(state_dir)} {systemd_quote(spec['name'])} {systemd_quote(runtime_unit_dir)} "
        f"{systemd_quote(marker_dir)}\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def argv_file_text(args):
    """An argument list as NUL-terminated words (read back by ``xargs -0``)."""
    for word in args:
        if "\0" in word:
            raise UnitError("a launch argument holds a NUL byte")
    return "".join(word + "\0" for word in args)


def restart_properties(spec):
    restart = spec.get("restart") or {}
    if restart.get("policy", "no") == "no":
        return ["-p", "Restart=no"]
    return [
        "-p", "Restart=" + restart["policy"],
        "-p", f"RestartSec={int(restart.get('delay', 10))}s",
        "-p", f"StartLimitBurst={int(restart.get('burst', 3))}",
        "-p", f"StartLimitIntervalSec={int(restart.get('interval', 600))}s",
        "-p", "RestartPreventExitStatus=" + " ".join(str(c) for c in no_restart_exit_status(restart)),
    ]  # fmt: skip


def no_restart_exit_status(restart):
    """The exit codes never restarted: bad input, and the classes whose policy is `never` (module_utils/dflash_failures)."""
    return sorted(set(NO_RESTART_EXIT_STATUS) | set(codes_with(restart.get("classes"), "never")))


def once_exit_status(restart):
    """The exit codes restarted at most once per launch (the policy `once`; the exit recorder stops the unit at the
    second such end, RECORD_EXIT_SCRIPT); none when the unit is not restarted at all."""
    if restart.get("policy", "no") == "no":
        return []
    return [code for code in codes_with(restart.get("classes"), "once") if code not in no_restart_exit_status(restart)]


def systemd_run_args(spec, systemd_run="systemd-run"):
    """The systemd-run command line for ``spec`` (no --collect: a failed unit keeps its exit status).

    Nothing secret and nothing a shell reads: the environment goes through a root-only file in the state
    directory, ``$`` in the command is escaped (systemd would expand it), the exit is recorded by a fixed script
    in a drop-in (record_dropin_text)."""
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
        # `interval` with WATCHDOG_USEC= once it trains (dflash/runtime/notify.py).
        start = max(int(watchdog.get("start_interval") or 0), int(watchdog["interval"]))
        args += ["-p", f"WatchdogSec={start}s", "-p", "NotifyAccess=main"]
    if spec.get("on_failure"):
        args += ["-p", "OnFailure=" + hook_unit_name(spec["name"])]
    # The exit recorder is a drop-in (record_dropin_text): it survives a daemon-reload.
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


# The hook unit's ExecCondition=: skip the hook (exit 1) while a deploy holds it (dflash_unit_records.HOOK_HOLD_FILE,
# $0: the deadline in epoch seconds, then the hold ends by itself). An unreadable file holds nothing.
HOOK_HOLD_SCRIPT = (
    f'if [ -f "$0" ] && [ "$({DATE} +%s)" -lt "$(/bin/cat "$0" 2>/dev/null || echo 0)" ]; then '
    'echo "dflash-unit: failure hook not run: a deploy checks this launch within its start window and rolls it back '
    '(its output says why)"; exit 1; fi'
)


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
        # root's environment, stated (systemd gives a hook unit its own, never the job's)
        + "".join(f"Environment={k}={v}\n" for k, v in ROOT_ENVIRONMENT.items())
        + f"Environment=DFLASH_JOB={spec['name']}\n"
        f"EnvironmentFile=-{os.path.join(spec['state_dir'], 'reason.env')}\n"
        f"StandardOutput=append:{spec['log_path']}\n"
        f"StandardError=append:{spec['log_path']}\n"
        f"ExecCondition=/bin/sh -c {systemd_quote(HOOK_HOLD_SCRIPT.replace('%', '%%'))} "
        f"{systemd_quote(os.path.join(spec['state_dir'], HOOK_HOLD_FILE))}\n"
        f"ExecStart={words}\n"
    )


def write_file(path, text, mode):
    """Replace ``path`` atomically by a file of ``mode`` that never had a wider one (the hook unit holds the hook's
    arguments: root's alone, systemd reads it as root): ``write_atomic``, not the host's atomic_move."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, text, mode)


def wait_until(host, probe, done, timeout, interval=0.5):
    deadline = host.now() + timeout
    value = probe()
    while not done(value) and host.now() < deadline:
        host.sleep(interval)
        value = probe()
    return value


class SystemdBackend:
    name = "systemd"
    # Where the runtime units and drop-ins, the boot unit and the per-boot markers go (tests point them elsewhere).
    runtime_unit_dir = HOOK_UNIT_DIR
    boot_unit_dir = BOOT_UNIT_DIR
    marker_dir = BOOT_MARKER_DIR
    transient_dir = TRANSIENT_UNIT_DIR

    def __init__(self, host):
        self.host = host

    def _systemctl(self, *args):
        return self.host.run(["systemctl", *args])

    def marker_path(self, spec):
        return os.path.join(self.marker_dir, spec["name"] + ".launched")

    def dropin_path(self, spec):
        return os.path.join(self.runtime_unit_dir, unit_name(spec["name"]) + ".d", RECORD_DROPIN)

    def hook_path(self, spec):
        return os.path.join(self.runtime_unit_dir, hook_unit_name(spec["name"]))

    def boot_unit_path(self, spec):
        return os.path.join(self.boot_unit_dir, boot_unit_name(spec["name"]))

    def boot_wants_path(self, spec):
        return os.path.join(self.boot_unit_dir, "multi-user.target.wants", boot_unit_name(spec["name"]))

    def status(self, spec):
        rc, out, err = self._systemctl("show", unit_name(spec["name"]), "--property=" + ",".join(SHOW_PROPERTIES))
        if rc != 0:
            raise UnitError(f"systemctl show {unit_name(spec['name'])} failed (exit {rc}): {err.strip() or out.strip()}")
        status = parse_systemctl_show(out)
        if status["exit_status"] is None and not is_running(status):
            # A transient unit that exited 0 is unloaded by systemd; ExecStopPost recorded its status.
            status["exit_status"] = read_exit_status(spec["state_dir"])
        status = add_restart_facts(status, spec["state_dir"])
        # Lost: meant to run, not running, and not launched in this boot of the container (the boot relaunch
        # failed or did not run): the container or node restarted under it.
        status["desired"] = read_desired(spec["state_dir"])
        status["launched_this_boot"] = os.path.exists(self.marker_path(spec))
        status["lost"] = bool(status["desired"] == RUNNING and not status["launched_this_boot"] and not is_running(status))
        return status

    def present(self, spec, status):
        return status["load_state"] != "not-found" or os.path.isdir(spec["state_dir"])

    def _write_if_changed(self, path, text, mode, dry_run):
        """Write ``text`` to ``path`` (mode ``mode``) unless it holds exactly that; True when it did (or would)."""
        try:
            st = os.lstat(path)
            same = (read_text(path) == text and st.st_mode & 0o7777 == mode and st.st_uid == os.getuid())
        except OSError:
            same = False
        if same:
            return False
        if not dry_run:
            write_file(path, text, mode)
        return True

    def _runtime_files(self, spec):
        """The job's files under /run/systemd/system: the exit recorder drop-in, the failure hook (or None)."""
        hook = hook_unit_text(spec) if spec.get("on_failure") else None
        return {self.dropin_path(spec): (record_dropin_text(spec), 0o644), self.hook_path(spec): (hook, 0o600)}

    def _records_itself(self, spec):
        """The running transient unit has its own recorder that systemd reads back at a reload (launched by an
        earlier release on a systemd newer than 252, which writes it as ``ExecStopPost=``, not ``ExecStopPostEx=``)."""
        text = read_text(os.path.join(self.transient_dir, unit_name(spec["name"])), "") or ""
        return any(line.startswith("ExecStopPost=") and "exit_status" in line for line in text.splitlines())

    def _write_runtime_files(self, spec, dry_run=False, skip=()):
        changed = False
        for path, (text, mode) in self._runtime_files(spec).items():
            if path in skip:
                continue
            if text is not None:
                changed |= self._write_if_changed(path, text, mode, dry_run)
            elif os.path.lexists(path):
                changed = True
                if not dry_run:
                    os.unlink(path)
        return changed

    def persist(self, spec, dry_run=False):
        """Record the launch for the boot relaunch (argument list, copies of the runtime files, the relaunch script)
        and enable dflash-boot-NAME.service. True when anything was (or, with ``dry_run``, would be) changed."""
        state_dir = spec["state_dir"]
        if not dry_run:
            make_state_dir(state_dir)
        hook = hook_unit_text(spec) if spec.get("on_failure") else None
        files = {
            os.path.join(state_dir, LAUNCH_ARGV_FILE): (argv_file_text(systemd_run_args(spec)), 0o600),
            os.path.join(state_dir, RECORD_COPY_FILE): (record_dropin_text(spec), 0o600),
            os.path.join(state_dir, RELAUNCH_SCRIPT_FILE): (RELAUNCH_SCRIPT, 0o700),
            self.boot_unit_path(spec): (boot_unit_text(spec, self.runtime_unit_dir, self.marker_dir), 0o644),
        }
        changed = False
        for path, (text, mode) in files.items():
            changed |= self._write_if_changed(path, text, mode, dry_run)
        hook_copy = os.path.join(state_dir, HOOK_COPY_FILE)
        if hook is not None:
            changed |= self._write_if_changed(hook_copy, hook, 0o600, dry_run)
        elif os.path.lexists(hook_copy):
            changed = True
            if not dry_run:
                os.unlink(hook_copy)
        # What `systemctl enable` does for WantedBy=multi-user.target (systemd reads it at the next boot).
        wants = self.boot_wants_path(spec)
        if os.path.realpath(wants) != os.path.realpath(self.boot_unit_path(spec)) or not os.path.lexists(wants):
            changed = True
            if not dry_run:
                os.makedirs(os.path.dirname(wants), exist_ok=True)
                if os.path.lexists(wants):
                    os.unlink(wants)
                os.symlink(self.boot_unit_path(spec), wants)
        return changed

    def adopt(self, spec, dry_run=False):
        """A job running already (launched by an earlier release, or before the boot marker existed): give it the
        exit recorder drop-in and the boot relaunch without restarting it. True when anything changed."""
        # A unit that records itself keeps doing so until its next start (a drop-in too would record every end twice).
        skip = (self.dropin_path(spec),) if self._records_itself(spec) else ()
        changed = self._write_runtime_files(spec, dry_run, skip)
        changed |= self.persist(spec, dry_run)
        if not dry_run:
            if changed:
                self._systemctl("daemon-reload")
            self._mark_launched(spec)
        return changed

    def _mark_launched(self, spec):
        os.makedirs(self.marker_dir, mode=0o755, exist_ok=True)
        write_file(self.marker_path(spec), f"{int(time.time())}\n", 0o644)

    def start(self, spec):
        # systemd opens the log (append:) but does not create its directory.
        log_dir = os.path.dirname(spec["log_path"])
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        check_log_path(spec["log_path"])  # systemd's append: follows a link
        state_dir = spec["state_dir"]
        make_state_dir(state_dir)
        remove_files(state_dir, ("exit_status", "events", "reason.env"))
        self.host.atomic_write(os.path.join(state_dir, "environment"), environment_file_text(unit_environment(spec)), mode=0o600)
        # The recorder drop-in and the hook are read from disk: a reload makes systemd see new ones.
        self._write_runtime_files(spec)
        self.persist(spec)
        self._systemctl("daemon-reload")
        # A failed unit of the same name would block the new one (and keep its start-limit count).
        self._systemctl("reset-failed", unit_name(spec["name"]))
        rc, out, err = self.host.run(systemd_run_args(spec))
        if rc != 0:
            raise UnitError(
                f"systemd-run could not start {unit_name(spec['name'])} (exit {rc}): {err.strip() or out.strip()}"
            )
        self._mark_launched(spec)

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
        paths = [self.hook_path(spec), self.dropin_path(spec), self.boot_wants_path(spec), self.boot_unit_path(spec),
                 self.marker_path(spec)]
        removed = [path for path in paths if os.path.lexists(path)]
        for path in removed:
            os.unlink(path)
        try:
            os.rmdir(os.path.dirname(self.dropin_path(spec)))
        except OSError:
            pass  # absent, or holds drop-ins of someone else's
        if removed:
            self._systemctl("daemon-reload")
