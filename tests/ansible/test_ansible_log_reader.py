"""The one log reader of the module_utils (dflash_host.read_lines): the ops `logs` module, the health check's
diagnosis tail, the unit's restart message and the stack files all read a log through it, so a progress bar
redrawn with carriage returns looks the same everywhere."""

from __future__ import annotations

import os

import pytest
from ansible.module_utils.dflash_host import (
    UnsafeFile,
    read_lines,
    render_lines,
    tail_lines,
    tail_lines_checked,
)
from ansible.module_utils.dflash_logs import read_log

# A tqdm bar as a log file holds it: every redraw starts with "\r", the bar ends its line when done; a
# Windows-style line; a bar that has not ended its line yet.
BAR = (b"loading\n"
       b"\r  0%|          | 0/4\r 50%|#####     | 2/4\r100%|##########| 4/4\n"
       b"crlf line\r\n"
       b"\rshards  25%|##        \rshards  75%|#######   ")


def test_carriage_returns_keep_each_lines_last_state():
    assert render_lines(b"10%\r50%\r100%") == ["100%"]
    assert render_lines(b"crlf\r\n") == ["crlf", ""]  # "\r\n" ends a line; it starts no empty state
    # "\n" is the only line break; other control characters are escaped (no raw one reaches a terminal)
    assert render_lines(b"a\x0cb\x1cc\xe2\x80\xa8d\x1b[2J") == ["a\\x0cb\\x1cc\\u2028d\\x1b[2J"]
    assert render_lines(b"half \xff") == ["half \ufffd"]


def test_every_reader_renders_a_progress_bar_alike(tmp_path):
    log = tmp_path / "job.log"
    log.write_bytes(BAR)
    whole = ["loading", "100%|##########| 4/4", "crlf line"]
    now = "shards  75%|#######   "
    assert read_log(str(log), -1, 10)["lines"] == whole  # follow/tail: whole lines only
    assert read_log(str(log), 0)["lines"] == whole
    assert read_log(str(log), 0)["next_offset"] == BAR.rindex(b"\n") + 1
    assert tail_lines(str(log), 10) == [*whole, now]  # a diagnosis: the bar being drawn, as it is now
    assert tail_lines_checked(str(log), 2) == (["crlf line", now], None)
    assert read_lines(str(log), -1, 10, partial=True)["lines"] == tail_lines(str(log), 10)


def test_a_tail_drops_a_cut_line_but_not_a_cut_bars_last_state(tmp_path):
    log = tmp_path / "job.log"
    log.write_bytes(b"x" * 100 + b"\n" + b"tail\n")
    assert tail_lines(str(log), 10, max_bytes=20) == ["tail"]  # the first line was cut by the seek
    assert tail_lines(str(log), 10, max_bytes=5) == ["tail"]  # the seek hit a line start: nothing dropped
    log.write_bytes(b"\r".join(b"%3d%%" % i for i in range(100)) + b"\nnext\n")
    assert tail_lines(str(log), 10, max_bytes=20) == [" 99%", "next"]  # redrawn after the cut: shown whole
    log.write_bytes(b"\r".join(b"%3d%%" % i for i in range(100)))  # a bar longer than a read, no newline yet
    assert tail_lines(str(log), 10, max_bytes=20) == [" 99%"]


def test_missing_unsafe_and_special_files(tmp_path):
    assert tail_lines_checked(str(tmp_path / "missing.log"), 5) == (None, None)
    assert read_lines(str(tmp_path / "missing.log"))["exists"] is False
    target = tmp_path / "real.log"
    target.write_text("secret\n")
    os.symlink(target, tmp_path / "link.log")  # a link the trainer's account could make: never followed
    lines, reason = tail_lines_checked(str(tmp_path / "link.log"), 5)
    assert lines is None and "symbolic link" in reason
    with pytest.raises(UnsafeFile, match="symbolic link"):
        read_log(str(tmp_path / "link.log"))
    os.mkfifo(tmp_path / "fifo.log")  # never waited on
    assert tail_lines_checked(str(tmp_path / "fifo.log"), 5) == (None, "is not a regular file (fifo)")
    assert tail_lines_checked(str(tmp_path), 5) == (None, "is not a regular file (directory)")


def test_the_units_crash_loop_message_and_the_stack_reader_use_the_same_reader(tmp_path):
    from ansible.module_utils.dflash_stacks import read_stacks
    from ansible.module_utils.dflash_unit import crash_loop_message

    log = tmp_path / "job.log"
    log.write_bytes(BAR)
    message = crash_loop_message({"name": "job", "log_path": str(log)}, {"restarts": 3, "result": "exit-code"})
    assert message.endswith("\n  loading\n  100%|##########| 4/4\n  crlf line\n  shards  75%|#######   ")
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    (stacks / "rank-0.txt").write_bytes(  # a dump written with CRLF line ends reads as the plain one
        b"# dflash stacks: rank 0 pid 7 started 2026-01-01T00:00:00\r\n"
        b'Current thread 0x00007f (most recent call first):\r\n  File "/x/train.py", line 5 in step\r\n')
    found = read_stacks(str(tmp_path))
    assert found[0]["frames"] == ["step (train.py:5)"]


def test_a_line_is_shown_up_to_a_limit():
    """A sparse or binary log's "line" may be a whole read of NUL bytes: shown escaped and cut."""
    from ansible.module_utils.dflash_host import LINE_LIMIT

    [line] = render_lines(b"\0" * (LINE_LIMIT + 10))
    assert line == "\\x00" * (LINE_LIMIT // 4) + f"... ({3 * LINE_LIMIT + 40} more characters)"
