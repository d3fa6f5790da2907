"""JSONL chat data -> token ids + assistant-only loss mask, with a tokenized cache."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash.data.jsonl import iter_json_lines
from dflash.errors import DataError
from dflash.fileio import atomic_file, sha256_file
from dflash.logs import get_logger

log = get_logger(__name__)

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "model": "assistant", "chatgpt": "assistant", "bing": "assistant", "system": "system",
                "tool": "tool", "function": "tool", "ipython": "tool"}
CACHE_FORMAT = 1


@dataclass
class TokenizedSet:
    samples: list[tuple[torch.Tensor, torch.Tensor]]  # (input_ids int64 (T,), loss_mask bool (T,))
    dropped_few_loss_tokens: int = 0
    truncated: int = 0
    source: str = ""
    stats: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples)

    def lengths(self) -> list[int]:
        return [int(ids.numel()) for ids, _ in self.samples]


def normalize_messages(row: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with 'messages' or 'conversations', got "
                        f"{type(row).__name__}")
    if "messages" in row and "conversations" in row:
        raise DataError(f"{where}: has both 'messages' and 'conversations'; keep one of them")
    if "messages" in row:
        raw, role_key, content_key = row["messages"], "role", "content"
    elif "conversations" in row:
        raw, role_key, content_key = row["conversations"], "from", "value"
    else:
        raise DataError(f"{where}: no 'messages' (role/content) or 'conversations' (ShareGPT from/value) key")
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{where}: '{'messages' if role_key == 'role' else 'conversations'}' must be a "
                        "non-empty list")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or role_key not in m or content_key not in m:
            raise DataError(f"{where}: turn {i} needs '{role_key}' and '{content_key}'")
        role = ROLE_ALIASES.get(str(m[role_key]).lower())
        if role is None:
            raise DataError(f"{where}: turn {i} has unknown role '{m[role_key]}' (expected one of "
                            f"{sorted(set(ROLE_ALIASES))})")
        if not isinstance(m[content_key], str):
            raise DataError(f"{where}: turn {i} content must be a string")
        messages.append({"role": role, "content": m[content_key]})
    return messages


def iter_chat_rows(path: str | os.PathLike, missing_hint: str):
    """(line number, "FILE:LINE", normalized messages) of every non-empty row of a chat JSONL file; a missing
    file, non-UTF-8 bytes and malformed JSON are one-line DataErrors naming the file and line."""
    for lineno, where, row in iter_json_lines(path, missing_hint):
        yield lineno, where, normalize_messages(row, where)


def read_jsonl(path: str | os.PathLike) -> list[list[dict[str, str]]]:
    conversations = [m for _, _, m in iter_chat_rows(path, "check data.train_path / data.eval_path")]
    if not conversations:
        raise DataError(f"data file '{path}' holds no samples")
    return conversations


def assistant_spans(tokenizer, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
    """Character spans of assistant turns in the rendered `text` (content and end-of-turn marker)."""
    spans = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if text.startswith(upto) and upto.startswith(prefix) and len(prefix) >= cursor:
            spans.append((len(prefix), len(upto)))
            cursor = len(upto)
            continue
        # Templates that rewrite earlier turns (e.g. strip reasoning) break the prefix property: search.
        start = text.find(m["content"], cursor)
        if start < 0:
            continue
        spans.append((start, start + len(m["content"])))
        cursor = start + len(m["content"])
    return spans


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], max_length: int):
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = assistant_spans(tokenizer, messages, text)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    mask = [False] * len(ids)
    for j, (s, e) in enumerate(enc["offset_mapping"]):
        if e > s and any(s >= a and e <= b for a, b in spans):
            mask[j] = True
    truncated = len(ids) > max_length
    return torch.tensor(ids[:max_length], dtype=torch.long), torch.tensor(mask[:max_length]), truncated


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    h.update(str(getattr(tokenizer, "name_or_path", "")).encode())
    h.update(str(len(tokenizer)).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items())[:5000]).encode())
    return h.hexdigest()[:16]


def tokenize_conversations(tokenizer, conversations, max_length: int, min_loss_tokens: int,
                           source: str) -> TokenizedSet:
    out = TokenizedSet(samples=[], source=source)
    for messages in conversations:
        ids, mask, truncated = tokenize_conversation(tokenizer, messages, max_length)
        out.truncated += int(truncated)
        if int(mask.sum()) < min_loss_tokens:
            out.dropped_few_loss_tokens += 1
            continue
        out.samples.append((ids, mask))
    return out


def load_tokenized(path: str | os.PathLike, tokenizer, max_length: int, min_loss_tokens: int,
                   cache_dir: str | os.PathLike | None, write: bool = True) -> TokenizedSet:
    """Tokenize a JSONL file, reusing the cache when file, tokenizer and settings are unchanged (`write=False`:
    a cache is read, never written)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file '{path}' does not exist; check data.train_path / data.eval_path")
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, sha256_file(path), tokenizer_fingerprint(tokenizer),
                                     max_length, min_loss_tokens]).encode()).hexdigest()[:24]
    cache_file = Path(cache_dir) / f"{path.stem}-{key}.pt" if cache_dir else None
    if cache_file is not None and cache_file.is_file():
        try:
            blob = torch.load(cache_file, weights_only=True)
            ids, masks, offsets = blob["ids"], blob["mask"], blob["offsets"].tolist()
            samples = [(ids[a:b].long(), masks[a:b]) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
            log.debug("tokenized cache hit: %s (%d samples)", cache_file, len(samples))
            return TokenizedSet(samples, int(blob["dropped"]), int(blob["truncated"]), str(path),
                                {"cache": "hit", "cache_file": str(cache_file)})
        except Exception as exc:  # a damaged cache is rebuilt, never trusted
            log.warning("tokenized cache %s unreadable (%s); re-tokenizing", cache_file, exc)
    result = tokenize_conversations(tokenizer, read_jsonl(path), max_length, min_loss_tokens, str(path))
    result.stats["cache"] = "miss"
    if cache_file is not None and write:
        _write_cache(cache_file, result)
        result.stats["cache_file"] = str(cache_file)
    return result


def _write_cache(cache_file: Path, data: TokenizedSet) -> None:
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    lengths = [0] + [ids.numel() for ids, _ in data.samples]
    offsets = torch.tensor(lengths).cumsum(0)
    blob = {
        "ids": torch.cat([ids.int() for ids, _ in data.samples]) if data.samples else torch.zeros(0, dtype=torch.int),
        "mask": torch.cat([m for _, m in data.samples]) if data.samples else torch.zeros(0, dtype=torch.bool),
        "offsets": offsets,
        "dropped": data.dropped_few_loss_tokens,
        "truncated": data.truncated,
    }
    with atomic_file(cache_file, "wb", durable=False) as fh:  # a cache: rebuilt from the data if lost
        torch.save(blob, fh)
