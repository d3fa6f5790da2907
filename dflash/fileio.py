"""Small file helpers shared by checkpoints, caches and run files."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from pathlib import Path

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a rename is durable once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_sibling(path: Path) -> Path:
    """A hidden temp name next to `path`, unique per process, for write-then-rename."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def out_of_space(exc: BaseException, directory: str | os.PathLike) -> bool:
    """Whether `exc` means the filesystem of `directory` is full: ENOSPC/EDQUOT, or an I/O error of a library
    that drops the errno (torch.save: "basic_ios::clear: iostream error") while almost nothing is free there."""
    if isinstance(exc, OSError) and exc.errno in NO_SPACE:
        return True
    if isinstance(exc, OSError | RuntimeError):
        try:
            return shutil.disk_usage(directory).free < 1 << 20
        except OSError:
            return False
    return False


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one whole line or nothing: a write that fails half-way (disk full) is cut back off."""
    data = (line.rstrip("\n") + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)
