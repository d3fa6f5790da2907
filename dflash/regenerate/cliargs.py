"""The options of `dflash regenerate` (kept here, light to import, so that `--nproc` can rebuild the
command line for its torchrun workers from the parsed values)."""

from __future__ import annotations

import argparse
from typing import Any

# (flags, argparse keywords); positional arguments first
OPTIONS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("input",), {"help": "chat JSONL (or .json/.parquet, read through `datasets`): rows with 'messages' "
                          "(role/content) or ShareGPT 'conversations' (from/value)"}),
    (("output",), {"help": "JSONL to write ({'messages': [...]} rows, the trainer's data.train_path format); "
                           "OUTPUT.parts/ holds finished shards, OUTPUT.manifest.json describes the run"}),
    (("--target-config",), {"metavar": "CONFIG.yaml",
                            "help": "a dflash run config: target and tokenizer as the trainer builds them"}),
    (("--target-path",), {"metavar": "DIR", "help": "a local Hugging Face model directory"}),
    (("--tokenizer-path",), {"metavar": "DIR", "help": "tokenizer directory (default: the target's)"}),
    (("--dtype",), {"choices": ["auto", "float32", "bfloat16", "float16"], "default": "auto",
                    "help": "with --target-path: weights dtype (auto: bfloat16 on a GPU, float32 on the CPU)"}),
    (("--device",), {"choices": ["auto", "cpu", "cuda"], "default": None,
                     "help": "default: the config's runtime.device, else auto"}),
    (("--server",), {"metavar": "URL", "help": "OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1"}),
    (("--model",), {"help": "with --server: the served model id (default: the only one it serves)"}),
    (("--api-key-env",), {"metavar": "VAR", "help": "with --server: environment variable holding an API key"}),
    (("--concurrency",), {"type": int, "default": 64, "help": "with --server: requests in flight"}),
    (("--retries",), {"type": int, "default": 6, "help": "with --server: retries per request (backoff 1s, 2s, ...)"}),
    (("--max-new-tokens",), {"type": int, "default": 2048}),
    (("--temperature",), {"type": float, "default": 0.0, "help": "0 = greedy (default)"}),
    (("--top-p",), {"type": float, "default": 1.0}),
    (("--seed",), {"type": int, "default": None, "help": "sampling seed (default: the config's seed, else 0)"}),
    (("--thinking",), {"choices": ["keep", "strip", "disable"], "default": "keep",
                       "help": "keep reasoning; strip <think>...</think> from answers; disable: enable_thinking=False"}),
    (("--max-prompt-tokens",), {"type": int, "default": None,
                                "help": "skip longer prompts (default: max positions - max_new_tokens)"}),
    (("--batch-size",), {"type": int, "default": 64, "help": "transformers backend: prompts per generate call"}),
    (("--batching",), {"choices": ["static", "refill", "continuous"], "default": "static",
                       "help": "transformers backend: length-bucketed static batches (default); refill: the "
                               "finished rows of a batch replaced once half of them are done; or transformers' "
                               "continuous batching"}),
    (("--compile",), {"choices": ["auto", "on", "off"], "default": "auto",
                      "help": "transformers backend: compiled decoding over a static KV cache (auto: on CUDA); "
                              "each new batch shape compiles once, so few large batches gain most"}),
    (("--prompt-width-multiple",), {"type": int, "default": None, "metavar": "N",
                                    "help": "transformers backend: left-pad each batch's prompts to a multiple of N "
                                            "tokens (default: 64 when compiled); N >= --max-prompt-tokens gives "
                                            "every batch one shape, so compiled decoding compiles once"}),
    (("--shard-size",), {"type": int, "default": 1000, "help": "conversations per resumable shard"}),
    (("--limit",), {"type": int, "default": None, "help": "only the first N conversations"}),
    (("--nproc",), {"type": int, "default": 1, "help": "processes (one per GPU) started through torchrun"}),
]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for flags, kwargs in OPTIONS:
        parser.add_argument(*flags, **kwargs)
    return parser


def _dest(flags: tuple[str, ...]) -> str:
    return flags[0].lstrip("-").replace("-", "_")


def to_argv(args: argparse.Namespace, drop: tuple[str, ...] = ("nproc",)) -> list[str]:
    """The command-line arguments that reproduce `args` (absolute paths), without the `drop` options."""
    import os

    out: list[str] = []
    for flags, kwargs in OPTIONS:
        dest = _dest(flags)
        if dest in drop:
            continue
        value = getattr(args, dest, None)
        if dest in ("input", "output", "target_config", "target_path", "tokenizer_path") and value is not None:
            value = os.path.abspath(value)
        if not flags[0].startswith("-"):
            out.append(str(value))
        elif value is not None and value != kwargs.get("default"):
            out += [flags[0], str(value)]
    return out
