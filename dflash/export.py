"""Export a checkpoint as a serving-engine drafter directory (config.json + model.safetensors)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from dflash.checkpoint import CheckpointManager
from dflash.errors import BadInput
from dflash.models.drafter import Drafter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step directory, a checkpoints directory or a run directory (its newest intact checkpoint)."""
    p = Path(path)
    if (p / "config.json").is_file() and (p / "model.safetensors").is_file():
        problem = CheckpointManager.verify(p) if (p / "manifest.json").exists() else None
        if problem:
            raise BadInput(f"checkpoint '{p}' is damaged ({problem}); export an older one")
        return p
    for candidate in (p, p / "checkpoints"):
        if candidate.is_dir():
            found = CheckpointManager(candidate).latest_valid()
            if found is not None:
                return found
    raise BadInput(f"'{p}' holds no intact checkpoint; pass a run directory, its checkpoints/ directory or a "
                   "step-NNNNNNNN directory")


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str = "bfloat16") -> Path:
    src = resolve_checkpoint(checkpoint)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise BadInput(f"export target '{out}' exists and is not empty; choose a new directory")
    drafter = Drafter.load(src).to(DTYPES[dtype])
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        drafter.save(tmp)
        meta = json.loads((tmp / "config.json").read_text())
        meta["dflash_exported_from"] = src.name
        (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
