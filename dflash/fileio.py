"""Small file helpers shared by checkpoints, caches and run files."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

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


def file_mode() -> int:
    """The mode a new file gets here (0o666 less the umask, e.g. 0o644): for files whose writer picks its own
    (safetensors creates 0600), so that a checkpoint is readable like the rest of the run."""
    try:  # Linux >= 4.7; unlike os.umask(), no moment where another thread sees a changed umask
        with open("/proc/self/status") as fh:
            umask = next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def temp_sibling(path: Path) -> Path:
    """A hidden temp name next to `path` for write-then-rename, unique per process and host: the nodes of a job
    share its run directory, and their containers can give the processes that write one file (the regenerated
    data's cache at a first launch) the same PID."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def out_of_space(exc: BaseException, directory: str | os.PathLike) -> bool:
    """Whether `exc` means the filesystem of `directory` is full: ENOSPC/EDQUOT, or an I/O error of a library
    that drops the errno (torch.save: "basic_ios::clear: iostream error") while almost nothing is free there."""
    if isinstance(exc, OSError) and exc.errno in NO_SPACE:
        return True
    # safetensors' SafetensorError (no OSError) carries the OS error in its text: "IoError(Os { code: 28, kind:
    # StorageFull, message: "No space left on device" })"
    if any(text in str(exc) for text in ("No space left on device", "Disk quota exceeded", "StorageFull")):
        return True
    if isinstance(exc, OSError | RuntimeError) or type(exc).__name__ == "SafetensorError":
        try:
            return shutil.disk_usage(directory).free < 1 << 20
        except OSError:
            return False
    return False


def raise_if_full(exc: BaseException, path: str | os.PathLike) -> None:
    """Re-raise a write's out-of-space error (see out_of_space) as DiskFull: one line naming the file, its
    directory and the free space left there. Other errors are left to the caller."""
    from dflash.errors import DiskFull

    path = Path(path)
    if out_of_space(exc, path.parent):
        try:
            free = f"{shutil.disk_usage(path.parent).free >> 20} MiB free"
        except OSError:
            free = "free space unknown"
        raise DiskFull(f"disk full: no space left in {path.parent} while writing {path.name} ({free}; the partial "
                       "file was removed): free space there or write elsewhere") from None


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", durable: bool = True, sync_dir: bool = False,
                tmp: str | os.PathLike | None = None, disk_full: bool = True) -> Iterator[IO]:
    """The one atomic writer of the package: `path` holds the old content or all of the new, never a part.

    The block writes into a temp file beside `path` (`tmp`, else temp_sibling(path)), which is fsynced (unless
    not `durable`: a cache that is rebuilt if lost) and renamed over `path` when the block ends; `sync_dir` then
    fsyncs the directory too (the rename itself survives a crash). On any error the temp file is removed and an
    out-of-space error becomes DiskFull (unless not `disk_full`: the caller handles ENOSPC itself)."""
    path = Path(path)
    tmp = temp_sibling(path) if tmp is None else Path(tmp)
    try:
        with open(tmp, mode) as fh:
            yield fh
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if disk_full:
            raise_if_full(exc, path)
        raise
    if sync_dir:
        fsync_path(path.parent)


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
