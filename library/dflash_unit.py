#!/usr/bin/python
# Copyright: dflash authors
# Apache-2.0

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_unit
short_description: Run a training job as a systemd transient unit (or a daemon), idempotently
description:
  - Manages one named long-running job that must outlive the Ansible (exec/SSH) session that starts it.
  - The C(systemd) backend launches C(systemd-run --unit NAME -p Type=exec -p KillMode=mixed -p TimeoutStopSec=N
    -p StandardOutput=append:LOG -p StandardError=append:LOG -p Restart=on-failure -p RestartSec= -p StartLimitBurst=
    -p StartLimitIntervalSec= -p RestartPreventExitStatus=2 [-p WatchdogSec= -p NotifyAccess=main] [-p OnFailure=]
    [-p EnvironmentFile=] -p EnvironmentFile=STATE_DIR/environment [-p WorkingDirectory=] [-p User=] -- COMMAND).
    Without C(--collect), so a failed unit and its exit status remain; C(systemctl reset-failed) runs before a
    relaunch. A fixed C(ExecStopPost=-+) script, given the state directory, the unit's name and the exit codes of the
    restart policy V(once) as its arguments, records every end
    (C(exit_status), one line per end in C(events) for the restart and watchdog counts, and the reason the failure hook
    reports), so the status of a unit that ended cleanly (which systemd unloads) is kept too. It is a drop-in,
    C(/run/systemd/system/NAME.service.d/50-dflash-record.conf), written before the launch and read by a
    C(daemon-reload) - systemd 252 loses a transient unit's own C(ExecStopPost=+) at the next reload, a drop-in it
    reads again.
  - Self-healing. After a failure the unit restarts by itself (O(restart)) after O(restart_delay) seconds, at most
    O(restart_burst) starts within O(restart_interval) seconds; exit 2 (bad input) is never restarted. With
    O(watchdog) the trainer must ping (sd_notify C(WATCHDOG=1), dflash/runtime/notify.py) at least that often once it trains,
    and within O(watchdog_start) while it loads; a hung trainer is killed and restarted. When the restarts are
    exhausted the unit stays C(failed), O(on_failure) runs (a unit C(NAME-on-failure.service) with C(DFLASH_JOB) and
    C(DFLASH_REASON)), and O(state=started) with an unchanged configuration fails with the crash loop's diagnosis
    instead of relaunching it.
  - Durable (systemd backend). Each launch records its exact C(systemd-run) argument list, copies of the recorder
    drop-in and the hook unit, and the desired state C(running) in O(state_dir), and enables
    C(/etc/systemd/system/dflash-boot-NAME.service), which at the next boot of the container runs that launch again
    (the trainer resumes from its checkpoint) and marks it in C(/run/dflash-units/NAME.launched). O(state=stopped)
    records C(stopped) first, so the job stays stopped across restarts; O(state=absent) removes the boot unit. A job
    meant to run that is not running and was not launched in this boot is RV(lost). A running job with unchanged
    inputs launched by an earlier release gets these files without a restart.
  - The failure hook's unit C(/run/systemd/system/NAME-on-failure.service) holds the hook's arguments - mode 0600,
    root's (systemd reads it as root).
  - Nothing of O(environment) is on a command line or in the module's output (C(no_log)); it is written, escaped,
    to a root-only file in O(state_dir). O(state_dir) and its parents must be root's alone.
  - The C(daemon) backend, for hosts without systemd, double-forks into a new session, redirects stdout/stderr
    (appending) to O(log_path), keeps a pidfile in O(state_dir), and runs the command in its own process group under a
    small supervisor process (outside that group, module_utils/dflash_supervisor.py) that records every end in
    O(state_dir), also after a SIGKILL, and does what systemd does for the other backend - restart with delay and
    burst, the watchdog (an abstract C(NOTIFY_SOCKET) that hears only root and the job's user - every datagram's
    sender is checked by its kernel credentials), the failure hook (its arguments pass to the supervisor in a
    root-only file of O(state_dir), never on its command line). Stop is SIGTERM to the job's process group
    (while its leader, known by pid and start time, lives) and to every process carrying the job's
    C(DFLASH_UNIT_ID) environment marker, then SIGKILL after O(stop_timeout). Never by process name.
  - Idempotence by a config hash of O(command), O(environment), the content of O(environment_file), the content of
    O(config_path), O(working_directory) and O(user), stored in O(state_dir). Same hash and running = no change.
  - A different hash, a job that is not running, or O(state=restarted) runs the restart sequence as one operation -
    stop and wait until the unit is gone, wait (bounded) until the job's GPUs release their memory, start.
version_added: "0.1.0"
author: dflash authors
options:
  name:
    description: Job name; the systemd unit is C(NAME.service).
    type: str
    required: true
  state:
    description:
      - V(started) - running with the current configuration (restart sequence if the hash changed or it is not running).
      - V(restarted) - always run the restart sequence.
      - V(stopped) - stop it (and wait for the GPUs to release); keep its state and exit status; record that it was
        stopped on purpose (not relaunched at boot, not RV(lost)).
      - V(absent) - stop it, reset a failed systemd unit, remove its boot relaunch unit, delete O(state_dir).
    type: str
    choices: [started, restarted, stopped, absent]
    default: started
  command:
    description: The command as an argument list (no shell). Required for V(started) and V(restarted).
    type: list
    elements: str
  environment_file:
    description:
      - A KEY=VALUE file loaded into the job's environment (systemd C(EnvironmentFile=) syntax). Must exist.
      - A regular file; a symbolic link is followed only when root owns it (never one another account made).
    type: path
  environment:
    description: Extra environment variables; they override the file. Never logged; one line each (no newline).
    type: dict
    default: {}
  working_directory:
    description: Working directory of the job. Must exist.
    type: path
  user:
    description: Run the job as this user (must exist). Defaults to the user Ansible runs as.
    type: str
  log_path:
    description:
      - File that receives stdout and stderr (appended). Its directory is created if missing.
      - A symbolic link, FIFO or device at this path is refused (root appends there and never writes through it).
    type: path
  config_path:
    description:
      - The job's config file; its content enters the config hash so that editing it restarts the job.
      - Read as a regular file of at most 16 MiB; a symbolic link is followed only when root owns it (as for
        O(environment_file)).
    type: path
  backend:
    description:
      - V(auto) picks V(systemd) when C(/run/systemd/system) exists and PID 1 is systemd, else V(daemon).
    type: str
    choices: [auto, systemd, daemon]
    default: auto
  stop_timeout:
    description: Seconds between SIGTERM and SIGKILL (C(TimeoutStopSec)). The trainer checkpoints on SIGTERM.
    type: int
    default: 90
  gpu_ids:
    description: GPU indexes the job uses; after a stop the module waits until they release their memory.
    type: list
    elements: int
    default: []
  gpu_release_timeout:
    description: Seconds to wait for the GPUs to release; the task fails if they do not (another process holds them).
    type: int
    default: 120
  gpu_release_threshold_mib:
    description: A GPU counts as released once its used memory is at most this many MiB.
    type: int
    default: 1024
  state_dir:
    description:
      - Where the config hash, pidfile, environment and exit records are kept. Default C(/var/lib/dflash-units/NAME).
      - It and every directory above it must be writable by root alone (not under the trainer account's home).
    type: path
  restart:
    description: V(on-failure) restarts the job by itself after a failure (not after exit 2); V(no) leaves it down.
    type: str
    choices: [on-failure, "no"]
    default: on-failure
  restart_delay:
    description: Seconds between a failure and the restart (C(RestartSec)).
    type: int
    default: 10
  restart_burst:
    description: At most this many starts within O(restart_interval) (C(StartLimitBurst)); then the unit stays failed.
    type: int
    default: 3
  restart_interval:
    description: Seconds of the burst window (C(StartLimitIntervalSec)).
    type: int
    default: 600
  restart_policy:
    description:
      - The restart policy per failure class of the trainer's exit (docs/operations.md, "Self-healing"), on top of
        the defaults C(bad_input=never), C(data_error=never), C(gpu_error=never), C(cuda_oom=once),
        C(collective_timeout=always), C(unknown=always).
      - V(never) leaves the unit failed (systemd C(RestartPreventExitStatus)); V(once) restarts it at most once per
        launch (systemd - the exit recorder stops the unit at the second such end - and the daemon backend alike);
        V(always) restarts it as any failure.
      - Keys are the classes C(bad_input), C(data_error), C(cuda_oom), C(collective_timeout), C(gpu_error),
        C(unknown); exit 2 (bad input) is never restarted whatever this says.
    type: dict
    default: {}
  watchdog:
    description: Seconds between the trainer's pings once it trains (it sets this with C(WATCHDOG_USEC)); 0 = no watchdog.
    type: int
    default: 0
  watchdog_start:
    description: The watchdog interval until the first step (target load, compile); at least O(watchdog).
    type: int
    default: 0
  on_failure:
    description:
      - Command (argument list, no shell) run once the restarts are exhausted, with C(DFLASH_JOB) (the name) and
        C(DFLASH_REASON) (the last end as result and exit, e.g. C(watchdog) and C(killed ABRT)) in its environment;
        systemd adds C(MONITOR_SERVICE_RESULT) and friends. Its output goes to O(log_path).
    type: list
    elements: str
    default: []
  hook_hold:
    description:
      - Seconds from this launch during which O(on_failure) does not run (a deploy that rolls a failed start back
        pages nobody); 0 lifts an earlier hold. It does not enter the launch's identity.
    type: int
    default: 0
requirements:
  - systemd-run and systemctl for the systemd backend; nvidia-smi to wait for GPU release (skipped without it).
attributes:
  check_mode:
    support: full
    description: Reports the action it would take (none, started, restarted, stopped, removed) without taking it.
  diff_mode:
    support: full
    description:
      - Before/after of the launch spec - command, user, working directory, the names (never the values) of the
        environment variables and of the environment file's variables, the restart and watchdog settings, the
        config file's lines - and of the unit's state. A changed environment value is marked as changed, never
        shown.
"""

EXAMPLES = r"""
- name: Launch the trainer (restarts it if its command, environment or config changed)
  dflash_unit:
    name: dflash-train
    command: [/opt/dflash/venv/bin/python, -m, dflash, train, /etc/dflash/dflash-train.yaml]
    environment_file: /etc/dflash/dflash-train.env
    environment:
      PYTHONPATH: /opt/dflash/current
    working_directory: /var/lib/dflash/runs/dflash-train
    user: dflash
    log_path: /var/log/dflash/dflash-train.log
    config_path: /etc/dflash/dflash-train.yaml
    gpu_ids: [0, 1, 2, 3, 4, 5, 6, 7]

- name: Stop it (SIGTERM, checkpoint, exit; SIGKILL after 120 s)
  dflash_unit:
    name: dflash-train
    state: stopped
    stop_timeout: 120
"""

RETURN = r"""
changed:
  description: Whether the job was started, restarted, stopped or removed.
  returned: always
  type: bool
action:
  description: What was done.
  returned: always
  type: str
  sample: restarted
backend:
  description: The backend used (after resolving V(auto)).
  returned: always
  type: str
  sample: systemd
active_state:
  description: systemd-style ActiveState after the action (active, inactive, failed, ...).
  returned: always
  type: str
sub_state:
  description: systemd-style SubState after the action (running, dead, failed, ...).
  returned: always
  type: str
main_pid:
  description: PID of the unit's main process (the command itself, for both backends), or null.
  returned: always
  type: int
exit_status:
  description: Last exit status of the job (128+N for a signal), or null while running / unknown.
  returned: always
  type: int
config_hash:
  description: sha256 of the launch configuration (null for stopped/absent without a command).
  returned: always
  type: str
previous_hash:
  description: The hash recorded at the previous launch, or null.
  returned: always
  type: str
gpu_release:
  description: The GPU release wait of the restart sequence (gpu_ids, released, waited_s, still_used, skipped).
  returned: when the job was stopped or (re)started
  type: dict
status_before:
  description: The unit's state before the action, with C(restarts), C(watchdog_kills), C(last_exit_reason) and
    C(crash_loop).
  returned: always
  type: dict
restarts:
  description: Automatic restarts since the last launch by this module.
  returned: always
  type: int
watchdog_kills:
  description: Ends by the watchdog since the last launch.
  returned: always
  type: int
last_exit_reason:
  description: How the job last failed, e.g. C(signal (killed KILL)), C(watchdog (killed ABRT)), or null.
  returned: always
  type: str
desired:
  description: The desired state recorded in O(state_dir) - C(running) (relaunched at boot), C(stopped), or null.
  returned: always
  type: str
lost:
  description: The job is meant to run, is not running and was not launched in this boot of the container (systemd).
  returned: always
  type: bool
"""

import os
import traceback

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.dflash_failures import DEFAULT_POLICY, PolicyError, restart_policy
from ansible.module_utils.dflash_gpu import GpuQueryError
from ansible.module_utils.dflash_host import ModuleHost, read_text_checked
from ansible.module_utils.dflash_unit import (
    GPU_RELEASE_THRESHOLD_MIB,
    GPU_RELEASE_TIMEOUT,
    ensure,
    get_backend,
    resolve_backend,
)
from ansible.module_utils.dflash_unit_spec import (
    UnitError,
    check_name,
    config_hash,
    default_state_dir,
    describe_launch,
    launch_record,
)

# What the unit is expected to be in after each action (check mode reports it without acting).
STATE_AFTER = {"started": "active", "restarted": "active", "stopped": "inactive", "removed": "absent"}


ARGUMENT_SPEC = {
    "name": {"type": "str", "required": True},
    "state": {"type": "str", "default": "started", "choices": ["started", "restarted", "stopped", "absent"]},
    "command": {"type": "list", "elements": "str"},
    "environment_file": {"type": "path"},
    "environment": {"type": "dict", "default": {}, "no_log": True},
    "working_directory": {"type": "path"},
    "user": {"type": "str"},
    "log_path": {"type": "path"},
    "config_path": {"type": "path"},
    "backend": {"type": "str", "default": "auto", "choices": ["auto", "systemd", "daemon"]},
    "stop_timeout": {"type": "int", "default": 90},
    "gpu_ids": {"type": "list", "elements": "int", "default": []},
    "gpu_release_timeout": {"type": "int", "default": GPU_RELEASE_TIMEOUT},
    "gpu_release_threshold_mib": {"type": "int", "default": GPU_RELEASE_THRESHOLD_MIB},
    "state_dir": {"type": "path"},
    "restart": {"type": "str", "default": "on-failure", "choices": ["on-failure", "no"]},
    "restart_delay": {"type": "int", "default": 10},
    "restart_burst": {"type": "int", "default": 3},
    "restart_interval": {"type": "int", "default": 600},
    "restart_policy": {"type": "dict", "default": {}},
    "watchdog": {"type": "int", "default": 0},
    "watchdog_start": {"type": "int", "default": 0},
    "on_failure": {"type": "list", "elements": "str", "default": []},
    "hook_hold": {"type": "int", "default": 0},
}


def launch_diff(result, launch, check_mode):
    """Before/after of the launch spec (command, user, workdir, environment keys, config) and of the unit's state."""
    before = result.pop("launch_before")
    action = result["action"]
    after = None if action == "removed" else before if action == "stopped" or launch is None else launch
    state_before = result["status_before"]["active_state"]
    state_after = STATE_AFTER.get(action, state_before) if check_mode else result["active_state"]
    return {
        "before": describe_launch(before) + f"active_state: {state_before}\n",
        "after": describe_launch(after, other=before) + f"active_state: {state_after}\n",
    }


def main():
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        required_if=[
            ("state", "started", ("command", "log_path")),
            ("state", "restarted", ("command", "log_path")),
        ],
        supports_check_mode=True,
    )
    p = module.params
    name = p["name"]
    try:
        check_name(name)
    except UnitError as exc:
        module.fail_json(msg=str(exc))
    for key in ("restart_delay", "restart_burst", "restart_interval", "watchdog", "watchdog_start"):
        if p[key] < (1 if key == "restart_burst" else 0):
            module.fail_json(msg=f"{key}={p[key]} must be {'at least 1' if key == 'restart_burst' else 'zero or more'}")
    try:
        policy = restart_policy(p["restart_policy"])
    except PolicyError as exc:
        module.fail_json(msg=str(exc))
    launching = p["state"] in ("started", "restarted")
    env_text = config_text = None
    if launching:
        if not p["command"]:
            module.fail_json(msg="command must list at least the program to run, e.g. [/opt/dflash/venv/bin/python, -m, dflash, train, CONFIG]")
        missing = []
        if p["environment_file"]:
            # root's own files: a link root made is followed, one another account made is not (dflash_host)
            env_text, unsafe = read_text_checked(p["environment_file"], follow=True)
            if unsafe:
                module.fail_json(msg=f"environment_file {p['environment_file']} {unsafe}: make it a plain file owned by root")
            if env_text is None:
                missing.append(f"environment_file {p['environment_file']} does not exist: write it first (the env role does) or drop the option")
        if p["config_path"]:
            config_text, unsafe = read_text_checked(p["config_path"], limit=16 << 20, follow=True)
            if unsafe:
                module.fail_json(msg=f"config_path {p['config_path']} {unsafe}: make it a plain file owned by root")
            if config_text is None:
                missing.append(f"config_path {p['config_path']} does not exist: render the run config before launching")
        if missing and not module.check_mode:
            module.fail_json(msg="; ".join(missing))
        for message in missing:  # in check mode the files may be due to an earlier (skipped) task
            module.warn(message + " (check mode: assuming it will exist)")
    spec = {
        "name": name,
        "command": p["command"] or [],
        "environment": {k: str(v) for k, v in p["environment"].items()},
        "environment_file": p["environment_file"],
        "working_directory": p["working_directory"],
        "user": p["user"],
        "log_path": p["log_path"] or os.path.join("/var/log/dflash", name + ".log"),
        "stop_timeout": p["stop_timeout"],
        "gpu_ids": p["gpu_ids"],
        "gpu_release_timeout": p["gpu_release_timeout"],
        "gpu_release_threshold_mib": p["gpu_release_threshold_mib"],
        "state_dir": p["state_dir"] or default_state_dir(name),
        "restart": {"policy": p["restart"], "delay": p["restart_delay"], "burst": p["restart_burst"], "interval": p["restart_interval"],
                    "classes": policy},
        "watchdog": {"interval": p["watchdog"], "start_interval": p["watchdog_start"]},
        "on_failure": p["on_failure"],
        "hook_hold": p["hook_hold"],
        "config_hash": config_hash(p["command"], spec_env(p), env_text, config_text, p["working_directory"], p["user"],
                                   supervision=supervision(p))
        if launching
        else None,
        "launch": launch_record(p["command"], spec_env(p), p["environment_file"], env_text, p["config_path"],
                                config_text, p["working_directory"], p["user"], supervision(p))
        if launching
        else None,
    }
    host = ModuleHost(module)
    try:
        backend_name = resolve_backend(p["backend"])
        if backend_name == "systemd" and not host.which("systemd-run"):
            module.fail_json(msg="backend systemd needs systemd-run, which is not installed: install systemd or use backend=daemon")
        result = ensure(spec, p["state"], get_backend(backend_name, host), host, check_mode=module.check_mode)
    except (UnitError, GpuQueryError) as exc:
        module.fail_json(msg=str(exc))
    except OSError as exc:
        module.fail_json(msg=f"dflash_unit {name}: {exc}", exception=traceback.format_exc())
    diff = launch_diff(result, spec["launch"], module.check_mode)
    if module._diff:
        result["diff"] = diff
    module.exit_json(**result)


def spec_env(params):
    return {k: str(v) for k, v in params["environment"].items()}


def supervision(params):
    """Restart, watchdog and hook settings: a change relaunches the unit with them."""
    keys = ("restart", "restart_delay", "restart_burst", "restart_interval", "watchdog", "watchdog_start", "on_failure")
    chosen = {k: params[k] for k in keys}
    policy = restart_policy(params.get("restart_policy"))
    if policy != DEFAULT_POLICY:  # the defaults leave the hash of earlier releases: an upgrade alone restarts nothing
        chosen["restart_policy"] = policy
    return chosen


if __name__ == "__main__":
    main()
