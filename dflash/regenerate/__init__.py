"""Regenerate training answers with the target itself (DESIGN §2b), in the trainer's input format.

    from dflash.regenerate import SamplingParams, TransformersBackend, regenerate_conversations

    backend = TransformersBackend(model, tokenizer, batch_size=64)
    conversations, stats = regenerate_conversations(conversations, backend, SamplingParams(max_new_tokens=512))

`dflash regenerate` (dflash.regenerate.runner) adds sharding, resume, ranks, a manifest and the
OpenAI-compatible server backend (dflash.regenerate.server); a colocated training run's `data.regenerate`
goes through dflash.regenerate.run_data. See docs/regenerate.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash.regenerate.core import (
    Backend,
    RegenStats,
    Reply,
    SamplingParams,
    regenerate_conversations,
    strip_thinking,
)

if TYPE_CHECKING:  # pragma: no cover
    from dflash.regenerate.hf import TransformersBackend
    from dflash.regenerate.server import OpenAIServerBackend

__all__ = ["Backend", "OpenAIServerBackend", "RegenStats", "Reply", "SamplingParams", "TransformersBackend",
           "regenerate_conversations", "strip_thinking"]


def __getattr__(name: str):
    # torch and transformers load only when a backend is used (`dflash --help` stays fast)
    if name == "TransformersBackend":
        from dflash.regenerate.hf import TransformersBackend

        return TransformersBackend
    if name == "OpenAIServerBackend":
        from dflash.regenerate.server import OpenAIServerBackend

        return OpenAIServerBackend
    raise AttributeError(f"module 'dflash.regenerate' has no attribute {name!r}")
