"""Prompt files in the common conversation formats (issue 30, item 10): ShareGPT `conversations`, OpenAI
`messages`, JSON and parquet through the `datasets` library's local loaders, all normalized alike."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from dflash.cli import main
from dflash.data.prompts import file_format, read_conversations
from dflash.errors import BadInput, DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-cpu.yaml"

EXPECTED = [
    [{"role": "system", "content": "you are a counter"}, {"role": "user", "content": "count by 1 from w5"},
     {"role": "assistant", "content": "w5 w6 w7"}],
    [{"role": "user", "content": "count by 2 from w1"}],
]
OPENAI = [{"messages": c} for c in EXPECTED]
SHAREGPT = [{"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                "value": m["content"]} for m in c]} for c in EXPECTED]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def no_network(monkeypatch):
    """Reading local files through `datasets` opens no connection."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_every_format_gives_the_same_conversations(tmp_path, no_network):
    files = {
        "openai.jsonl": write_jsonl(tmp_path / "openai.jsonl", OPENAI),
        "sharegpt.jsonl": write_jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT),
        "openai.json": tmp_path / "openai.json",
        "sharegpt.json": tmp_path / "sharegpt.json",
        "openai.parquet": write_parquet(tmp_path / "openai.parquet", OPENAI),
        "sharegpt.parquet": write_parquet(tmp_path / "sharegpt.parquet", SHAREGPT),
        "mixed.json": tmp_path / "mixed.json",  # one row of each format in one file: the other column is null
    }
    files["openai.json"].write_text(json.dumps(OPENAI))
    files["sharegpt.json"].write_text(json.dumps(SHAREGPT))
    files["mixed.json"].write_text(json.dumps([OPENAI[0], SHAREGPT[1]]))
    for name, path in files.items():
        conversations, numbers = read_conversations(path)
        assert conversations == EXPECTED, name
        assert numbers == [1, 2], name
    assert [file_format(p) for p in ("a.jsonl", "a.json", "a.parquet", "a.json.gz", "a.txt", "a")] == [
        "jsonl", "json", "parquet", "json", "jsonl", "jsonl"]


def test_openai_content_parts_become_one_string(tmp_path):
    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "count by 2"},
                                                       {"type": "text", "text": "from w1"}]}]}]
    path = tmp_path / "parts.json"
    path.write_text(json.dumps(rows))
    assert read_conversations(path)[0] == [[{"role": "user", "content": "count by 2\nfrom w1"}]]
    rows[0]["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": "x"}})
    path.write_text(json.dumps(rows))
    with pytest.raises(DataError, match=r"parts\.json: row 1: turn 0 content has parts other than text"):
        read_conversations(path)


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_a_row_of_no_format_names_the_file_and_row(tmp_path, fmt):
    rows = [OPENAI[0], OPENAI[1], {"text": "no conversation here"}]
    path = tmp_path / f"bad.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(rows))
    else:
        write_parquet(path, rows)
    with pytest.raises(BadInput) as info:
        read_conversations(path)
    assert str(info.value).startswith(f"{path}: row 3: no 'messages'")


def test_unreadable_and_empty_files_are_one_line(tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not parquet")
    with pytest.raises(DataError, match=r"broken\.parquet: not a readable parquet file"):
        read_conversations(broken)
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(DataError, match=r"empty\.json: holds no rows"):
        read_conversations(empty)
    with pytest.raises(DataError, match="does not exist"):
        read_conversations(tmp_path / "missing.parquet")


def regen(inp: Path, out: Path) -> int:
    return main(["regenerate", str(inp), str(out), "--target-config", str(TINY), "--max-new-tokens", "6"])


def test_regenerate_reads_parquet_like_jsonl_and_a_bad_row_is_one_line(tmp_path, capsys, no_network):
    """The same conversations from a ShareGPT parquet file and from the project's JSONL: the same output."""
    assert regen(write_jsonl(tmp_path / "in.jsonl", OPENAI), tmp_path / "from-jsonl.jsonl") == 0
    assert regen(write_parquet(tmp_path / "in.parquet", SHAREGPT), tmp_path / "from-parquet.jsonl") == 0
    from_jsonl = (tmp_path / "from-jsonl.jsonl").read_text()
    assert from_jsonl == (tmp_path / "from-parquet.jsonl").read_text() and len(from_jsonl.splitlines()) == 2
    manifest = json.loads((tmp_path / "from-parquet.jsonl.manifest.json").read_text())
    assert manifest["counts"]["written"] == 2
    capsys.readouterr()
    bad_row = {"conversations": [{"from": "gpt", "value": "x"}]}
    # the exit code of a bad row of the project's JSONL: 2 (bad input; 3 where dflash/runtime/failures.py gives data
    # errors a class of their own); a bad row of a parquet file ends alike
    expected = regen(write_jsonl(tmp_path / "bad.jsonl", [SHAREGPT[0], bad_row]), tmp_path / "o.jsonl")
    assert expected in (2, 3)
    capsys.readouterr()
    bad = write_parquet(tmp_path / "bad.parquet", [SHAREGPT[0], bad_row])
    assert regen(bad, tmp_path / "o.jsonl") == expected
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dflash: error: {bad}: row 2: ") and "no prompt turn" in err[0]
    assert not (tmp_path / "o.jsonl").exists()
