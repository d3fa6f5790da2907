"""Inject one fault into the running job and time its recovery, from inside the container, with no playbook.

    python3 measure.py kill|hang|crashloop UNIT RUN_DIR LOG [CRASH_PTH]

Prints one JSON object: the times (seconds after the fault) at which the old process was gone (detected),
systemd had started a new one (restarted) and the new one had trained a step past its resume point
(training), the step at the fault, the checkpoint it resumed from and the steps lost.
"""

import json
import os
import re
import subprocess
import sys
import time

POLL = 0.1


def show(unit):
    out = subprocess.run(["systemctl", "show", unit, "-p", "ActiveState,SubState,MainPID,NRestarts,Result"],
                         capture_output=True, text=True, check=True).stdout
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    props["MainPID"] = int(props.get("MainPID") or 0)
    return props


def last_ping(unit):
    """CLOCK_MONOTONIC time (s) of the last watchdog ping systemd received from the job (0: none yet)."""
    out = subprocess.run(["systemctl", "show", unit, "-p", "WatchdogTimestampMonotonic", "--value"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return int(out or 0) / 1e6


def heartbeat(run_dir):
    try:
        with open(os.path.join(run_dir, "heartbeat.json")) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def latest_step(run_dir):
    try:
        with open(os.path.join(run_dir, "checkpoints", "latest")) as handle:
            return int(re.search(r"(\d+)\s*$", handle.read()).group(1))
    except (OSError, AttributeError, ValueError):
        return None


def wait(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(POLL)
    sys.exit(f"measure: timed out after {timeout}s waiting for {what}")


def training_past(run_dir, step, old_pid):
    beat = heartbeat(run_dir)
    return beat.get("pid") != old_pid and beat.get("status") == "training" and beat.get("step", -1) > step


def signal_all(unit, sig):
    subprocess.run(["systemctl", "kill", "--signal=" + sig, unit], check=True)


def recover(unit, run_dir, log, before, t0, timeout):
    """Times of: old main process gone, new one started, new one training past its resume step."""
    old = before["MainPID"]
    old_beat_pid = heartbeat(run_dir).get("pid")
    wait(lambda: show(unit)["MainPID"] != old, timeout, "the old process to end")
    detected = time.monotonic() - t0
    wait(lambda: show(unit)["MainPID"] not in (0, old) and show(unit)["ActiveState"] == "active", timeout, "a new process")
    restarted = time.monotonic() - t0
    resumed = wait(lambda: resumed_step(log, before["log_size"]), timeout, "the resume line in the log")
    wait(lambda: training_past(run_dir, resumed, old_beat_pid), timeout, "a trained step after the resume")
    training = time.monotonic() - t0
    return {"detected_s": round(detected, 1), "restarted_s": round(restarted, 1), "training_s": round(training, 1),
            "resumed_step": resumed, "restarts": int(show(unit)["NRestarts"])}


def resumed_step(log, offset):
    with open(log, errors="replace") as handle:
        handle.seek(offset)
        found = re.findall(r"resumed from \S+ at step (\d+)", handle.read())
    return int(found[-1]) if found else None


def state(unit, run_dir, log):
    """Frozen state at the fault: the step trained, the newest checkpoint, the log's size."""
    s = show(unit)
    s["step"] = heartbeat(run_dir).get("step")
    s["checkpoint"] = latest_step(run_dir)
    s["log_size"] = os.path.getsize(log)
    return s


def main(action, unit, run_dir, log, crash_pth=None):
    # a checkpoint and a few steps after it: the fault loses something
    wait(lambda: (latest_step(run_dir) or 0) > 0 and heartbeat(run_dir).get("step", 0) > latest_step(run_dir) + 2,
         600, "a checkpoint and steps after it")
    if action == "kill":
        signal_all(unit, "SIGSTOP")  # frozen first: what is read is exactly what the kill ends
        before = state(unit, run_dir, log)
        t0 = time.monotonic()
        signal_all(unit, "SIGKILL")
        result = recover(unit, run_dir, log, before, t0, 600)
    elif action == "hang":
        # frozen right after a ping, so that the watchdog's whole interval runs from the freeze whatever a
        # step takes on this machine (a slow step would otherwise leave less than the interval to wait)
        ping = last_ping(unit)
        wait(lambda: last_ping(unit) > ping, 300, "a watchdog ping")
        before = state(unit, run_dir, log)
        t0 = time.monotonic()
        signal_all(unit, "SIGSTOP")  # every process of the job: nothing pings
        since_ping = t0 - last_ping(unit)  # the same clock as systemd's (CLOCK_MONOTONIC)
        result = recover(unit, run_dir, log, before, t0, 600)
        result["since_ping_s"] = round(since_ping, 2)
        result["killed_after_ping_s"] = round(since_ping + result["detected_s"], 1)
    elif action == "crashloop":
        # a crash at every start of the unit: a .pth file of the venv (run by `site` at interpreter start-up)
        # exits 1 before the trainer runs. Only under the unit (its environment names the watchdog; a
        # playbook's own `dflash train --check` does not), and in no file that a deploy manages.
        # from a fresh start-rate window, as for a job that ran long before it began to crash: the restarts of
        # (a) and (b), a minute ago, would otherwise still count, or the window would end inside the loop
        subprocess.run(["systemctl", "reset-failed", unit], check=True)
        with open(crash_pth, "w") as handle:
            handle.write("import os; (print('injected crash at start-up', flush=True), os._exit(1)) "
                         "if os.environ.get('DFLASH_WATCHDOG_SEC') else None\n")
        before = state(unit, run_dir, log)
        t0 = time.monotonic()
        signal_all(unit, "SIGKILL")
        wait(lambda: show(unit)["ActiveState"] == "failed", 600, "the unit to fail")
        failed = time.monotonic() - t0
        time.sleep(3)  # nothing more happens
        with open(log, errors="replace") as handle:
            handle.seek(before["log_size"])
            crashes = handle.read().count("injected crash at start-up")
        result = {"failed_s": round(failed, 1), "crashes": crashes, **show(unit)}
    else:
        sys.exit(f"measure: unknown action {action!r}")
    result.update(action=action, step_at_fault=before["step"], checkpoint_at_fault=before["checkpoint"])
    if "resumed_step" in result:
        result["steps_lost"] = before["step"] - result["resumed_step"]
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
