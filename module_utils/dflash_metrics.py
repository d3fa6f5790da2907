# Copyright: dflash authors
# Apache-2.0
"""The job's state as Prometheus metrics, for node_exporter's textfile collector.

Root runs it on a timer where the job's unit runs (the job role installs ``dflash-metrics-NAME.timer``): one
snapshot of the health check (module_utils/dflash_health.py: the same state as ``status``; never a signal to the
job, so no hang evidence is asked for), rendered in Prometheus' text format and written atomically (a temp file in
the same directory, fsync, rename) to ``TEXTFILE_DIR/dflash-NAME.prom``. Every file of the trainer's is read
through dflash_untrusted (the run directory is hostile to root).

Run as ``python3 dflash-metrics CONFIG.json``: the config holds the health check's parameters (``name``,
``backend``, ``state_dir``, ``log_path``, ``heartbeat_path``, ``gpu_ids``, ``gpu_min_memory_mib``,
``progress_window``, ``start_window``, ``node_heartbeat_path``, ``node_rank``) and ``textfile_dir``.
Standard library only.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from ansible.module_utils.dflash_health import (
    STATES,
    HealthTracker,
    failure_class,
    observe,
    unit_gpu_memory,
)
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_unit import get_backend, resolve_backend
from ansible.module_utils.dflash_unit_spec import UnitError, check_name, unit_name
from ansible.module_utils.dflash_untrusted import modified_at

PREFIX = "dflash_job_"
# name -> (type, help); the order of the file
METRICS = {
    "state": ("gauge", "1 for the job's state (the state of `status`: training, hung, crashed, lost, ...), 0 for the others."),
    "healthy": ("gauge", "1 when every health invariant holds (log, unit, gpu, progress, joined)."),
    "step": ("gauge", "The trainer's step (its heartbeat of this launch)."),
    "tau": ("gauge", "Simulated acceptance length tau of the last logged window."),
    "eval_tau": ("gauge", "Simulated tau of the last evaluation."),
    "acceptance_length": ("gauge", "Real acceptance length of the last evaluation (speculative decoding with the target)."),
    "tokens_per_second": ("gauge", "Training tokens per second (while it trains)."),
    "last_step_age_seconds": ("gauge", "Seconds since the trainer's last heartbeat of this launch."),
    "last_checkpoint_age_seconds": ("gauge", "Seconds since the last checkpoint was published."),
    "checkpoint_step": ("gauge", "Step of the last checkpoint."),
    "restarts": ("gauge", "Restarts of the unit by its restart policy (systemd NRestarts)."),
    "watchdog_kills": ("gauge", "Kills of a hung trainer by the unit's watchdog."),
    "failure": ("gauge", "1 labelled with the class of the job's last failure (dflash/runtime/failures.py)."),
    "gpu_memory_mib": ("gauge", "GPU memory held by the job's processes, per GPU."),
    "gpu_min_memory_mib": ("gauge", "The health check's GPU memory threshold."),
    "metrics_timestamp_seconds": ("gauge", "When this file was written (Unix time)."),
}


def launch_started_at(host, backend_name, name):
    """Wall-clock start of the unit's current or last launch (as library/dflash_health.py), or None."""
    if backend_name != "systemd":
        return None
    rc, out, _err = host.run(["systemctl", "show", unit_name(name), "--property=ExecMainStartTimestampMonotonic"])
    value = out.strip().partition("=")[2] if rc == 0 else ""
    if not value.isdigit() or int(value) == 0:
        return None
    return time.time() - (time.monotonic() - int(value) / 1e6)


def snapshot(host, params, status_probe, wall=None):
    """The health check's one-snapshot view of the job: ``(state, failures, obs)``. No signal is sent."""
    wall = time.time() if wall is None else wall
    obs = observe(host, params, status_probe(), wall=wall)
    tracker = HealthTracker(params, snapshot=True)
    failures = tracker.update(obs, host.now())
    return tracker.state, failures, obs


def samples(params, state, failures, obs):
    """``[(metric, labels, value)]`` of one snapshot; a value not known is left out."""
    job = params["name"]
    hb = (obs.get("heartbeat") if obs.get("heartbeat_current") else None) or {}
    unit = obs.get("unit") or {}
    wall = obs["wall"]
    out = [("state", {"state": s}, 1 if s == state else 0) for s in STATES]
    out.append(("healthy", {}, 0 if failures else 1))
    for metric, field in (("step", "step"), ("tau", "tau"), ("eval_tau", "eval_tau"),
                          ("acceptance_length", "eval_acceptance_length")):
        out.append((metric, {}, hb.get(field)))
    out.append(("tokens_per_second", {}, hb.get("tokens_per_s") if state == "training" else 0))
    if hb.get("time") and hb.get("status") != "starting":
        out.append(("last_step_age_seconds", {}, max(wall - float(hb["time"]), 0.0)))
    published = modified_at(os.path.join(os.path.dirname(params["heartbeat_path"]), "checkpoints", "latest"))
    if published is not None:
        out.append(("last_checkpoint_age_seconds", {}, max(wall - published, 0.0)))
    out.append(("checkpoint_step", {}, obs.get("checkpoint_step")))
    out.append(("restarts", {}, unit.get("restarts") or 0))
    out.append(("watchdog_kills", {}, unit.get("watchdog_kills") or 0))
    cls = failure_class(unit, hb or None)
    if cls:
        out.append(("failure", {"class": cls}, 1))
    gpu_ids = params.get("gpu_ids") or []
    if gpu_ids and obs.get("gpus"):
        for index, (used, _note) in sorted(unit_gpu_memory(obs, gpu_ids).items()):
            out.append(("gpu_memory_mib", {"gpu": str(index)}, used))
    if gpu_ids:
        out.append(("gpu_min_memory_mib", {}, params.get("gpu_min_memory_mib")))
    out.append(("metrics_timestamp_seconds", {}, wall))
    # `dflash_job`, not `job`: Prometheus gives every scraped series the scrape's own `job` label
    return [(metric, {"dflash_job": job, **labels}, value) for metric, labels, value in out if value is not None]


def label_value(value):
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def number(value):
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def render(rows):
    """Prometheus' text exposition format (HELP and TYPE once per metric, in METRICS' order)."""
    lines = []
    for metric, (kind, text) in METRICS.items():
        mine = [r for r in rows if r[0] == metric]
        if not mine:
            continue
        lines.append(f"# HELP {PREFIX}{metric} {text}")
        lines.append(f"# TYPE {PREFIX}{metric} {kind}")
        for _metric, labels, value in mine:
            body = ",".join(f'{k}="{label_value(v)}"' for k, v in labels.items())
            lines.append(f"{PREFIX}{metric}{{{body}}} {number(value)}")
    return "\n".join(lines) + "\n"


def write_textfile(host, directory, name, text):
    """``DIRECTORY/dflash-NAME.prom``, atomically (node_exporter never reads half a file): a temp file whose name
    does not end in .prom (the collector skips it), fsync, rename."""
    check_name(name)
    path = os.path.join(directory, f"dflash-{name}.prom")
    host.atomic_write(path, text, mode=0o644)
    return path


def collect(params, host=None, wall=None):
    """One snapshot of the job rendered as text."""
    host = host or LocalHost()
    backend = get_backend(resolve_backend(params.get("backend") or "auto"), host)
    spec = {"name": params["name"], "state_dir": params["state_dir"]}

    def status_probe():
        status = backend.status(spec)
        status["backend"] = backend.name
        status["started_at"] = launch_started_at(host, backend.name, params["name"])
        return status

    state, failures, obs = snapshot(host, params, status_probe, wall=wall)
    return render(samples(params, state, failures, obs))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.stderr.write("usage: dflash-metrics CONFIG.json\n")
        return 2
    with open(argv[0]) as handle:  # root's own file (the job role writes it)
        params = json.load(handle)
    try:
        text = collect(params)
    except (UnitError, OSError) as exc:
        sys.stderr.write(f"dflash-metrics {params.get('name')}: {exc}\n")
        return 1
    path = write_textfile(LocalHost(), params["textfile_dir"], params["name"], text)
    sys.stdout.write(f"dflash-metrics: wrote {path}\n")
    return 0
