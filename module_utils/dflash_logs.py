# Copyright: dflash authors
# Apache-2.0
"""Read a job's log by byte offset: the last lines, or (follow) the whole lines appended since an offset."""

from __future__ import annotations

import os

from ansible.module_utils.dflash_host import open_nofollow


def read_log(path, offset=-1, count=40, max_bytes=1048576):
    """{path, exists, size, next_offset, lines}: whole lines only, next_offset just after the last one.

    A line being written is returned whole by the next read. ``offset`` < 0 reads the last ``count`` lines;
    an offset past the end means the log was truncated, so it is read from the start. At most ``max_bytes``
    per read: a follow catches up over several reads. A log that is a link another account made, a FIFO or a
    device is never followed or waited on: ``dflash_host.UnsafeFile`` (an OSError) says what it is."""
    out = {"path": path, "exists": False, "size": 0, "next_offset": 0, "lines": []}
    try:
        fd = open_nofollow(path)
    except (FileNotFoundError, NotADirectoryError):
        return out
    out["exists"] = True
    size = out["size"] = os.fstat(fd).st_size
    tail = offset < 0
    start = max(0, size - max_bytes) if tail else (offset if offset <= size else 0)
    with os.fdopen(fd, "rb") as handle:
        # One byte before a tail's start tells whether the seek cut a line.
        handle.seek(max(0, start - 1) if tail else start)
        cut = tail and start > 0 and handle.read(1) != b"\n"
        data = handle.read(min(max_bytes, size - start))
    end = data.rfind(b"\n") + 1
    if end == 0 and len(data) == max_bytes:  # one line longer than a read: return it cut rather than never
        end = len(data)
    # "\n" only: str.splitlines would also split at the carriage returns of a progress bar.
    lines = data[:end].decode("utf-8", "replace").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if cut and lines:
        lines = lines[1:]
    # Progress bars redraw with carriage returns: keep only the last state of each line.
    lines = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in lines]
    out["lines"] = (lines[-count:] if count > 0 else []) if tail else lines
    out["next_offset"] = start + end
    return out
