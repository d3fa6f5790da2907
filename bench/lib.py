"""What the bench scripts share (the shell side is bench/lib.sh)."""

from __future__ import annotations

import json
from pathlib import Path


def record(path: Path, section: str, data: dict, results: dict | None = None) -> None:
    """Puts `data` under `section` in the JSON object of `path` and prints it as one line `[section] {...}`.

    The sections already in the file stay (a later call into the same folder adds to it), unless `results` (this
    run's sections) is given: then the file holds those alone, `section` among them."""
    if results is None:
        results = json.loads(path.read_text()) if path.exists() else {}
    results[section] = data
    path.write_text(json.dumps(results, indent=2))
    print(f"[{section}] {json.dumps(data)}", flush=True)
