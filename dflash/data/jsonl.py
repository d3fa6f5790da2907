"""The one JSON-lines reader of the package: chat data, prompt files and the packaged evaluation suites."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash.errors import DataError, DflashError


def iter_json_lines(path: str | os.PathLike, missing_hint: str = "", fix: str = "fix or remove that line",
                    error: type[DflashError] = DataError) -> Iterator[tuple[int, str, Any]]:
    """(line number, "FILE:LINE", parsed JSON value) of every non-empty line of a JSONL file (gzip-compressed when
    its name ends in .gz; a BOM on the first line is tolerated). A missing file (`missing_hint` says what to do),
    non-UTF-8 bytes and malformed JSON are one-line `error`s naming the file and line; a bad line's ends in `fix`
    (a packaged file's: reinstall its package)."""
    path = Path(path)
    if not path.is_file():
        raise error(f"data file '{path}' does not exist; {missing_hint}")
    with (gzip.open if path.name.endswith(".gz") else open)(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            try:  # a BOM on the first line is tolerated
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise error(f"{where}: not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1}); "
                            + ("convert the file to UTF-8 or remove that line" if error is DataError else fix)) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{where}: malformed JSON ({exc.msg} at column {exc.colno}); {fix}") from None
            yield lineno, where, row
