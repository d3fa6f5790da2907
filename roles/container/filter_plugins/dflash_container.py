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
        if sep and key and not key.startswith("#"):
            config[key.strip()] = value.strip()
    return config


def _natural_key(path: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def nvidia_dev_entries(device_paths: list[str], mode: str = "0666") -> dict[str, str]:
    """Map NVIDIA char device paths to Proxmox `devN` values, numbered in a stable order."""
    paths = sorted(set(device_paths), key=_natural_key)
    return {f"dev{i}": f"{path},mode={mode}" for i, path in enumerate(paths)}


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


def nvidia_legacy_lines(device_paths: list[str], majors: list[int]) -> list[str]:
    """Raw LXC lines for legacy passthrough: allow the majors, bind-mount every device."""
    lines = [f"lxc.cgroup2.devices.allow: c {major}:* rwm" for major in majors]
    for path in sorted(set(device_paths), key=_natural_key):
        inside = path.lstrip("/")
        lines.append(f"lxc.mount.entry: {path} {inside} none bind,optional,create=file")
    return lines


def nvidia_library_version(path: str) -> str:
    """`/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.14` -> `550.54.14` ('' if none)."""
    match = re.search(r"libnvidia-ml\.so\.(\d+(?:\.\d+)+)$", path.strip())
    return match.group(1) if match else ""


class FilterModule:
    def filters(self):
        return {
            "dflash_pct_config_to_dict": pct_config_to_dict,
            "dflash_pct_set_args": pct_set_args,
            "dflash_pct_mount_entries": pct_mount_entries,
            "dflash_nvidia_dev_entries": nvidia_dev_entries,
            "dflash_nvidia_char_majors": nvidia_char_majors,
            "dflash_nvidia_legacy_lines": nvidia_legacy_lines,
            "dflash_nvidia_library_version": nvidia_library_version,
        }
