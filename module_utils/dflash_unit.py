# Copyright: dflash authors
# Apache-2.0
"""Lifecycle of a named training job: the backend choice and the restart sequence (stop, wait for the GPUs to
release, start), the same for both backends.

Used by the dflash_unit module (start/stop/restart) and the dflash_health module (status). Every function takes
a ``host`` (see dflash_host) so the logic runs unchanged in tests. The pieces: dflash_unit_spec (what a launch
is), dflash_unit_records (its state directory), dflash_unit_systemd and dflash_unit_daemon (the backends).
"""

from __future__ import annotations

import json
import os
import shutil

from ansible.module_utils.dflash_gpu import GpuQueryError, gpus_above, query_gpus
from ansible.module_utils.dflash_host import read_text, tail_lines
from ansible.module_utils.dflash_unit_daemon import DaemonBackend
from ansible.module_utils.dflash_unit_records import (
    RUNNING,
    STOPPED,
    is_running,
    make_state_dir,
    read_desired,
    set_hook_hold,
    write_desired,
)
from ansible.module_utils.dflash_unit_spec import UnitError, check_spec, plan_action
from ansible.module_utils.dflash_unit_systemd import SystemdBackend

# A GPU at or below this much used memory counts as released (the module's and the job role's default).
GPU_RELEASE_THRESHOLD_MIB = 1024
GPU_RELEASE_TIMEOUT = 120
# The launch record of the running job (dflash_unit_spec.launch_record), read by --diff.
LAUNCH_FILE = "launch.json"


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


def read_launch(state_dir):
    """The launch record written at the last start, or None (none yet, or written by an earlier release)."""
    try:
        record = json.loads(read_text(os.path.join(state_dir, LAUNCH_FILE), "") or "null")
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


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
    state_dir = spec["state_dir"]
    # Recorded for the boot relaunch and for status (stopped on purpose, or lost to a restart).
    desired = {"started": RUNNING, "restarted": RUNNING, "stopped": STOPPED}.get(state)
    desired_changed = bool(desired and action != "removed" and desired != read_desired(state_dir)
                           and (os.path.isdir(state_dir) or action in ("started", "restarted")))
    result = {
        "changed": action != "none" or desired_changed,
        "action": action,
        "backend": backend.name,
        "config_hash": current_hash,
        "previous_hash": previous_hash,
        "gpu_release": None,
        "status_before": status,
        "launch_before": read_launch(spec["state_dir"]),
    }
    if action != "none" and not check_mode:
        if action in ("started", "restarted"):
            backend.stop(spec)
            result["gpu_release"] = release = wait_for_gpu_release(
                host, spec.get("gpu_ids"), spec.get("gpu_release_threshold_mib", GPU_RELEASE_THRESHOLD_MIB),
                spec.get("gpu_release_timeout", GPU_RELEASE_TIMEOUT)
            )
            if not release["released"]:
                held = ", ".join("GPU {index}: {used_mib} MiB".format(**g) for g in release["still_used"])
                raise UnitError(
                    f"the GPUs of {spec['name']} did not release their memory within "
                    f"{spec.get('gpu_release_timeout', GPU_RELEASE_TIMEOUT)}s after the stop ({held}); a process outside the "
                    "job holds them (see nvidia-smi) - end it, or raise gpu_release_timeout"
                )
            make_state_dir(state_dir)
            set_hook_hold(host, state_dir, spec.get("hook_hold") or 0)
            backend.start(spec)
            write_desired(host, state_dir, RUNNING)
            host.atomic_write(hash_file, current_hash + "\n")
            if spec.get("launch") is not None:
                host.atomic_write(os.path.join(spec["state_dir"], LAUNCH_FILE), json.dumps(spec["launch"]) + "\n",
                                  mode=0o600)
            # Let an immediate crash show up in the returned state.
            host.sleep(spec.get("settle_time", 1.0))
        elif action == "stopped":
            # First: a shutdown during the stop must not bring it back at the next boot.
            write_desired(host, state_dir, STOPPED)
            backend.stop(spec)
            result["gpu_release"] = wait_for_gpu_release(
                host, spec.get("gpu_ids"), spec.get("gpu_release_threshold_mib", GPU_RELEASE_THRESHOLD_MIB),
                spec.get("gpu_release_timeout", GPU_RELEASE_TIMEOUT)
            )
        elif action == "removed":
            backend.stop(spec)
            backend.remove(spec)
            if os.path.isdir(spec["state_dir"]):
                shutil.rmtree(spec["state_dir"])
    elif action == "none" and state == "started" and hasattr(backend, "adopt"):
        # Running with this launch already: make sure it is durable (a job launched by an earlier release gets its
        # exit recorder drop-in and boot relaunch without a restart).
        result["changed"] |= backend.adopt(spec, dry_run=check_mode)
    if action == "none" and desired_changed and not check_mode:
        write_desired(host, state_dir, desired)
    after = backend.status(spec) if not check_mode else status
    result.update(
        active_state=after["active_state"],
        sub_state=after["sub_state"],
        main_pid=after["main_pid"],
        exit_status=after["exit_status"],
        restarts=after.get("restarts") or 0,
        watchdog_kills=after.get("watchdog_kills") or 0,
        last_exit_reason=after.get("last_exit_reason"),
        desired=read_desired(state_dir) if not check_mode else (desired or read_desired(state_dir)),
        lost=bool(after.get("lost")),
    )
    return result
