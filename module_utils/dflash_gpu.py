# Copyright: dflash authors
# Apache-2.0
"""Reading GPUs through nvidia-smi: the one piece of code used by gpu_facts, unit and health."""

from __future__ import annotations

GPU_FIELDS = (
    "index",
    "uuid",
    "name",
    "driver_version",
    "memory.total",
    "memory.used",
    "utilization.gpu",
    "mig.mode.current",
)
PROCESS_FIELDS = ("gpu_uuid", "pid", "process_name", "used_memory")

# nvidia-smi prints these instead of a value (MIG mode, virtualized GPUs, old drivers).
_MISSING = {"", "[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]", "[insufficient permissions]"}


class GpuQueryError(Exception):
    """nvidia-smi is missing or cannot talk to the driver. ``kind`` says which."""

    def __init__(self, kind, message):
        self.kind = kind  # missing | driver_mismatch | no_driver | no_devices | failed | parse
        super().__init__(message)


def parse_value(raw):
    """A nvidia-smi CSV cell, or None for [N/A] / [Not Supported] and friends."""
    value = raw.strip()
    return None if value.lower() in _MISSING else value


def _int_or_none(raw):
    value = parse_value(raw)
    if value is None:
        return None
    try:
        return int(float(value))
    except ValueError:
        return None


def _split_rows(text, width, what):
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        # GPU names contain no commas; the process name is the only free-text
        # field, so split at most width-1 times from each end around it.
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) > width and what == "process":
            cells = cells[:2] + [",".join(cells[2 : len(cells) - 1])] + cells[-1:]
        if len(cells) != width:
            raise GpuQueryError(
                "parse",
                f"cannot parse nvidia-smi {what} output line {lineno}: expected {width} comma-separated "
                f"fields, got {len(cells)}: {line.strip()!r}",
            )
        rows.append(cells)
    return rows


def parse_gpu_csv(text):
    """Parse ``nvidia-smi --query-gpu=<GPU_FIELDS> --format=csv,noheader,nounits``."""
    gpus = []
    for cells in _split_rows(text, len(GPU_FIELDS), "GPU"):
        index, uuid, name, driver, total, used, util, mig = cells
        mig_mode = parse_value(mig)
        gpus.append(
            {
                "index": _int_or_none(index),
                "uuid": parse_value(uuid),
                "name": parse_value(name),
                "driver_version": parse_value(driver),
                "memory_total_mib": _int_or_none(total),
                "memory_used_mib": _int_or_none(used),
                "utilization_pct": _int_or_none(util),
                "mig_mode": mig_mode,
                "mig_enabled": (mig_mode or "").lower() == "enabled",
            }
        )
    return gpus


def parse_process_csv(text, gpus=()):
    """Parse ``nvidia-smi --query-compute-apps=<PROCESS_FIELDS> --format=csv,noheader,nounits``.

    Each process gets ``gpu_index`` from the GPU with the same UUID (None for a UUID
    not in ``gpus``, e.g. a MIG instance). ``used_memory_mib`` is None where the driver
    does not report it (MIG mode, some containers).
    """
    index_by_uuid = {gpu["uuid"]: gpu["index"] for gpu in gpus}
    processes = []
    for uuid, pid, pname, used in _split_rows(text, len(PROCESS_FIELDS), "process"):
        gpu_uuid = parse_value(uuid)
        processes.append(
            {
                "gpu_uuid": gpu_uuid,
                "gpu_index": index_by_uuid.get(gpu_uuid),
                "pid": _int_or_none(pid),
                "process_name": parse_value(pname),
                "used_memory_mib": _int_or_none(used),
            }
        )
    return processes


def classify_failure(rc, stdout, stderr):
    """Turn a failed nvidia-smi call into a GpuQueryError with a message that says what to do."""
    text = "\n".join(part for part in (stderr, stdout) if part).strip()
    lowered = text.lower()
    if "driver/library version mismatch" in lowered:
        return GpuQueryError(
            "driver_mismatch",
            "nvidia-smi: Driver/library version mismatch: the NVIDIA userspace libraries do not match the "
            "loaded kernel driver. On a host: reboot or reload the nvidia kernel modules after a driver "
            "upgrade. In a container: install the userspace of exactly the host's driver version. "
            f"nvidia-smi said: {text}",
        )
    if "couldn't communicate with the nvidia driver" in lowered or "failed to initialize nvml" in lowered:
        return GpuQueryError(
            "no_driver",
            "nvidia-smi cannot reach the NVIDIA driver: check that the driver is loaded on the host and "
            f"that /dev/nvidia* are passed into the container. nvidia-smi said: {text}",
        )
    if "no devices were found" in lowered:
        return GpuQueryError("no_devices", f"nvidia-smi found no GPUs: {text}")
    return GpuQueryError("failed", f"nvidia-smi failed with exit status {rc}: {text or '(no output)'}")


def find_nvidia_smi(host):
    return host.which("nvidia-smi")


def query_gpus(host, nvidia_smi=None, processes=True):
    """Query GPUs (and their compute processes) on ``host``; return ``(gpus, processes)``.

    Raises GpuQueryError when nvidia-smi is absent (kind ``missing``) or fails.
    """
    binary = nvidia_smi or find_nvidia_smi(host)
    if not binary:
        raise GpuQueryError(
            "missing",
            "nvidia-smi not found in PATH: install the NVIDIA driver utilities (in a container, the "
            "userspace matching the host driver) or, for a CPU-only host, list no GPU ids.",
        )
    rc, out, err = host.run([binary, "--query-gpu=" + ",".join(GPU_FIELDS), "--format=csv,noheader,nounits"])
    if rc != 0:
        raise classify_failure(rc, out, err)
    gpus = parse_gpu_csv(out)
    apps = []
    if processes:
        rc, out, err = host.run(
            [binary, "--query-compute-apps=" + ",".join(PROCESS_FIELDS), "--format=csv,noheader,nounits"]
        )
        if rc != 0:
            raise classify_failure(rc, out, err)
        apps = parse_process_csv(out, gpus)
    return gpus, apps


def used_memory_by_index(gpus):
    return {gpu["index"]: gpu["memory_used_mib"] for gpu in gpus}


def missing_gpu_ids(gpus, wanted_ids):
    present = {gpu["index"] for gpu in gpus}
    return sorted(set(wanted_ids) - present)


def gpus_below(gpus, wanted_ids, min_mib):
    """Listed GPUs whose used memory is below ``min_mib`` (or unknown): ``[(index, used_or_None)]``."""
    used = used_memory_by_index(gpus)
    return [(i, used.get(i)) for i in wanted_ids if used.get(i) is None or used[i] < min_mib]


def gpus_above(gpus, wanted_ids, max_mib):
    """Listed GPUs still holding more than ``max_mib``: ``[(index, used)]``."""
    used = used_memory_by_index(gpus)
    return [(i, used[i]) for i in wanted_ids if used.get(i) is not None and used[i] > max_mib]


def format_gpu_table(gpus, processes=()):
    """A fixed-width table for play output and diagnoses."""
    if not gpus:
        return "(no GPUs)"
    lines = ["idx  name                  used/total MiB      util  mig       processes"]
    for gpu in gpus:
        procs = [p for p in processes if p["gpu_uuid"] == gpu["uuid"]]
        proc_text = ", ".join(
            f"{p['pid']} {p['process_name'] or '?'} {p['used_memory_mib'] if p['used_memory_mib'] is not None else '?'}MiB"
            for p in procs
        )
        used = "?" if gpu["memory_used_mib"] is None else gpu["memory_used_mib"]
        total = "?" if gpu["memory_total_mib"] is None else gpu["memory_total_mib"]
        util = "n/a" if gpu["utilization_pct"] is None else f"{gpu['utilization_pct']}%"
        lines.append(
            f"{gpu['index']!s:<4} {(gpu['name'] or '?')[:21]:<21} {f'{used}/{total}':<19} {util:<5} "
            f"{(gpu['mig_mode'] or 'n/a'):<9} {proc_text or '-'}"
        )
    return "\n".join(lines)
