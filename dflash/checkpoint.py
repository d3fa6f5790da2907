"""Atomic checkpoints: temp dir, fsync, rename; keep the last N; a `latest` pointer; verified on load."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dflash.errors import BadInput
from dflash.fileio import fsync_path as _fsync_path
from dflash.fileio import sha256_file as _sha256

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PREFIX = "step-"


def ensure_writable(directory: str | os.PathLike) -> Path:
    """Fail early (bad input) when checkpoints could not be written, before any model loads."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise BadInput(f"checkpoint directory '{directory}' is not writable ({exc.strerror}); choose another "
                       "output_dir or fix its permissions") from None
    return directory


class CheckpointManager:
    def __init__(self, directory: str | os.PathLike, keep_last: int = 3):
        self.dir = Path(directory)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.dir / f"{PREFIX}{step:08d}"

    def save(self, step: int, write_fn) -> Path:
        """`write_fn(tmp_dir)` writes the payload; then manifest, fsync, rename, pointer, pruning."""
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.path_for(step)
        tmp = self.dir / f".tmp-{final.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            write_fn(tmp)
            files = sorted(p for p in tmp.iterdir() if p.is_file())
            manifest = {"step": step, "files": {p.name: _sha256(p) for p in files}}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            for p in [*files, tmp / MANIFEST]:
                _fsync_path(p)
            _fsync_path(tmp)
            if final.exists():  # re-saving the same step (e.g. SIGTERM right after an interval save)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_path(self.dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._write_latest(final.name)
        self._prune()
        return final

    def _write_latest(self, name: str) -> None:
        tmp = self.dir / f".latest.tmp-{os.getpid()}"
        tmp.write_text(name + "\n")
        _fsync_path(tmp)
        os.replace(tmp, self.dir / "latest")
        _fsync_path(self.dir)

    def _prune(self) -> None:
        for old in self.list()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def list(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.iterdir() if p.is_dir() and p.name.startswith(PREFIX))

    @staticmethod
    def verify(path: Path) -> str | None:
        """None when intact, else the reason."""
        manifest = path / MANIFEST
        if not manifest.is_file():
            return "no manifest (partial write)"
        try:
            data = json.loads(manifest.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            return f"unreadable manifest ({exc})"
        for name, digest in data.get("files", {}).items():
            f = path / name
            if not f.is_file():
                return f"missing {name}"
            if _sha256(f) != digest:
                return f"checksum mismatch in {name}"
        return None

    def latest_valid(self) -> Path | None:
        """Newest intact checkpoint; corrupt or partial ones are skipped with a warning."""
        candidates = self.list()
        pointer = self.dir / "latest"
        if pointer.is_file():
            named = self.dir / pointer.read_text().strip()
            if named in candidates:  # prefer the pointer, then anything older
                candidates = [c for c in candidates if c <= named]
        for path in reversed(candidates):
            problem = self.verify(path)
            if problem is None:
                return path
            log.warning("checkpoint %s is unusable (%s); falling back to the previous one", path, problem)
        return None


def save_trainer_state(path: Path, state: dict[str, Any]) -> None:
    torch.save(state, path / "trainer_state.pt")


def load_trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(path / "trainer_state.pt", weights_only=False, map_location="cpu")
