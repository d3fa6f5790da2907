"""Filters of the container role: Proxmox `pct` config handling and NVIDIA device passthrough."""

from __future__ import annotations

import re

# pct options that this role owns when they are numbered (mp0, dev3, ...): entries of
# these families beyond the desired ones are deleted.
MANAGED_FAMILIES = ("mp", "dev")


def pct_config_to_dict(text: str) -> dict[str, str]:
    """Parse `pct config VMID` output (`key: value` lines) into a dict.

    Pending changes and snapshot sections (`[name]`) are ignored: only the current config counts.
    """
    config: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("["):
            break
        key, sep, value = line.partition(": ")
        if sep and key and not key.startswith(("#", "lxc.")):
            config[key.strip()] = value.strip()
    return config


def _natural_key(path: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


# The nodes CUDA opens: the GPUs, the control node and unified memory. nvidia-modeset
# (display), nvswitch/nvlink (the fabric manager's) are not passed; MIG caps only for MIG.
CUDA_NODE = re.compile(r"^(nvidia\d+|nvidiactl|nvidia-uvm|nvidia-uvm-tools)$")
MIG_NODE = re.compile(r"^nvidia-caps/nvidia-cap\d+$")
# Modes inside the container: what the driver gives these nodes on the host by default.
NODE_MODE = "0666"
CAP_MODE = "0444"
# nvidia-cap1 is MIG's config capability (creating and destroying MIG instances): root's only, as the driver
# makes it on the host (0400); the others (cap2: monitor, the instances' access caps) read-only for everyone.
MIG_CONFIG_NODE = "nvidia-caps/nvidia-cap1"
CONFIG_CAP_MODE = "0400"


def _node_mode(name: str, mode: str) -> str:
    if name == MIG_CONFIG_NODE:
        return CONFIG_CAP_MODE
    return CAP_MODE if MIG_NODE.match(name) else mode


def _as_device(device) -> dict:
    if isinstance(device, dict):
        return device
    path = str(device)
    return {"path": path, "name": path.split("/dev/", 1)[-1]}


def nvidia_cuda_devices(find_lines: list[str], dev_dir: str = "/dev", mig: bool = False) -> list[dict]:
    """The NVIDIA nodes CUDA needs, from `stat -c '%n %t %T'` lines (path, hex major, hex minor).

    Returns [{path, name (relative to dev_dir, e.g. nvidia-caps/nvidia-cap1), major, minor}] in
    natural order of the name.
    """
    prefix = dev_dir.rstrip("/") + "/"
    devices = []
    for line in find_lines:
        fields = line.split()
        if len(fields) != 3 or not fields[0].startswith(prefix):
            continue
        name = fields[0][len(prefix):]
        if CUDA_NODE.match(name) or (mig and MIG_NODE.match(name)):
            devices.append({"path": fields[0], "name": name, "major": int(fields[1], 16), "minor": int(fields[2], 16)})
    return sorted(devices, key=lambda d: _natural_key(d["name"]))


def nvidia_missing_nodes(devices: list[dict], gpus: list[int]) -> list[str]:
    """Names of the nodes a CUDA job on `gpus` cannot run without that are not in `devices`."""
    present = {d["name"] for d in devices}
    needed = ["nvidiactl", "nvidia-uvm"] + [f"nvidia{int(g)}" for g in sorted(gpus)]
    return [name for name in needed if name not in present]


def nvidia_dev_entries(devices: list, mode: str = NODE_MODE) -> dict[str, str]:
    """Proxmox `devN` values for the devices (paths or nvidia_cuda_devices dicts), numbered in a stable order.

    MIG capability nodes are read-only (as on the host), the config capability nvidia-cap1 root's only (0400);
    the others get `mode`.
    """
    items = sorted({_as_device(d)["path"]: _as_device(d) for d in devices}.values(), key=lambda d: _natural_key(d["path"]))
    return {f"dev{i}": f"{d['path']},mode={_node_mode(d['name'], mode)}" for i, d in enumerate(items)}


def pct_dev_paths(config: dict) -> dict[str, str]:
    """{devN: host path} of the devN entries of a parsed `pct config`."""
    return {
        key: value.split(",")[0].removeprefix("path=")
        for key, value in config.items()
        if re.fullmatch(r"dev\d+", key)
    }


def pct_mount_entries(mounts: list[dict]) -> dict[str, str]:
    """Map bind mounts ({src, dest, readonly}) to Proxmox `mpN` values."""
    entries = {}
    for i, mount in enumerate(mounts):
        value = f"{mount['src']},mp={mount['dest']}"
        if mount.get("readonly"):
            value += ",ro=1"
        entries[f"mp{i}"] = value
    return entries


def _normalise(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def pct_set_args(desired: dict, current: dict) -> list[str]:
    """Arguments for `pct set` that turn `current` (pct config) into `desired`.

    Returns [] when nothing differs. Numbered mpN/devN entries present in `current`
    but not in `desired` are deleted (`--delete dev5,mp2`).
    """
    args: list[str] = []
    for key in sorted(desired, key=_natural_key):
        value = _normalise(desired[key])
        if current.get(key) != value:
            args += [f"--{key}", value]
    stale = [
        key
        for key in sorted(current, key=_natural_key)
        if re.fullmatch(rf"({'|'.join(MANAGED_FAMILIES)})\d+", key) and key not in desired
    ]
    if stale:
        args += ["--delete", ",".join(stale)]
    return args


def nvidia_char_majors(proc_devices: str) -> list[int]:
    """Majors of the NVIDIA character devices listed in /proc/devices (sorted, unique)."""
    majors: set[int] = set()
    in_char = False
    for line in proc_devices.splitlines():
        if line.startswith("Character devices"):
            in_char = True
            continue
        if line.startswith("Block devices"):
            in_char = False
            continue
        fields = line.split()
        if in_char and len(fields) == 2 and fields[0].isdigit() and fields[1].startswith("nvidia"):
            majors.add(int(fields[0]))
    return sorted(majors)


def nvidia_legacy_lines(devices: list[dict]) -> list[str]:
    """Raw LXC lines for legacy passthrough: allow each node's major:minor, bind-mount it to /dev/NAME."""
    lines = [f"lxc.cgroup2.devices.allow: c {d['major']}:{d['minor']} rw" for d in devices]
    lines += [f"lxc.mount.entry: {d['path']} dev/{d['name']} none bind,optional,create=file" for d in devices]
    return lines


def nvidia_legacy_owned(devices: list[dict], majors: list[int], dev_dir: str = "/dev") -> list[str]:
    """Regexes of the raw lines legacy passthrough owns: NVIDIA majors (from the nodes and from
    /proc/devices, so lines of an earlier driver's dynamic majors go too) and mounts of NVIDIA nodes."""
    all_majors = sorted({d["major"] for d in devices} | set(majors))
    owned = [rf"^lxc\.mount\.entry: {re.escape(dev_dir.rstrip('/'))}/nvidia"]
    if all_majors:
        owned.insert(0, rf"^lxc\.cgroup2?\.devices\.allow: c ({'|'.join(map(str, all_majors))}):")
    return owned


# pct options a running container takes at once (pve-container's fast-plug options and
# memory hotplug); any other change stays pending until the container restarts.
HOTPLUG_OPTIONS = {"cores", "memory", "swap", "hostname", "description", "onboot", "startup", "tags",
                   "protection", "cpulimit", "cpuunits"}  # fmt: skip


def pct_restart_keys(set_args: list[str]) -> list[str]:
    """The options in `pct set` arguments that need a stopped container (devN, mpN, features, deletions...)."""
    keys = []
    for i in range(0, len(set_args) - 1, 2):
        key = set_args[i].removeprefix("--")
        if key == "delete":
            keys += [k for k in set_args[i + 1].split(",") if k and k not in HOTPLUG_OPTIONS]
        elif key not in HOTPLUG_OPTIONS:
            keys.append(key)
    return keys


def pct_features(current: str, wanted: dict) -> str:
    """Merge `wanted` ({nesting: 1}) into the container's `features` string, keeping its other flags and order."""
    merged: dict[str, str] = {}
    for item in (current or "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            merged[key.strip()] = value.strip()
    for key, value in wanted.items():
        merged[key] = _normalise(value)
    return ",".join(f"{k}={v}" for k, v in merged.items())


def _cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus += list(range(int(first), int(last or first) + 1))
    return cpus


def _cpulist_str(cpus: list[int]) -> str:
    ranges, cpus = [], sorted(set(cpus))
    for cpu in cpus:
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges)


def numa_cpuset(gpus: list[int], gpu_numa: dict, node_cpus: dict) -> str:
    """The CPUs of the NUMA nodes of `gpus` as a cpulist (`0-31,64-95`).

    gpu_numa: {GPU index: NUMA node} (sysfs numa_node of the GPU's PCI device; -1: none);
    node_cpus: {NUMA node: cpulist} (/sys/devices/system/node/nodeN/cpulist).
    """
    numa = {str(k): int(v) for k, v in gpu_numa.items()}
    cpus_of = {str(k): v for k, v in node_cpus.items()}
    cpus: list[int] = []
    for gpu in gpus:
        node = numa.get(str(gpu))
        if node is None:
            raise ValueError(f"GPU {gpu} is not on the node (nvidia-smi lists {sorted(numa, key=int)})")
        if node < 0 or str(node) not in cpus_of:
            raise ValueError(f"GPU {gpu} has no NUMA node (numa_node {node}): the node is not NUMA; do not pin")
        cpus += _cpulist(cpus_of[str(node)])
    return _cpulist_str(cpus)


def cpulist_count(text: str) -> int:
    return len(set(_cpulist(text)))


def nvidia_library_version(path: str) -> str:
    """`/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.14` -> `550.54.14` ('' if none)."""
    match = re.search(r"libnvidia-ml\.so\.(\d+(?:\.\d+)+)$", path.strip())
    return match.group(1) if match else ""


_STANDARD = re.compile(r"^debian-(12|13)-standard_(\d+)\.(\d+)-(\d+)_amd64\.tar\.(?:zst|gz|xz)$")


def newest_debian_template(available: list[str], listed: list[str], storage: str, majors=(12, 13)) -> str:
    """The newest Debian standard template of a major in `majors` (12 or 13; the preflight narrows it to the node's
    own major where pve-container is older than 5.3.1, which refuses Debian 13), as ``STORAGE:vztmpl/NAME``, among
    those `pveam available --section system` lists (``system  NAME`` lines) and those already on `storage`
    (`pveam list STORAGE`: ``STORAGE:vztmpl/NAME  SIZE`` lines); '' when there is none."""
    wanted = {str(int(m)) for m in majors}
    names = [line.split()[1] for line in available if len(line.split()) >= 2 and line.split()[0] == "system"]
    names += [line.split()[0].split(":vztmpl/", 1)[1] for line in listed if ":vztmpl/" in (line.split() or [""])[0]]
    versions = {}
    for name in names:
        match = _STANDARD.match(name)
        if match and match.group(1) in wanted:
            versions[name] = tuple(int(g) for g in match.groups()[1:])
    if not versions:
        return ""
    return f"{storage}:vztmpl/{max(versions, key=lambda n: (versions[n], n.endswith('.zst')))}"


def unwritable_sources(results: list[dict], root_uid) -> list[str]:
    """From the `stat` results of the bind-mount sources (looped over dflash_container_bind_mounts): the writable
    ones (no ``readonly: true``) that exist but that the container's root (node uid `root_uid`) cannot write - not
    its owner and not world-writable - as ``SRC (owner uid N)``."""
    out = []
    for result in results:
        st, item = result.get("stat") or {}, result.get("item") or {}
        if not st.get("exists") or item.get("readonly") or st.get("uid") == int(root_uid) or st.get("woth"):
            continue
        out.append(f"{item.get('src')} (owner uid {st.get('uid')})")
    return out


def missing_sources(results: list[dict], readonly: bool) -> list[dict]:
    """From the `stat` results of the bind-mount sources: the missing ones that are read-only (`readonly` true; the
    role refuses them, never creates them) or writable (false; created owned by the container's root)."""
    return [r for r in results if not (r.get("stat") or {}).get("exists")
            and bool((r.get("item") or {}).get("readonly")) == bool(readonly)]


def net0_bridges(net0: str) -> list[str]:
    """The bridge a `pct --net0` value names (``bridge=vmbr0``), as a list (none for ``none``)."""
    fields = dict(part.split("=", 1) for part in (net0 or "").split(",") if "=" in part)
    return [fields["bridge"]] if fields.get("bridge") else []


def pct_idmap_root(config_lines: list[str]):
    """The node uid of the container's root from its own ``lxc.idmap: u 0 BASE COUNT`` line (`pct config`), or
    None when the config has none (PVE then maps from 100000)."""
    for line in config_lines:
        fields = re.split(r"[:=\s]+", line.strip())
        if fields[:3] == ["lxc.idmap", "u", "0"] and len(fields) >= 4 and fields[3].isdigit():
            return int(fields[3])
    return None


def net0_problems(net0: str) -> list[str]:
    """What a `pct --net0` value lacks for apt and pip to work in the container: a static ``ip=`` needs ``gw=``."""
    fields = dict(part.split("=", 1) for part in net0.split(",") if "=" in part)
    ip = fields.get("ip", "")
    if not ip or ip in ("dhcp", "manual") or "gw" in fields:
        return []
    return [f"dflash_container_pct_net0 ({net0}) has a static ip= and no gw=: the container has no route out, so apt "
            "and pip fail inside it; add gw=GATEWAY (or ip=dhcp where the bridge has a DHCP server)"]


class FilterModule:
    def filters(self):
        return {
            "dflash_pct_config_to_dict": pct_config_to_dict,
            "dflash_pct_set_args": pct_set_args,
            "dflash_pct_mount_entries": pct_mount_entries,
            "dflash_nvidia_dev_entries": nvidia_dev_entries,
            "dflash_nvidia_char_majors": nvidia_char_majors,
            "dflash_nvidia_legacy_lines": nvidia_legacy_lines,
            "dflash_nvidia_legacy_owned": nvidia_legacy_owned,
            "dflash_nvidia_cuda_devices": nvidia_cuda_devices,
            "dflash_nvidia_missing_nodes": nvidia_missing_nodes,
            "dflash_pct_dev_paths": pct_dev_paths,
            "dflash_pct_restart_keys": pct_restart_keys,
            "dflash_pct_features": pct_features,
            "dflash_numa_cpuset": numa_cpuset,
            "dflash_cpulist_count": cpulist_count,
            "dflash_nvidia_library_version": nvidia_library_version,
            "dflash_newest_debian_template": newest_debian_template,
            "dflash_unwritable_sources": unwritable_sources,
            "dflash_net0_problems": net0_problems,
            "dflash_net0_bridges": net0_bridges,
            "dflash_missing_sources": missing_sources,
            "dflash_pct_idmap_root": pct_idmap_root,
        }
