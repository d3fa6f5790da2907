"""The one JSON-lines reader (dflash/data/jsonl.py): chat data, prompt files and the packaged suites' files."""

from __future__ import annotations

import gzip

import pytest

from dflash.data.jsonl import iter_json_lines
from dflash.errors import BadInput, DataError


def test_rows_with_their_line_numbers_blank_lines_skipped_a_bom_tolerated(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n\n[2]\n"three"\n')
    assert list(iter_json_lines(path)) == [(1, f"{path}:1", {"a": 1}), (3, f"{path}:3", [2]), (4, f"{path}:4", "three")]


def test_a_gzip_file_is_read_the_same(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write('{"doc": {"id": 1}}\n{"doc": {"id": 2}}\n')
    assert [row for _, _, row in iter_json_lines(path)] == [{"doc": {"id": 1}}, {"doc": {"id": 2}}]


def test_errors_name_the_file_and_line_in_the_callers_class_and_words(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed JSON \(.*\); fix or remove that line"):
        list(iter_json_lines(path))
    with pytest.raises(BadInput, match=r"bad\.jsonl:2: malformed JSON \(.*\); reinstall pkg==1$"):
        list(iter_json_lines(path, "reinstall pkg==1", "reinstall pkg==1", BadInput))
    path.write_bytes(b'{"a": "\xff"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: not UTF-8 text \(byte 0xff at column 8\); convert the file"):
        list(iter_json_lines(path))
    with pytest.raises(DataError, match=r"data file '.*missing\.jsonl' does not exist; give another"):
        list(iter_json_lines(tmp_path / "missing.jsonl", "give another"))
