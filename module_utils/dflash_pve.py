# Copyright: dflash authors
# Apache-2.0
"""Raw ``lxc.*`` lines in a Proxmox container config (``/etc/pve/lxc/VMID.conf``).

Proxmox keeps container configs on pmxcfs, which refuses chmod/chown (EPERM): tools that
write a temp file with the old file's mode and owner (``lineinfile``, ``atomic_move``) fail
there. PVE itself writes ``VMID.conf.tmp.PID`` and renames it; so does this module, with
no mode or owner change. The format follows pve-container's ``parse_pct_config``: the main
section up to the first ``[section]`` line (``[pve:pending]`` or a snapshot), ``key: value``
lines, raw ``lxc.*`` lines written after the others, ``#`` lines are the description.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import time
from contextlib import contextmanager

from ansible.module_utils.dflash_host import write_atomic

# pve-container's PVE::LXC::Config->lock_config: an exclusive flock on this file, 10 s by default.
LOCK_DIR = "/run/lock/lxc"


def split_sections(text: str) -> tuple[list[str], list[str]]:
    """(main section lines, the rest from the first ``[section]`` line on)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("["):
            return lines[:i], lines[i:]
    return lines, []


def lock_of(text: str) -> str:
    """The ``lock:`` value of the main section ('' when unlocked)."""
    for line in split_sections(text)[0]:
        key, sep, value = line.partition(":")
        if sep and key.strip() == "lock":
            return value.strip()
    return ""


def _normal(line: str) -> str:
    # pve-container accepts `lxc.key: value` and `lxc.key = value` and writes the first.
    match = re.match(r"^(lxc\.[a-z0-9_\-.]+)(?::|\s*=)\s*(.*?)\s*$", line)
    return f"{match.group(1)}: {match.group(2)}" if match else line


def merge_raw_lines(text: str, lines: list[str], owned: list[str]) -> str:
    """Make the main section carry exactly `lines` among the raw lines matching `owned`.

    Raw lines matching an `owned` regex but not desired are removed, desired ones that are
    missing are appended after the main section's last line; everything else (other keys,
    other raw lines, pending and snapshot sections) is kept byte for byte.
    """
    desired = [_normal(line) for line in lines]
    for line in desired:
        if not line.startswith("lxc."):
            raise ValueError(f"not a raw lxc line: {line!r} (expected 'lxc.KEY: VALUE')")
        if "\n" in line:
            raise ValueError(f"a raw line may not contain a newline: {line!r}")
    patterns = [re.compile(p) for p in owned]
    main, rest = split_sections(text)
    kept: list[str] = []
    present: set[str] = set()
    for line in main:
        normal = _normal(line)
        if normal.startswith("lxc.") and any(p.search(normal) for p in patterns) and normal not in desired:
            continue
        if normal in present and normal in desired:
            continue  # a duplicate of a managed line
        kept.append(line)
        if normal in desired:
            present.add(normal)
    while kept and not kept[-1].strip():
        kept.pop()
    kept += [line for line in desired if line not in present]
    out = "\n".join(kept) + "\n"
    if rest:
        out += "\n" + "\n".join(rest) + "\n"
    return out


def write_content(path: str, content: str) -> None:
    """Replace `path` with `content` the way pmxcfs allows: a temp file beside it, renamed.

    Never chmod/chown (pmxcfs answers EPERM); the file system gives the new file its mode. The temp name is
    PVE's own (``VMID.conf.tmp.PID``); no directory fsync (pmxcfs commits the rename itself).
    """
    write_atomic(path, content, mode=None, tmp_name=f"{path}.tmp.{os.getpid()}", sync_dir=False)


def vmid_of(path: str) -> str:
    """``200`` for ``/etc/pve/lxc/200.conf``."""
    name = os.path.basename(path)
    return name[: -len(".conf")] if name.endswith(".conf") else name


class ConfigLocked(Exception):
    """The container's config is locked: PVE's flock is held, or the config has a ``lock:`` line."""


class UnsafeLock(ConfigLocked):
    """The lock directory or file is not root's own: another account could hold the lock or point it elsewhere."""


def _check_owned(path: str, st: os.stat_result, what: str) -> None:
    """``path`` is this account's (root's) and no other account may write it (a sticky directory excepted)."""
    if st.st_uid != os.getuid():
        raise UnsafeLock(f"{what} {path} is owned by uid {st.st_uid}, not root: another account could hold or replace "
                         "PVE's config lock; nothing was changed. Remove it (PVE creates it again)")
    if st.st_mode & 0o022 and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        raise UnsafeLock(f"{what} {path} is writable by other accounts (mode {stat.S_IMODE(st.st_mode):o}): nothing "
                         "was changed. Make it root's alone (chmod go-w)")


def open_lock(lock_dir: str, vmid: str) -> tuple[int, str]:
    """``(fd, path)`` of PVE's lock file, opened as PVE does (``>>``, created 0644) without following a link or
    waiting on a FIFO there, in a directory that is root's and a file that is root's (UnsafeLock otherwise)."""
    os.makedirs(lock_dir, exist_ok=True)
    st = os.lstat(lock_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeLock(f"the lock directory {lock_dir} is not a directory (a link or a file): nothing was changed")
    _check_owned(lock_dir, st, "the lock directory")
    path = os.path.join(lock_dir, f"pve-config-{vmid}.lock")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise UnsafeLock(f"the lock file {path} cannot be opened as a plain file ({exc.strerror}: a link?): nothing "
                         "was changed") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeLock(f"the lock file {path} is not a regular file: nothing was changed")
        _check_owned(path, st, "the lock file")
    except BaseException:
        os.close(fd)
        raise
    return fd, path


@contextmanager
def config_lock(vmid: str, timeout: float, lock_dir: str = LOCK_DIR, sleep=time.sleep, clock=time.monotonic):
    """Hold PVE's per-container config lock (``LOCK_DIR/pve-config-VMID.lock``, the flock that
    ``PVE::LXC::Config->lock_config`` takes around every read-modify-write of the config), waiting up to
    `timeout` seconds for a backup, a GUI edit or a ``pct`` command that holds it. The file is opened by
    ``open_lock``: no link, no FIFO, root's."""
    fd, path = open_lock(lock_dir, vmid)
    try:
        deadline = clock() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if clock() >= deadline:
                    raise ConfigLocked(
                        f"container {vmid}'s config is in use by another Proxmox task (the lock {path} was held "
                        f"for more than {timeout:g}s): run again when it ends, or raise dflash_container_pct_lock_timeout"
                    ) from None
                sleep(0.1)
        yield path
    finally:
        os.close(fd)
