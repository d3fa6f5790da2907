# Copyright: dflash authors
# Apache-2.0
"""The daemon backend's supervisor: what systemd does for a unit, where there is no systemd.

A small root process outside the job's process group. It forks the job into its own group (as the
trainer's user), records every end of it in the state directory (``exit_status``, one line per end in
``events``: time, result, how it ended), restarts it on failure with a delay and a bounded burst, kills it
when its watchdog pings stop (the sd_notify protocol on an abstract socket named in NOTIFY_SOCKET; a trainer
is asked for its stacks first: SIGUSR1, when it has a handler), and runs the operator's failure hook when the
restarts are exhausted.

Run by dflash_unit as ``python -I -c <this file's source> STATE_DIR PIPE_FD OPTIONS_FILE -- COMMAND...``;
it imports nothing outside the standard library. OPTIONS_FILE (root's, 0600, in the root-only state
directory: the hook's arguments never appear in this process's argv) holds JSON: name, state_dir, uid, gid,
user (null = no change), workdir, token (the job's DFLASH_UNIT_ID marker), restart {policy, delay, burst,
interval, never (exit codes never restarted), once (exit codes restarted at most once)}, classes (exit code ->
failure class), watchdog {interval, start_interval}, on_failure (argv or null), environment (the job's: this process
runs in root's own environment, the job in this one). The first start's pid goes through PIPE_FD.

The watchdog socket is abstract (any local account could name it), so every datagram carries its sender's
credentials (SO_PASSCRED, checked by the kernel): only root and the job's own uid are heard; anything else is
dropped, with one line in the job's log per sender uid.
"""

import json
import os
import pwd
import select
import signal
import socket
import struct
import sys
import time

# Ends that count as success for Restart=on-failure (systemd's clean exit signals) and exits never restarted.
CLEAN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE)
NO_RESTART_EXIT_STATUS = (2,)
# The watchdog's kill waits this long after asking the job for its stacks (ask_for_stacks).
STACKS_WAIT_S = 2.0
# struct ucred: pid, uid, gid
UCRED = struct.Struct("iII")
# The PATH of what runs as root here (the failure hook): system directories only.
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def proc_starttime(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
        return int(text[text.rfind(")") + 2 :].split()[19])
    except (OSError, IndexError, ValueError):
        return None


# A copy on purpose of dflash_host.write_atomic, cut down: this file runs as `python -I -c SOURCE` and imports
# nothing outside the standard library; it writes only into its root-only state directory.
def atomic_write(path, text, mode=0o600):
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def spawn(cmd, options, notify_address, pipe_fd):
    # The job's environment comes from the options (root's file); this process runs in root's own. A supervisor of
    # an earlier release (no `environment` there) still carries it.
    env = dict(os.environ if options.get("environment") is None else options["environment"])
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            if pipe_fd >= 0:  # the caller waits for the pipe's end, not for the job's
                os.close(pipe_fd)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGQUIT):
                signal.signal(sig, signal.SIG_DFL)
            if options.get("user"):
                os.initgroups(options["user"], int(options["gid"]))
                os.setgid(int(options["gid"]))
                os.setuid(int(options["uid"]))
            os.chdir(options["workdir"])
            env["DFLASH_UNIT_ID"] = options["token"]
            if notify_address:
                env["NOTIFY_SOCKET"] = notify_address
            os.execvpe(cmd[0], cmd, env)
        except BaseException as exc:  # noqa: BLE001 - anything: report it in the job's log
            sys.stderr.write(f"dflash-unit: cannot run {cmd[0]!r}: {exc}\n")
            sys.stderr.flush()
            os._exit(127)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    return pid


# A copy on purpose of dflash.runtime.notify.parse (the trainer's side; this file imports only the standard
# library): tests/distributed/test_notify.py checks that the two read datagrams alike.
def parse_notify(data):
    fields = {}
    for line in data.decode(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key] = value
    return fields


def receive_notify(sock, allowed_uids, refused):
    """One datagram's fields when root or the job's uid sent it, else None (its sender logged once per uid)."""
    data, ancillary, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(UCRED.size))
    sender = None
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= UCRED.size:
            sender = UCRED.unpack(payload[: UCRED.size])
    if sender is None or sender[1] not in allowed_uids:
        uid = None if sender is None else sender[1]
        if uid not in refused:
            refused.add(uid)
            who = "without credentials" if sender is None else f"from uid {uid} (pid {sender[0]})"
            sys.stderr.write(f"dflash-unit: ignored a watchdog message {who}: only root and the job's user "
                             "may notify its supervisor\n")
            sys.stderr.flush()
        return None
    return parse_notify(data)


def ask_for_stacks(pid, wait=STACKS_WAIT_S):
    """Hang evidence before the watchdog's kill: a trainer (dflash/runtime/stacks.py; its launcher passes it on to the ranks)
    dumps every thread's stack to RUN_DIR/stacks/ on SIGUSR1. Sent only when the job's main process has a handler for
    it (SigCgt): SIGUSR1 would kill anything else."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            caught = next((int(line.split()[1], 16) for line in handle if line.startswith("SigCgt:")), 0)
        if not caught >> (signal.SIGUSR1 - 1) & 1:
            return
        os.kill(pid, signal.SIGUSR1)
    except (OSError, ValueError, IndexError):
        return
    time.sleep(wait)


def wait_job(pid, sock, watchdog, allowed_uids=(0,)):
    """Wait for the job to end; kill its group when the watchdog expires. Returns (wait status, watchdog kill)."""
    refused = set()
    interval = float(watchdog.get("start_interval") or watchdog.get("interval") or 0)
    deadline = time.monotonic() + interval if interval else None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status, False
        timeout = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
        if sock is None:
            time.sleep(timeout)
        elif select.select([sock], [], [], timeout)[0]:
            fields = receive_notify(sock, allowed_uids, refused) or {}
            if fields.get("WATCHDOG_USEC", "").isdigit():
                interval = int(fields["WATCHDOG_USEC"]) / 1e6
                deadline = time.monotonic() + interval
            if fields.get("WATCHDOG") == "1" and interval:
                deadline = time.monotonic() + interval
        if deadline is not None and time.monotonic() > deadline:
            ask_for_stacks(pid)
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            return os.waitpid(pid, 0)[1], True


def describe(status, watchdog_kill):
    """(result, exit words, shell-style code) as systemd names them: exit-code/signal/watchdog, exited N/killed SIG."""
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        return ("success" if code == 0 else "exit-code"), f"exited {code}", code
    sig = os.WTERMSIG(status)
    name = signal.Signals(sig).name.removeprefix("SIG") if sig in signal.Signals._value2member_map_ else str(sig)
    result = "watchdog" if watchdog_kill else ("success" if sig in CLEAN_SIGNALS else "signal")
    return result, f"killed {name}", 128 + sig


def main(argv):
    state_dir, pipe_fd = argv[0], int(argv[1])
    with open(argv[2], encoding="utf-8") as handle:
        options = json.load(handle)
    cmd = argv[4:]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    restart = options.get("restart") or {}
    watchdog = options.get("watchdog") or {}
    sock = address = None
    allowed_uids = {0, int(options["uid"])}
    if watchdog.get("interval"):
        # Abstract: the job's user can reach it though the state directory is root's alone. Any account can
        # send to it too, so every datagram's sender is checked (receive_notify). Its own random name: the
        # job's marker token is not published in /proc/net/unix.
        address = "@dflash-notify-" + os.urandom(16).hex()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.bind("\0" + address[1:])
    starts, restarts, ends = [], 0, {}  # ends: how often each exit code ended the job since the launch
    while True:
        pid = spawn(cmd, options, address, pipe_fd)
        starts.append(time.monotonic())
        record = {"pid": pid, "pgid": pid, "supervisor_pid": os.getpid(), "token": options["token"],
                  "starttime": proc_starttime(pid), "started_at": time.time(), "restarts": restarts, "command": cmd}
        atomic_write(os.path.join(state_dir, "pid"), json.dumps(record) + "\n")
        if pipe_fd >= 0:
            os.write(pipe_fd, str(pid).encode())
            os.close(pipe_fd)
            pipe_fd = -1
        status, watchdog_kill = wait_job(pid, sock, watchdog, allowed_uids)
        result, words, code = describe(status, watchdog_kill)
        failure_class = class_of(code, options)
        atomic_write(os.path.join(state_dir, "exit_status"), f"{code}\n")
        with open(os.path.join(state_dir, "events"), "a") as handle:
            handle.write(f"{int(time.time())} {result} {words}\n")
        atomic_write(os.path.join(state_dir, "reason.env"),
                     f"DFLASH_REASON={result}: {words}\nDFLASH_FAILURE_CLASS={failure_class or ''}\n")
        if os.path.exists(os.path.join(state_dir, "stopping")) or restart.get("policy", "no") == "no":
            return
        if result == "success":
            return
        if os.WIFEXITED(status):
            # the restart policy per failure class (module_utils/dflash_failures.py): never, or at most once
            ends[code] = ends.get(code, 0) + 1
            never = restart.get("never", NO_RESTART_EXIT_STATUS)
            if code in never or (code in restart.get("once", ()) and ends[code] > 1):
                sys.stderr.write(f"dflash-unit: {failure_class} (exit {code}) "
                                 + ("ended the job again since its launch: not restarted (restart policy once)\n"
                                    if code not in never else "is not restarted (restart policy never)\n"))
                sys.stderr.flush()
                if code not in NO_RESTART_EXIT_STATUS:  # a class stopped by the policy: its hook runs
                    run_hook(options, words, result, failure_class)
                return
        now = time.monotonic()
        recent = [t for t in starts if now - t < float(restart.get("interval", 600))]
        if len(recent) >= int(restart.get("burst", 3)):
            run_hook(options, words, result, failure_class)
            return
        resume_at = time.monotonic() + float(restart.get("delay", 10))
        while time.monotonic() < resume_at:  # a stop during the delay ends it at once
            if os.path.exists(os.path.join(state_dir, "stopping")):
                return
            time.sleep(0.1)
        restarts += 1


def class_of(code, options):
    """The failure class of a shell-style exit status (options' ``classes``: exit code -> class), None for 0."""
    if code == 0:
        return None
    if code >= 128:
        return "signal"
    return (options.get("classes") or {}).get(str(code), "unknown")


def hook_environment(options, words, result, failure_class=None):
    """The failure hook's environment: root's (a fixed PATH of system directories, this account's HOME) and the
    documented DFLASH_JOB, DFLASH_REASON, DFLASH_FAILURE_CLASS; nothing of the job's (its HOME is the trainer's, where
    a .curlrc or a Python .pth would act as root)."""
    try:
        home = pwd.getpwuid(os.getuid()).pw_dir or "/"
    except KeyError:
        home = "/"
    return {"PATH": SYSTEM_PATH, "HOME": home, "LANG": "C.UTF-8", "DFLASH_JOB": options["name"],
            "DFLASH_REASON": f"{result}: {words}", "DFLASH_FAILURE_CLASS": failure_class or ""}


def hook_held(state_dir, now=None):
    """A deploy holds the failure hook until the deadline in STATE_DIR/hook-hold (dflash_unit_records.set_hook_hold)."""
    try:
        with open(os.path.join(state_dir, "hook-hold"), encoding="utf-8") as handle:
            deadline = int(handle.read().strip())
    except (OSError, ValueError):
        return False
    return (time.time() if now is None else now) < deadline


def run_hook(options, words, result, failure_class=None):
    """Restarts exhausted (or refused by the policy of the failure class): the operator's command, in root's
    environment with the job's name, the reason and the failure class (hook_environment)."""
    with open(os.path.join(options["state_dir"], "failed"), "w") as handle:
        handle.write(f"{result}: {words}\n")
    if not options.get("on_failure"):
        return
    if hook_held(options["state_dir"]):
        sys.stderr.write("dflash-unit: failure hook not run: a deploy checks this launch within its start window and "
                         "rolls it back (its output says why)\n")
        sys.stderr.flush()
        return
    env = hook_environment(options, words, result, failure_class)
    pid = os.fork()
    if pid == 0:
        try:
            os.execvpe(options["on_failure"][0], options["on_failure"], env)
        finally:
            os._exit(127)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main(sys.argv[1:])
