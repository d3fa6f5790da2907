# Copyright: dflash authors
# Apache-2.0
"""How dflash module logic touches the managed host: run a command, write a file atomically, wait.

The logic in the other ``dflash_*`` module_utils takes a host object instead of an
``AnsibleModule`` so it can be unit-tested (and run for real) without Ansible:
``LocalHost`` uses ``subprocess`` and ``os.replace``; ``ModuleHost`` routes the same
calls through ``module.run_command`` and ``module.atomic_move``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time


class LocalHost:
    """Plain-Python host operations (tests, and any code running outside a module)."""

    def run(self, args, check_rc=False):
        """Run ``args`` (a list, never a shell string); return ``(rc, stdout, stderr)``."""
        try:
            proc = subprocess.run(list(args), capture_output=True, text=True, check=False)
        except FileNotFoundError as exc:
            return 127, "", str(exc)
        if check_rc and proc.returncode != 0:
            raise HostCommandError(args, proc.returncode, proc.stdout, proc.stderr)
        return proc.returncode, proc.stdout, proc.stderr

    def which(self, name, extra_dirs=("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin")):
        found = shutil.which(name)
        if found:
            return found
        for directory in extra_dirs:
            candidate = os.path.join(directory, name)
            if os.access(candidate, os.X_OK):
                return candidate
        return None

    def atomic_write(self, path, data, mode=0o644):
        """Write ``data`` (str or bytes) to ``path`` through a temp file in the same directory."""
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".dflash-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data.encode() if isinstance(data, str) else data)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(tmp, mode)
            self._replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        fsync_dir(directory)

    def _replace(self, src, dest):
        os.replace(src, dest)

    def sleep(self, seconds):
        time.sleep(seconds)

    def now(self):
        return time.monotonic()

    def warn(self, message):
        pass


class ModuleHost(LocalHost):
    """Host operations through an ``AnsibleModule`` (run_command, atomic_move, warn)."""

    def __init__(self, module):
        self.module = module

    def run(self, args, check_rc=False):
        rc, out, err = self.module.run_command(list(args))
        if check_rc and rc != 0:
            raise HostCommandError(args, rc, out, err)
        return rc, out, err

    def which(self, name, extra_dirs=("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin")):
        return self.module.get_bin_path(name, required=False, opt_dirs=list(extra_dirs))

    def _replace(self, src, dest):
        self.module.atomic_move(src, dest, unsafe_writes=False)

    def warn(self, message):
        self.module.warn(message)


class HostCommandError(Exception):
    def __init__(self, args, rc, stdout, stderr):
        self.args_list = list(args)
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr
        detail = (stderr or stdout or "").strip()
        super().__init__(f"command {' '.join(self.args_list)!r} failed with exit status {rc}: {detail}")


def fsync_dir(path):
    """Make a rename/creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_text(path, default=None):
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except (FileNotFoundError, NotADirectoryError, ProcessLookupError):
        # ProcessLookupError: a /proc/PID file opened just before PID exited fails on read (ESRCH)
        return default


def tail_lines(path, count, max_bytes=256 * 1024):
    """The last ``count`` lines of a (possibly huge) text file, or None if it does not exist."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # the first line was cut by the seek
    # Progress bars use carriage returns: keep only the last redraw of each line.
    lines = [line.rsplit("\r", 1)[-1] for line in lines]
    return lines[-count:] if count > 0 else []
