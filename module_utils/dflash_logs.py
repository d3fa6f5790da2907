# Copyright: dflash authors
# Apache-2.0
"""Read a job's log by byte offset: the last lines, or (follow) the whole lines appended since an offset."""

from __future__ import annotations

from ansible.module_utils.dflash_host import read_lines


def read_log(path, offset=-1, count=40, max_bytes=1048576):
    """{path, exists, size, next_offset, lines}: whole lines only, next_offset just after the last one.

    ``dflash_host.read_lines``, the one log reader of the module_utils (the health check's diagnosis tail and
    the stack files read through it too): a line being written is returned whole by the next read. ``offset``
    < 0 reads the last ``count`` lines; an offset past the end means the log was truncated, so it is read from
    the start. At most ``max_bytes`` per read: a follow catches up over several reads. A carriage-return
    progress bar shows its last state. A log that is a link another account made, a FIFO or a device is never
    followed or waited on: ``dflash_host.UnsafeFile`` (an OSError) says what it is."""
    return read_lines(path, offset, count, max_bytes)
