# Copyright: dflash authors
# Apache-2.0
"""Reading GPUs through nvidia-smi: the one piece of code used by gpu_facts, unit and health."""

from __future__ import annotations

import re

from ansible.module_utils.dflash_host import printable

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
                # any process may name itself: escaped (dflash_host.printable) like all text of the trainer's
                "process_name": printable(parse_value(pname) or "") or None,
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


# --- GPU health: what makes a GPU unfit to start on (nvidia-smi -q, the kernel's Xid records) -----------------

# Xid events after which a GPU must be reset, the node rebooted or the GPU replaced (NVIDIA's Xid catalog):
# 48 double-bit ECC, 64 row-remap failure, 74 NVLink error, 79 fallen off the bus, 95 uncontained ECC,
# 119/120 GSP errors, 140 unrecovered ECC.
FATAL_XIDS = {48: "double-bit ECC error", 64: "row remapping failed", 74: "NVLink error", 79: "fallen off the bus",
              95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error", 140: "unrecovered ECC error"}  # fmt: skip


def parse_query(text):
    """``nvidia-smi -q`` as ``{section header: {"a/b/key": value}}`` (``GPU 00000000:00:06.0`` sections), and the
    bus ids it could not reach (``Unable to determine the device handle for GPU ...: GPU is lost``)."""
    sections, lost = {}, {}
    current, stack = None, []
    for raw in text.splitlines():
        match = re.match(r"^Unable to determine the device handle for GPU\s*([0-9A-Fa-f:.]+):\s*(.*)$", raw.strip())
        if match:
            lost[match.group(1).upper()] = match.group(2).strip()
            continue
        if re.match(r"^GPU [0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-9A-Fa-f]+$", raw):
            current, stack = sections.setdefault(raw.split()[1].upper(), {}), []
            continue
        if current is None or not raw.strip():
            continue
        indent = len(raw) - len(raw.lstrip())
        key, sep, value = raw.strip().partition(":")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([k for _, k in stack] + [key.strip()])
        if sep and value.strip():
            current[path] = value.strip()
        else:
            stack.append((indent, key.strip()))
    return sections, lost


def _count(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0  # N/A


def health_faults(section):
    """The faults of one GPU's ``nvidia-smi -q`` section, each a short sentence with what to do."""
    faults = []
    uncorrectable = {k.split("/")[-1]: _count(v) for k, v in section.items()
                     if k.startswith("ECC Errors/Volatile/") and "Uncorrectable" in k}  # fmt: skip
    bad = {k: n for k, n in uncorrectable.items() if n > 0}
    if bad:
        faults.append("uncorrectable ECC errors since the driver loaded ("
                      + ", ".join(f"{k} {n}" for k, n in sorted(bad.items())) + "): reset the GPU before using it")
    if section.get("Remapped Rows/Remapping Failure Occurred", "").lower() == "yes":
        faults.append("row remapping failed: the GPU's memory cannot be repaired (replace the GPU)")
    if section.get("Remapped Rows/Pending", "").lower() == "yes":
        faults.append("a row remap is pending: reset the GPU (or reboot the node) to apply it")
    if section.get("Retired Pages/Pending Page Blacklist", "").lower() == "yes":
        faults.append("a page retirement is pending: reset the GPU (or reboot the node) to apply it")
    return faults


def parse_xids(text):
    """Fatal Xid records of a kernel log (``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., ...``): ``{bus: [line]}``
    with the bus as ``0000:3B:00``."""
    found = {}
    for line in text.splitlines():
        match = re.search(r"NVRM: Xid \(PCI:([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+)(?:\.\d)?\): (\d+)", line)
        if match and int(match.group(2)) in FATAL_XIDS:
            xid = int(match.group(2))
            found.setdefault(match.group(1).upper(), []).append(f"Xid {xid} ({FATAL_XIDS[xid]}) in the kernel log since boot")
    return found


def _bus_key(bus_id):
    """``00000000:00:06.0`` / ``0000:00:06`` -> ``0000:00:06`` (domain of 4 digits, no function)."""
    domain, _, rest = bus_id.upper().partition(":")
    return f"{domain[-4:]}:{rest.split('.')[0]}"


def gpu_faults(host, gpus, nvidia_smi=None, kernel_log=None):
    """``({index: [faults]}, [faults of GPUs that nvidia-smi lost])`` for the ``gpus`` of ``query_gpus``.

    ``kernel_log`` is the kernel's log text (a node's ``dmesg``); None reads ``dmesg`` where this host may
    (a container usually may not: then Xids are not looked at).
    """
    binary = nvidia_smi or find_nvidia_smi(host)
    if not binary:
        return {}, []
    rc, out, err = host.run([binary, "-q"])
    sections, lost = parse_query(f"{out}\n{err}")
    if kernel_log is None:
        rc_log, kernel_log, _ = host.run(["dmesg"])
        kernel_log = kernel_log if rc_log == 0 else ""
    xids = parse_xids(kernel_log or "")
    by_uuid = {section.get("GPU UUID"): (bus, section) for bus, section in sections.items()}
    faults = {}
    for gpu in gpus:
        bus, section = by_uuid.get(gpu.get("uuid"), (None, None))
        found = health_faults(section) if section else []
        if bus:
            found += xids.get(_bus_key(bus), [])
        if found:
            faults[gpu["index"]] = found
    lost_faults = [f"GPU {bus} is lost ({why}): reboot the node; until then the GPU indices shift"
                   for bus, why in sorted(lost.items())]  # fmt: skip
    return faults, lost_faults
