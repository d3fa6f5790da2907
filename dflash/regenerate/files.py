"""Input validation, shard files, the fingerprint of a run and the merge: every write is atomic."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from dflash.data import prompts
from dflash.errors import BadInput
from dflash.fileio import atomic_file, sha256_file  # noqa: F401 - sha256_file re-exported
from dflash.regenerate.core import conversation_problem

FORMAT = 1


def read_conversations(path: str | os.PathLike) -> tuple[list[list[dict[str, str]]], list[int]]:
    """Every row of a prompt file (`messages` role/content or ShareGPT `conversations` from/value; JSONL, or
    JSON/parquet through `datasets`: dflash/data/prompts.py), checked before anything is generated; errors
    name the file and line (row). Returns the conversations and their line (row) numbers."""
    return prompts.read_conversations(path, conversation_problem, "pass an existing chat JSONL file")


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """temp file + fsync + rename + directory fsync: the file is complete or absent, never partial."""
    with atomic_file(path, "wb", sync_dir=True) as fh:
        fh.write(data)


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def jsonl_bytes(conversations) -> bytes:
    return "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in conversations).encode()


class Parts:
    """OUTPUT.parts/: fingerprint.json, shard-NNNNN.jsonl (+ .json stats) per finished shard."""

    def __init__(self, output: Path):
        self.output = output
        self.dir = output.with_name(output.name + ".parts")

    def shard_file(self, index: int) -> Path:
        return self.dir / f"shard-{index:05d}.jsonl"

    def stats_file(self, index: int) -> Path:
        return self.dir / f"shard-{index:05d}.json"

    def done(self, index: int) -> bool:
        return self.shard_file(index).is_file() and self.stats_file(index).is_file()

    def claim(self, fingerprint: dict[str, Any]) -> None:
        """Create the parts dir for this run, or check that an existing one belongs to the same run."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "fingerprint.json"
        if path.is_file():
            try:
                existing = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                existing = None
            if existing != fingerprint:
                differ = sorted(k for k in set(fingerprint) | set(existing or {})
                                if (existing or {}).get(k) != fingerprint.get(k))
                raise BadInput(f"{self.dir} holds shards of a different run (differs in: {', '.join(differ)}); "
                               f"delete {self.dir} to start over, or choose another OUTPUT")
            return
        write_json(path, fingerprint)  # every rank writes the same content: a race is harmless

    def write_shard(self, index: int, conversations, stats: dict[str, Any]) -> None:
        """Stats first, the rows last: a shard counts as done once its .jsonl exists."""
        write_json(self.stats_file(index), stats)
        write_atomic(self.shard_file(index), jsonl_bytes(conversations))

    def read_stats(self, index: int) -> dict[str, Any]:
        return json.loads(self.stats_file(index).read_text())

    def merge(self, num_shards: int) -> str:
        """Concatenate the shards into OUTPUT atomically; returns its sha256."""
        h = hashlib.sha256()
        with atomic_file(self.output, "wb", sync_dir=True) as out:
            for i in range(num_shards):
                with open(self.shard_file(i), "rb") as fh:
                    data = fh.read()
                h.update(data)
                out.write(data)
        return h.hexdigest()

    def remove_stale_temps(self) -> None:
        for p in self.dir.glob(".shard-*.tmp-*"):
            try:
                p.unlink()
            except OSError:
                pass

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
