"""Prompt files in the common conversation formats, for `dflash regenerate` and `dflash eval`.

One reader, whatever the file:

* `.jsonl` (and any other name): one JSON object a line, read line by line by dflash itself
  (dflash/data/chat.py), so that an error names `FILE:LINE`;
* `.json` (a list of objects, or JSON lines), `.jsonl.gz`/`.json.gz` (and .bz2/.xz/.zst) and `.parquet`: read
  through the `datasets` library's local loaders (`datasets.load_dataset("json" | "parquet",
  data_files=FILE)`, a throw-away cache, nothing fetched); an error names `FILE: row N` (1-based).

A row holds OpenAI `messages` ([{"role", "content"}], `content` a string or a list of text parts) or ShareGPT
`conversations` ([{"from": "human" | "gpt" | "system", "value"}]) -- the project's own JSONL is the first.
Every row is normalized to the role/content list that training and regeneration use (chat.normalize_messages).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash.data.chat import normalize_messages
from dflash.data.jsonl import iter_json_lines
from dflash.errors import BadInput, DataError

COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
TABLE_FORMATS = {".json": "json", ".parquet": "parquet", ".pq": "parquet"}


def file_format(path: str | os.PathLike) -> str:
    """'jsonl' (dflash's line reader), 'json' or 'parquet' (the `datasets` loaders)."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if suffixes and suffixes[-1] in COMPRESSED:
        return "json" if len(suffixes) > 1 and suffixes[-2] in (".json", ".jsonl", ".ndjson") else "jsonl"
    return TABLE_FORMATS.get(suffixes[-1], "jsonl") if suffixes else "jsonl"


@contextmanager
def _quiet_datasets():
    """No progress bars and no log lines of `datasets` while it reads a file (an error is our one line)."""
    import datasets

    bars_were_off = datasets.utils.are_progress_bars_disabled()
    logger = logging.getLogger("datasets")
    level = logger.level
    datasets.disable_progress_bars()
    logger.setLevel(logging.CRITICAL)
    try:
        yield datasets
    finally:
        logger.setLevel(level)
        if not bars_were_off:
            datasets.enable_progress_bars()


def load_table(path: str | os.PathLike, kind: str) -> list[dict[str, Any]]:
    """The rows of a local .json/.parquet file through `datasets.load_dataset(kind, data_files=...)`."""
    path = Path(path)
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise BadInput(f"reading '{path}' ({kind}) needs the `datasets` package: pip install "
                       "'dflash-trainer[data]' (or write the rows as JSONL)") from None
    with _quiet_datasets() as ds, tempfile.TemporaryDirectory(prefix="dflash-datasets-") as cache:
        try:
            table = ds.load_dataset(kind, data_files=str(path.resolve()), split="train", cache_dir=cache)
        except Exception as exc:  # datasets wraps the reader's error; the innermost one says what is wrong
            cause = exc
            while cause.__cause__ is not None:
                cause = cause.__cause__
            if "corresponds to no data" in str(exc):
                raise DataError(f"{path}: holds no rows") from None
            text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
            raise DataError(f"{path}: not a readable {kind} file ({text})") from None
        return table.to_list()


def iter_rows(path: str | os.PathLike, missing_hint: str) -> Iterator[tuple[int, str, Any]]:
    """(row number, where, row) of every row: JSONL line numbers with "FILE:LINE", else 1-based row numbers
    with "FILE: row N". Columns that other rows have but this one lacks (None in a table) are dropped."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file '{path}' does not exist; {missing_hint}")
    kind = file_format(path)
    if kind == "jsonl":
        yield from iter_json_lines(path, missing_hint)
        return
    for number, row in enumerate(load_table(path, kind), 1):
        yield number, f"{path}: row {number}", {k: v for k, v in row.items() if v is not None}


def _text_parts(row: dict[str, Any], where: str) -> dict[str, Any]:
    """OpenAI `content` given as a list of parts ([{"type": "text", "text": ...}]) becomes one string."""
    turns = row.get("messages")
    if not isinstance(turns, list):
        return row
    out = []
    for i, m in enumerate(turns):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            parts = m["content"]
            kinds = {p.get("type") if isinstance(p, dict) else type(p).__name__ for p in parts}
            if kinds - {"text"}:
                raise DataError(f"{where}: turn {i} content has parts other than text ({sorted(map(str, kinds))}); "
                                "dflash prompts are text")
            m = {**m, "content": "\n".join(str(p.get("text", "")) for p in parts)}
        out.append(m)
    return {**row, "messages": out}


def iter_conversations(path: str | os.PathLike,
                       missing_hint: str = "pass an existing prompt file (JSONL, JSON or parquet)"
                       ) -> Iterator[tuple[int, str, list[dict[str, str]]]]:
    """(row number, where, normalized messages) of every row of a prompt file in any of the formats above."""
    for number, where, row in iter_rows(path, missing_hint):
        if isinstance(row, dict):
            row = _text_parts(row, where)
        yield number, where, normalize_messages(row, where)


def read_conversations(path: str | os.PathLike, check: Callable[[list[dict[str, str]]], str | None] | None = None,
                       missing_hint: str = "pass an existing prompt file (JSONL, JSON or parquet)",
                       ) -> tuple[list[list[dict[str, str]]], list[int]]:
    """Every conversation of a prompt file and its row (JSONL: line) number. `check` returns what is wrong with a
    conversation (or None): a DataError naming the file and row."""
    conversations, numbers = [], []
    for number, where, messages in iter_conversations(path, missing_hint):
        problem = check(messages) if check is not None else None
        if problem:
            raise DataError(f"{where}: {problem}")
        conversations.append(messages)
        numbers.append(number)
    if not conversations:
        raise DataError(f"input file '{path}' holds no conversations")
    return conversations, numbers
