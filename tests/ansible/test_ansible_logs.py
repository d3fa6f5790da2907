"""dflash_logs' reader: whole lines only, offsets that follow a growing, truncated or redrawn log."""

from __future__ import annotations

from ansible.module_utils.dflash_logs import read_log


def test_tail_and_follow_return_whole_lines(tmp_path):
    log = tmp_path / "job.log"
    log.write_bytes(b"one\ntwo\nthree\npart")
    tail = read_log(str(log), -1, 2)
    assert tail["lines"] == ["two", "three"] and tail["next_offset"] == len(b"one\ntwo\nthree\n")
    assert read_log(str(log), tail["next_offset"])["lines"] == []  # the line being written waits
    with log.open("ab") as handle:
        handle.write(b"ial\nfour\n")
    follow = read_log(str(log), tail["next_offset"])
    assert follow["lines"] == ["partial", "four"] and follow["next_offset"] == log.stat().st_size


def test_truncated_log_is_read_from_the_start_and_redraws_collapse(tmp_path):
    log = tmp_path / "job.log"
    log.write_bytes(b"10%\r50%\r100%\nnew\r\n")
    assert read_log(str(log), 10_000)["lines"] == ["100%", "new"]


def test_a_read_is_capped_and_a_tail_drops_the_cut_line(tmp_path):
    log = tmp_path / "job.log"
    log.write_bytes(b"aaaaaaaa\nbbb\ncc\n")
    capped = read_log(str(log), 0, max_bytes=12)
    assert capped["lines"] == ["aaaaaaaa"] and capped["next_offset"] == 9
    assert read_log(str(log), -1, 10, max_bytes=6)["lines"] == ["cc"]
    assert read_log(str(log), -1, 10, max_bytes=7)["lines"] == ["bbb", "cc"]  # the seek hit a line start
    assert read_log(str(log), 0, max_bytes=4)["lines"] == ["aaaa"]  # a line longer than a read comes cut


def test_a_missing_log_is_reported_not_raised(tmp_path):
    missing = read_log(str(tmp_path / "nope.log"))
    assert missing == {"path": str(tmp_path / "nope.log"), "exists": False, "size": 0, "next_offset": 0, "lines": []}
