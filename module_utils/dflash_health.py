# Copyright: dflash authors
# Apache-2.0
"""Is the training job really training? The invariants of DESIGN.md §1 and a diagnosis when not.

Invariants (names as returned in ``failed_invariants``):

* ``log``      - the log file exists and grows (grew during the check, or is non-empty and
                 was written within ``progress_window``).
* ``unit``     - the unit is active and its MainPID is alive.
* ``gpu``      - every listed GPU uses at least ``gpu_min_memory_mib`` (the model is loaded).
* ``progress`` - the heartbeat step advances: it advanced during the check, or the heartbeat
                 of a live trainer in status ``training`` is younger than ``progress_window``
                 (the trainer rewrites it only at logging intervals, i.e. after steps).

A job whose heartbeat says ``finished`` and whose unit exited 0 is healthy (and ``finished``).
A failure that cannot heal (the unit is dead, nvidia-smi is missing) ends the wait at once;
any other failure ends it when it has lasted ``progress_window`` or at ``timeout``.
"""

from __future__ import annotations

import json
import os
import time

from ansible.module_utils.dflash_gpu import GpuQueryError, format_gpu_table, gpus_below, query_gpus
from ansible.module_utils.dflash_host import read_text, tail_lines
from ansible.module_utils.dflash_unit import is_running, pid_alive

INVARIANTS = ("log", "unit", "gpu", "progress")


def read_heartbeat(path):
    """The heartbeat dict, or ``(None, reason)`` when missing or unreadable."""
    text = read_text(path)
    if text is None:
        return None, f"heartbeat file {path} does not exist"
    try:
        data = json.loads(text)
    except ValueError as exc:
        return None, f"heartbeat file {path} is not JSON ({exc})"
    if not isinstance(data, dict) or not isinstance(data.get("step"), int):
        return None, f"heartbeat file {path} has no integer 'step'"
    return data, None


def observe(host, params, backend_status, wall=None):
    """One snapshot of everything the invariants look at."""
    wall = time.time() if wall is None else wall
    obs = {"wall": wall, "log_exists": False, "log_size": 0, "log_mtime": None}
    try:
        st = os.stat(params["log_path"])
        obs.update(log_exists=True, log_size=st.st_size, log_mtime=st.st_mtime)
    except OSError:
        pass
    unit = dict(backend_status)
    unit["main_pid_alive"] = pid_alive(unit.get("main_pid"))
    obs["unit"] = unit
    obs["heartbeat"], obs["heartbeat_error"] = read_heartbeat(params["heartbeat_path"])
    hb_pid = (obs["heartbeat"] or {}).get("pid")
    obs["heartbeat_pid_alive"] = pid_alive(hb_pid) if hb_pid else None
    obs["gpus"], obs["gpu_processes"], obs["gpu_error"], obs["gpu_error_kind"] = [], [], None, None
    if params.get("gpu_ids"):
        try:
            obs["gpus"], obs["gpu_processes"] = query_gpus(host)
        except GpuQueryError as exc:
            obs["gpu_error"], obs["gpu_error_kind"] = str(exc), exc.kind
    return obs


class HealthTracker:
    """Accumulates observations; ``update`` returns the failures of the latest one.

    Each failure is ``{"invariant", "reason", "final"}``; ``final`` means waiting longer
    cannot help. ``now`` is a monotonic clock (seconds), observations carry wall time.
    """

    def __init__(self, params):
        self.params = params
        self.window = float(params.get("progress_window", 120))
        self.started = None
        self.first_log_size = None
        self.log_grew = False
        self.step = None
        self.step_since = None
        self.first_step = None
        self.failing_since = {}
        self.finished = False

    def update(self, obs, now):
        if self.started is None:
            self.started = now
        failures = []
        self.finished = False
        hb = obs.get("heartbeat")
        unit = obs["unit"]
        unit_exit = unit.get("exit_status")
        finished = bool(hb and hb.get("status") == "finished" and not is_running(unit) and unit_exit in (0, None))

        # log
        if not obs["log_exists"]:
            failures.append(("log", f"log file {self.params['log_path']} does not exist", False))
        else:
            if self.first_log_size is None:
                self.first_log_size = obs["log_size"]
            if obs["log_size"] > self.first_log_size:
                self.log_grew = True
            recent = obs["log_mtime"] is not None and obs["wall"] - obs["log_mtime"] <= self.window
            if not (self.log_grew or (obs["log_size"] > 0 and recent) or finished):
                failures.append(
                    ("log", f"log file {self.params['log_path']} did not grow for {now - self.started:.0f}s "
                     f"(size {obs['log_size']} bytes)", False)
                )  # fmt: skip

        # unit
        if finished:
            pass
        elif not is_running(unit):
            if unit.get("exit_status") not in (None,):
                reason = f"unit {unit['active_state']}: exit status {unit['exit_status']}"
            elif unit.get("load_state") == "not-found":
                reason = "unit not found: it was never started, or it exited and was unloaded"
            else:
                reason = f"unit {unit['active_state']} ({unit.get('sub_state')})"
            failures.append(("unit", reason, True))
        elif not unit.get("main_pid"):
            failures.append(("unit", f"unit {unit['active_state']} but has no MainPID yet", False))
        elif not unit.get("main_pid_alive"):
            failures.append(("unit", f"MainPID {unit['main_pid']} is not alive", False))

        # gpu
        gpu_ids = self.params.get("gpu_ids") or []
        if gpu_ids and not finished:
            if obs.get("gpu_error"):
                final = obs.get("gpu_error_kind") in ("missing", "driver_mismatch", "no_driver")
                failures.append(("gpu", obs["gpu_error"], final))
            else:
                present = {g["index"] for g in obs["gpus"]}
                absent = [i for i in gpu_ids if i not in present]
                if absent:
                    failures.append(("gpu", f"GPU(s) {absent} not visible to nvidia-smi (visible: {sorted(present)})", True))
                low = [(i, used) for i, used in gpus_below(obs["gpus"], gpu_ids, self.params["gpu_min_memory_mib"]) if i in present]
                if low:
                    detail = ", ".join(f"GPU {i}: {'?' if used is None else used} MiB" for i, used in low)
                    failures.append(
                        ("gpu", f"GPU memory below {self.params['gpu_min_memory_mib']} MiB (model not loaded?): {detail}", False)
                    )

        # progress
        if not finished:
            failures.extend(self._progress(obs, now))

        for invariant in INVARIANTS:
            if invariant not in {f[0] for f in failures}:
                self.failing_since.pop(invariant, None)
        result = []
        for invariant, reason, final in failures:
            since = self.failing_since.setdefault(invariant, now)
            # Anything failing for a whole progress window will not heal by waiting.
            result.append({"invariant": invariant, "reason": reason, "final": final or now - since >= self.window})
        self.finished = finished and not result
        return result

    def _progress(self, obs, now):
        hb = obs.get("heartbeat")
        if hb is None:
            return [("progress", f"no heartbeat: {obs['heartbeat_error']}", False)]
        step = hb["step"]
        status = hb.get("status")
        if status == "failed":
            return [("progress", f"trainer reported status 'failed' at step {step}", True)]
        if self.first_step is None:
            self.first_step = step
        if step != self.step:
            self.step, self.step_since = step, now
        advanced = step > self.first_step
        alive = bool(obs.get("heartbeat_pid_alive"))
        age = obs["wall"] - float(hb.get("time") or 0)
        if alive and (advanced or (status == "training" and step > 0 and age <= self.window)):
            return []
        observed = now - self.step_since
        if not alive:
            return [("progress", f"no progress: the heartbeat's trainer pid {hb.get('pid')} is not running "
                     f"(heartbeat step {step}, status {status}, written {age:.0f}s ago)", False)]  # fmt: skip
        if status == "starting" or step == 0:
            return [("progress", f"no progress yet: heartbeat status {status!r}, step {step} for {observed:.0f}s", False)]
        stayed = max(observed, age)
        return [("progress", f"no progress: heartbeat step stayed at {step} for {stayed:.0f}s", stayed >= self.window)]


def format_diagnosis(name, healthy, failures, obs, log_tail, elapsed, log_path, finished=False):
    unit = obs["unit"]
    hb = obs.get("heartbeat") or {}
    if healthy:
        head = f"dflash job {name!r} is healthy" + (" (finished)" if finished else "") + f" after {elapsed:.0f}s"
    else:
        head = f"dflash job {name!r} is NOT healthy after {elapsed:.0f}s:"
    lines = [head]
    for failure in failures:
        lines.append(f"  - {failure['invariant']}: {failure['reason']}")
    lines.append(
        f"unit: backend={unit.get('backend', '?')} active_state={unit.get('active_state')} sub_state={unit.get('sub_state')} "
        f"main_pid={unit.get('main_pid') or '-'} exit_status={'-' if unit.get('exit_status') is None else unit['exit_status']}"
    )
    if hb:
        age = obs["wall"] - float(hb.get("time") or 0)
        lines.append(
            f"heartbeat: step={hb.get('step')} epoch={hb.get('epoch')} status={hb.get('status')} "
            f"loss={hb.get('loss')} tau={hb.get('tau')} tokens/s={hb.get('tokens_per_s')} age={age:.0f}s"
        )
        if hb.get("eval_step") is not None:
            lines.append(
                f"last eval (step {hb.get('eval_step')}): simulated tau={hb.get('eval_tau')} "
                f"real acceptance length={hb.get('eval_acceptance_length')} (speculative decoding with the target)"
            )
    else:
        lines.append(f"heartbeat: {obs.get('heartbeat_error')}")
    if obs.get("gpus") or obs.get("gpu_error"):
        lines.append("GPUs:")
        lines.append(obs["gpu_error"] if obs.get("gpu_error") else format_gpu_table(obs["gpus"], obs.get("gpu_processes", ())))
    if log_tail is None:
        lines.append(f"log {log_path}: missing")
    else:
        lines.append(f"log {log_path} (last {len(log_tail)} lines):")
        lines.extend("  | " + line for line in log_tail)
    return "\n".join(lines)


def check_health(host, params, status_probe, wall_clock=time.time):
    """Poll until all invariants hold, one is final, or ``timeout``. Returns the module result.

    ``status_probe()`` returns the unit status dict (see dflash_unit backends).
    """
    tracker = HealthTracker(params)
    start = host.now()
    timeout = float(params.get("timeout", 300))
    while True:
        obs = observe(host, params, status_probe(), wall=wall_clock())
        now = host.now()
        failures = tracker.update(obs, now)
        if not failures or any(f["final"] for f in failures) or now - start >= timeout:
            break
        host.sleep(min(float(params.get("poll_interval", 5)), max(0.0, timeout - (now - start))) or 0.1)
    elapsed = host.now() - start
    log_tail = tail_lines(params["log_path"], int(params.get("log_lines", 40)))
    healthy = not failures
    hb = obs.get("heartbeat") or {}
    diagnosis = format_diagnosis(params["name"], healthy, failures, obs, log_tail, elapsed, params["log_path"], tracker.finished)
    return {
        "healthy": healthy,
        "finished": tracker.finished,
        "failed_invariants": [f["invariant"] for f in failures],
        "failures": [{"invariant": f["invariant"], "reason": f["reason"]} for f in failures],
        "diagnosis": diagnosis,
        "unit": obs["unit"],
        "step": hb.get("step"),
        "epoch": hb.get("epoch"),
        "loss": hb.get("loss"),
        "tokens_per_s": hb.get("tokens_per_s"),
        "tau": hb.get("tau"),
        "eval_tau": hb.get("eval_tau"),
        "acceptance_length": hb.get("eval_acceptance_length"),
        "heartbeat": obs.get("heartbeat"),
        "gpus": obs.get("gpus", []),
        "gpu_processes": obs.get("gpu_processes", []),
        "gpu_table": format_gpu_table(obs["gpus"], obs.get("gpu_processes", ())) if obs.get("gpus") else None,
        "log_tail": log_tail or [],
        "elapsed_s": round(elapsed, 1),
    }
