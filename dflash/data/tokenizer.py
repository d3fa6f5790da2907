"""The tokenizer of a run or of a command: the one loader that `train`, `eval` and `regenerate` all use.

A tokenizer renders the chat template of the training data and of every prompt, so it must have one.
"""

from __future__ import annotations

from dflash.config import RunConfig
from dflash.errors import BadInput


def load_tokenizer(config: RunConfig):
    """The run's tokenizer: the synthetic one (tokenizer.synthetic_vocab_size), else tokenizer.path or the
    target's directory."""
    if config.tokenizer.synthetic_vocab_size is not None:
        from dflash.data.synthetic import build_tokenizer

        return build_tokenizer(config.tokenizer.synthetic_vocab_size)
    path = config.tokenizer.path or config.target.path
    if path is None:
        raise BadInput("tokenizer: set tokenizer.path (a local tokenizer directory) or "
                       "tokenizer.synthetic_vocab_size (random-weight targets have no tokenizer of their own)")
    return load_tokenizer_dir(path)


def load_tokenizer_dir(path: str):
    """A local tokenizer directory with a chat template (data and prompts are rendered with it)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise BadInput(f"tokenizer '{path}' could not be loaded: {exc}") from None
    if not getattr(tok, "chat_template", None):
        raise BadInput(f"tokenizer '{path}' has no chat template; training data and prompts are rendered with it")
    return tok


__all__ = ["load_tokenizer", "load_tokenizer_dir"]
