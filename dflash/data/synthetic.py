"""A small predictable language for tests and demos, and a word-level tokenizer with a chat template.

User: "count by D from wS" — Assistant: "wS w(S+D) w(S+2D) ..." (modulo the word count). Each next
word follows from the previous two, so a drafter can learn it and its acceptance length is measurable.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from dflash.fileio import atomic_file

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
SPECIALS = ["<pad>", "<mask>", "<|im_start|>", "<|im_end|>", "<unk>"]
CONTROL_WORDS = ["system", "user", "assistant", "count", "by", "from", "you", "are", "a", "counter"]
MAX_STRIDE = 8


def vocabulary(num_words: int) -> list[str]:
    return SPECIALS + CONTROL_WORDS + [str(d) for d in range(1, MAX_STRIDE + 1)] + [f"w{i}" for i in range(num_words)]


def build_tokenizer(num_words: int = 64):
    """A PreTrainedTokenizerFast: whitespace words, offsets mapping, a chat template; no files needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary(num_words))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", mask_token="<mask>",
                                  unk_token="<unk>", eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.name_or_path = f"dflash-synthetic-{num_words}"
    return tok


def generate_conversations(num_samples: int, num_words: int, min_length: int, max_length: int,
                           strides: list[int], seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_samples):
        stride = rng.choice(strides)
        start = rng.randrange(num_words)
        length = rng.randint(min_length, max_length)
        words = " ".join(f"w{(start + i * stride) % num_words}" for i in range(length))
        out.append({"messages": [
            {"role": "system", "content": "you are a counter"},
            {"role": "user", "content": f"count by {stride} from w{start}"},
            {"role": "assistant", "content": words},
        ]})
    return out


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> Path:
    """Atomic: a reader never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return path
