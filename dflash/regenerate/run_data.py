"""`data.regenerate`: a colocated training run's data answered by its own target, in the training process.

The trainer's inputs (dflash/inputs.py) call `regenerated` for each split when the config sets
`data.regenerate`; the answers are cached under output_dir/regenerated/ across restarts. Large datasets go
through `dflash regenerate` first (dflash/regenerate/runner.py) and are trained from data.train_path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

from dflash.config import RunConfig
from dflash.errors import BadInput, DataError
from dflash.logs import get_logger
from dflash.models.target import Target
from dflash.regenerate.core import SamplingParams, regenerate_conversations

log = get_logger(__name__)


def cache_path(config: RunConfig, name: str, conversations, tokenizer, run_dir: str | Path | None = None) -> Path:
    """A file under RUN/regenerated/ (RUN: `run_dir`, else output_dir) keyed by everything that decides the
    answers."""
    from dflash.data.chat import tokenizer_fingerprint

    key = json.dumps([config.target.path, config.target.random_init, config.target.dtype, config.seed,
                      dataclasses.asdict(config.data.regenerate), tokenizer_fingerprint(tokenizer),
                      conversations], sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(run_dir or config.output_dir) / "regenerated" / f"{Path(name).stem}-{digest}.jsonl"


def regenerated(config: RunConfig, name: str, conversations, tokenizer, target: Target,
                run_dir: str | Path | None = None, write: bool = True) -> tuple[list, Path | None]:
    """The conversations with every assistant turn answered by the target, and the JSONL file that holds them
    under RUN/regenerated/ (RUN: `run_dir`, else output_dir; reused across restarts while target, tokenizer,
    settings and prompts match). `write=False`: a cache found there is read, else the answers are generated in
    memory and the file is None (`dflash eval` writes no cache); with `run_dir` None too, nothing is read."""
    from dflash.data.chat import read_jsonl
    from dflash.data.synthetic import write_jsonl

    if len(tokenizer) > target.vocab_size:
        raise BadInput(f"token ids up to {len(tokenizer) - 1} (the tokenizer's) are outside the target's embedding "
                       f"table ({target.vocab_size}); the tokenizer does not belong to this target")
    path = cache_path(config, name, conversations, tokenizer, run_dir) if run_dir is not None or write else None
    if path is not None and path.is_file():
        return read_jsonl(path), path
    from dflash.regenerate.hf import TransformersBackend

    r = config.data.regenerate
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                            seed=config.seed, thinking=r.thinking)
    t0 = time.time()
    backend = TransformersBackend(target.model, tokenizer, batch_size=r.batch_size)
    with target.capture_all():  # the whole forward (the tapping hooks must not stop it)
        out, stats = regenerate_conversations(conversations, backend, params)
    kept = [conv for conv in out if conv is not None]
    if not kept:
        raise DataError(f"regeneration of {name} produced no conversation (all prompts skipped as too long?)")
    log.info("regenerated %s: %s", name, stats.to_dict())
    if not write:
        log.info(f"regenerated {len(kept)} {name} answers with the target in {time.time() - t0:.1f}s (in memory: "
                 f"{'no cache in ' + str(path.parent) if path is not None else 'no run directory to read one from'})")
        return kept, None
    write_jsonl(path, [{"messages": conv} for conv in kept])
    log.info(f"regenerated {len(kept)} {name} answers with the target in {time.time() - t0:.1f}s -> {path}")
    return kept, path


__all__ = ["cache_path", "regenerated"]
