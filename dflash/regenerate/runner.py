"""`dflash regenerate`: shards, resume, signals, ranks, merge and manifest around `regenerate_conversations`.

* The whole input is read and checked first (exit 2 on bad input, nothing written).
* Shard i = conversations [i*S, (i+1)*S). A finished shard is written atomically into OUTPUT.parts/; a rerun
  with the same input and parameters (OUTPUT.parts/fingerprint.json) skips it. A stop signal loses at most
  the shard in flight (dflash/runtime/stop.py: `raising()` ends the generation at once, `shielded()` finishes a
  shard write first).
* Under torchrun, rank r takes shards i % world_size == r (GPU LOCAL_RANK); rank 0 waits for every shard
  file, then merges them atomically into OUTPUT and writes OUTPUT.manifest.json. `--nproc N` starts those
  ranks through the one torchrun launcher of every multi-rank command (dflash/runtime/torchrun.py).
* Log lines (dflash/logs.py) go to stderr; stdout carries only the result line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from dflash import logs
from dflash.errors import BadInput
from dflash.logs import EVERY_RANK
from dflash.regenerate.core import (
    RegenStats,
    SamplingParams,
    derive_seed,
    generation_slots,
    regenerate_conversations,
)
from dflash.regenerate.files import FORMAT, Parts, digest, read_conversations, sha256_file, write_json
from dflash.regenerate.progress import ProgressReporter
from dflash.runtime import stop, torchrun

log = logs.get_logger(__name__)
WAIT_POLL_S = 1.0
STOP_GRACE_S = 120  # --nproc: after a stop signal, time for the ranks to finish the shard being written and exit


# ------------------------------------------------------------------------------------------- setup
def sampling_from_args(args: argparse.Namespace, default_seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=default_seed if args.seed is None else args.seed, thinking=args.thinking,
                          max_prompt_tokens=args.max_prompt_tokens).validate()


def check_args(args: argparse.Namespace) -> None:
    if args.target_config and args.target_path:
        raise BadInput("give --target-config or --target-path, not both")
    if not (args.target_config or args.target_path or args.server):
        raise BadInput("say what answers: --target-config CONFIG.yaml or --target-path DIR (transformers in this "
                       "process), or --server URL (an OpenAI-compatible server such as vllm serve)")
    for name in ("shard_size", "batch_size", "concurrency", "nproc"):
        if getattr(args, name) < 1:
            raise BadInput(f"--{name.replace('_', '-')} must be >= 1")
    if args.retries < 0:
        raise BadInput("--retries must be >= 0")
    if args.limit is not None and args.limit < 1:
        raise BadInput("--limit must be >= 1")
    if Path(args.output).resolve() == Path(args.input).resolve():
        raise BadInput("OUTPUT must differ from INPUT")
    _check_output_path(Path(args.output))
    if args.target_path is not None and not Path(args.target_path).is_dir():
        missing = " (it does not exist)" if not Path(args.target_path).exists() else ""
        raise BadInput(f"--target-path '{args.target_path}' is not a directory{missing}; point it at a local Hugging "
                       "Face model directory (dflash never downloads weights)")
    if args.server and args.batching != "static":
        raise BadInput("--batching applies to the transformers backend, not to --server")
    width = getattr(args, "prompt_width_multiple", None)
    if width is not None and width < 1:
        raise BadInput(f"--prompt-width-multiple must be >= 1, got {width}")
    if args.server and (width is not None or getattr(args, "compile", "auto") != "auto"):
        raise BadInput("--compile and --prompt-width-multiple apply to the transformers backend, not to --server")


def _check_output_path(output: Path) -> None:
    """OUTPUT (and OUTPUT.parts/, OUTPUT.manifest.json) can be created: it is no directory and no existing
    ancestor of it is a file. Checked before any model loads."""
    if output.is_dir():
        raise BadInput(f"OUTPUT '{output}' is a directory; name the JSONL file to write")
    for parent in output.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise BadInput(f"OUTPUT '{output}' cannot be created: '{parent}' is a file, not a directory; "
                               "choose another OUTPUT")
            return


def build_backend(args: argparse.Namespace):
    """(backend, tokenizer, target identity for fingerprint and manifest, default seed)."""
    from dflash.data.tokenizer import load_tokenizer, load_tokenizer_dir
    from dflash.devices import pick_device

    config = None
    tokenizer = None
    identity: dict[str, Any] = {}
    default_seed = 0
    if args.target_config:
        from dflash.config import load_config

        config = load_config(args.target_config, [])
        default_seed = config.seed
        t = config.target
        identity = {"config": str(Path(args.target_config).resolve()), "dtype": t.dtype}
        if t.path is not None:
            identity["path"] = str(Path(t.path).resolve())
        else:
            identity.update(random_init=t.random_init, random_init_sha256=digest(t.random_init)[:16], seed=config.seed)
        tokenizer = load_tokenizer_dir(args.tokenizer_path) if args.tokenizer_path else load_tokenizer(config)
    elif args.target_path:
        identity = {"path": str(Path(args.target_path).resolve())}
        cfg_file = Path(args.target_path) / "config.json"
        if cfg_file.is_file():
            identity["config_sha256"] = sha256_file(cfg_file)[:16]
        tokenizer = load_tokenizer_dir(args.tokenizer_path or args.target_path)
    elif args.tokenizer_path:
        tokenizer = load_tokenizer_dir(args.tokenizer_path)

    if args.server:
        from dflash.regenerate.server import OpenAIServerBackend

        api_key = None
        if args.api_key_env:
            api_key = os.environ.get(args.api_key_env)
            if not api_key:
                raise BadInput(f"--api-key-env {args.api_key_env}: that environment variable is not set")
        backend = OpenAIServerBackend(args.server, args.model, tokenizer, concurrency=args.concurrency,
                                      retries=args.retries, api_key=api_key)
        identity = {"served_model": backend.model, **({"local": identity} if identity else {})}
        return backend, tokenizer, identity, default_seed

    import torch

    from dflash.models.target import build_hf_model
    from dflash.regenerate.hf import TransformersBackend

    if config is not None:
        device = pick_device(args.device or config.runtime.device, "--device" if args.device else "runtime.device")
        if config.runtime.num_threads:
            torch.set_num_threads(config.runtime.num_threads)
        t = config.target
        model = build_hf_model(t.path, t.random_init, t.dtype, t.attn_implementation, seed=config.seed, device=device)
    else:
        device = pick_device(args.device or "auto", "--device")
        dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
        identity["dtype"] = dtype
        model = build_hf_model(args.target_path, None, dtype, device=device)
    model = model.to(device).eval()
    compile_ = {"auto": None, "on": True, "off": False}[getattr(args, "compile", "auto")]
    backend = TransformersBackend(model, tokenizer, batch_size=args.batch_size, batching=args.batching,
                                  pad_to_multiple_of=getattr(args, "prompt_width_multiple", None), compile=compile_)
    return backend, tokenizer, identity, default_seed


def tokenizer_identity(tokenizer) -> dict[str, Any]:
    if tokenizer is None:
        return {"name_or_path": None}
    from dflash.data.chat import tokenizer_fingerprint

    return {"name_or_path": str(getattr(tokenizer, "name_or_path", "")), "size": len(tokenizer),
            "fingerprint": tokenizer_fingerprint(tokenizer)}


# -------------------------------------------------------------------------------------------- main
def run_regenerate(args: argparse.Namespace) -> int:
    # first of all: a stop while this process starts up is remembered (dflash/runtime/stop.py) and taken over by the
    # launcher or by the rank's `stop.raising()`
    stop.install()
    with logs.stream("stderr"):
        check_args(args)
        if not torchrun.under_torchrun():
            if args.nproc > 1:
                read_conversations(args.input)  # bad input: exit 2 here, before any process starts
                return launch_ranks(args)
            return run_rank(args)
        try:
            return run_rank(args)
        finally:
            # a worker's work is over: torchrun's SIGTERM to the other ranks once one has ended must not turn
            # their exit (0, or 1 after a stop) into death by signal
            stop.finished()


def run_rank(args: argparse.Namespace) -> int:
    started = time.time()
    rank, world_size = torchrun.rank_env()
    conversations, lines = read_conversations(args.input)
    rows_in_file = len(conversations)
    if args.limit is not None:
        conversations, lines = conversations[: args.limit], lines[: args.limit]
    output = Path(args.output).resolve()
    parts = Parts(output)

    try:
        with stop.raising():
            backend, tokenizer, target, default_seed = build_backend(args)
            params = sampling_from_args(args, default_seed)
            if hasattr(backend, "prompt_limit"):
                backend.prompt_limit(params)  # max_new_tokens that leaves no room for a prompt: exit 2 now
            input_sha = sha256_file(args.input)
            fingerprint = {"format": FORMAT, "input_sha256": input_sha, "conversations": len(conversations),
                           "shard_size": args.shard_size, "sampling": params.to_dict(),
                           "target": {k: v for k, v in target.items() if k != "config"},  # where the file lies: no
                           "tokenizer": tokenizer_identity(tokenizer)}
            output.parent.mkdir(parents=True, exist_ok=True)
            parts.claim(fingerprint)
            num_shards = math.ceil(len(conversations) / args.shard_size)
            mine = [i for i in range(num_shards) if i % world_size == rank]
            todo = [i for i in mine if not parts.done(i)]
            if len(todo) < len(mine):
                log.info(f"rank {rank}: {len(mine) - len(todo)} of its {len(mine)} shards done before, skipped: "
                         + _ranges([i for i in mine if i not in todo]), extra=EVERY_RANK)
            bounds = {i: (i * args.shard_size, min(len(conversations), (i + 1) * args.shard_size)) for i in todo}
            total = sum(generation_slots(c) for i in todo for c in conversations[bounds[i][0]:bounds[i][1]])
            log.info(f"rank {rank}/{world_size}: {len(todo)} shards to regenerate ({total} answers) with "
                     f"{backend.describe().get('backend')}; parts in {parts.dir}", extra=EVERY_RANK)
            progress = ProgressReporter(total, len(todo), rank, world_size)
            try:
                for i in todo:
                    a, b = bounds[i]
                    shard_params = replace(params, seed=derive_seed(params.seed, "shard", i))
                    out, stats = regenerate_conversations(conversations[a:b], backend, shard_params, progress)
                    record = {"shard": i, "conversations": [a, b], "rank": rank,
                              "written": sum(c is not None for c in out),
                              "skipped_lines": [lines[a + k] for k in stats.skipped_indices],
                              "stats": stats.to_dict(), "finished_at": _now()}
                    with stop.shielded():  # a stop never cuts a shard write: it is raised once the shard is done
                        parts.write_shard(i, [c for c in out if c is not None], record)
                    progress.shard_done(i, stats.to_dict())
            finally:
                progress.close()
            if rank != 0:
                log.info(f"rank {rank}: done; rank 0 merges", extra=EVERY_RANK)
                return 0
            _wait_for_shards(parts, num_shards, world_size)
            with stop.shielded():  # OUTPUT and its manifest are written together
                manifest = _merge(parts, num_shards, args, params, backend, tokenizer, target, fingerprint, lines,
                                  rows_in_file, started, world_size)
    except stop.Stopped as stopped:
        done = sum(parts.done(i) for i in range(math.ceil(len(conversations) / args.shard_size)))
        log.warning(f"{f'rank {rank}: ' if world_size > 1 else ''}stopped by signal {stopped.signum}: {done} shards "
                    f"are complete in {parts.dir}; rerun the same command to resume", extra=EVERY_RANK)
        return 1
    c = manifest["counts"]
    print(f"regenerated {c['regenerated_turns']} answers in {c['written']} conversations "
          f"({c['skipped_too_long']} skipped as too long, {c['truncated']} truncated) -> {output}", flush=True)
    return 0


def _ranges(indices: list[int]) -> str:
    if len(indices) <= 8:
        return ", ".join(map(str, indices))
    return f"{', '.join(map(str, indices[:4]))}, ... {indices[-1]}"


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _wait_for_shards(parts: Parts, num_shards: int, world_size: int) -> None:
    """Rank 0: every shard file of every rank (torchrun ends this rank if another one fails)."""
    last_note = time.monotonic()
    while True:
        missing = [i for i in range(num_shards) if not parts.done(i)]
        if not missing:
            return
        if world_size == 1:  # cannot happen: this rank wrote them all
            raise RuntimeError(f"shards {missing[:5]} missing after the run")
        if time.monotonic() - last_note > 60:
            log.info(f"rank 0: waiting for {len(missing)} shards of the other ranks ({_ranges(missing)})")
            last_note = time.monotonic()
        time.sleep(WAIT_POLL_S)


def _merge(parts: Parts, num_shards: int, args, params: SamplingParams, backend, tokenizer, target, fingerprint,
           lines: list[int], rows_in_file: int, started: float, world_size: int) -> dict[str, Any]:
    total = RegenStats()
    written, skipped_lines, shard_seconds = 0, [], 0.0
    for i in range(num_shards):
        record = parts.read_stats(i)
        s = record["stats"]
        total.add(RegenStats(**{k: v for k, v in s.items() if k != "skipped_indices"}))
        written += record["written"]
        skipped_lines += record["skipped_lines"]
        shard_seconds += s["seconds"]
    output_sha = parts.merge(num_shards)
    parts.remove_stale_temps()
    import torch
    import transformers

    import dflash

    manifest = {
        "format": f"dflash-regenerate/{FORMAT}",
        "created_at": _now(),
        "versions": {"dflash": dflash.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "input": {"path": str(Path(args.input).resolve()), "sha256": fingerprint["input_sha256"],
                  "rows": rows_in_file, "conversations": len(lines), "limit": args.limit},
        "output": {"path": str(parts.output), "sha256": output_sha, "conversations": written,
                   "parts_dir": str(parts.dir)},
        "target": target,
        "tokenizer": fingerprint["tokenizer"],
        "backend": backend.describe(),
        "sampling": params.to_dict(),
        "sharding": {"shard_size": args.shard_size, "shards": num_shards, "world_size": world_size},
        "counts": {"prompts": total.prompts, "written": written, "regenerated_turns": total.turns,
                   "skipped_too_long": total.skipped, "truncated": total.truncated,
                   "generated_tokens": total.generated_tokens, "hit_max_new_tokens": total.hit_max_new_tokens,
                   "roundtrip_mismatches": total.roundtrip_mismatches},
        "skipped_lines": skipped_lines[:10000],
        "timings": {"generation_seconds": round(shard_seconds, 3),
                    "tokens_per_second": round(total.generated_tokens / shard_seconds, 1) if shard_seconds else None,
                    "this_run_seconds": round(time.time() - started, 3), "finished_at": _now()},
        "fingerprint": digest(fingerprint),
    }
    write_json(parts.output.with_name(parts.output.name + ".manifest.json"), manifest)
    if total.skipped:
        log.info(f"{total.skipped} conversations skipped: prompt longer than the limit (input lines in the "
                 "manifest's skipped_lines)")
    if total.roundtrip_mismatches:
        log.warning(f"warning: {total.roundtrip_mismatches} answers do not re-tokenize to the generated ids (see "
                    "the log)")
    if not written:
        log.warning("warning: no conversation was written (every prompt too long?)")
    return manifest


# ---------------------------------------------------------------------------------- several ranks
def torchrun_command(args: argparse.Namespace) -> list[str]:
    from dflash.regenerate.cliargs import to_argv

    return torchrun.command(args.nproc, ["regenerate", *to_argv(args)])


def launch_ranks(args: argparse.Namespace) -> int:
    """`--nproc N`: one process per GPU through the one torchrun launcher (dflash/runtime/torchrun.py); a stop signal
    goes on to each rank, which loses at most its shard in flight."""
    if not args.server:
        import torch

        requested = args.device
        if requested is None and args.target_config:
            from dflash.config import load_config

            requested = load_config(args.target_config, []).runtime.device
        on_gpu = requested == "cuda" or (requested in (None, "auto") and torch.cuda.is_available())
        if on_gpu and args.nproc > torch.cuda.device_count():
            raise BadInput(f"--nproc {args.nproc} but only {torch.cuda.device_count()} GPUs are visible (one "
                           "process per GPU)")
    if stop.requested():
        log.warning("dflash: stopped by a signal before the ranks were started")
        return 1
    rc = torchrun.run(torchrun_command(args), STOP_GRACE_S, what=f"{args.nproc} ranks",
                      stop_note=f"stopping the ranks after the shards being written (bounded by {STOP_GRACE_S}s)")
    if rc != 0:
        log.error(f"dflash: error: regeneration failed or was stopped (torchrun exit {rc}); finished shards are "
                  "kept: rerun the same command to resume")
        return 1
    return 0


def manifest_path(output: str | os.PathLike) -> Path:
    p = Path(output)
    return p.with_name(p.name + ".manifest.json")


def read_manifest(output: str | os.PathLike) -> dict[str, Any]:
    return json.loads(manifest_path(output).read_text())
