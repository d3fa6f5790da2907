"""Regeneration core: sampling parameters, statistics, and the multi-turn loop over any backend.

A backend answers a list of conversation prefixes (each ending in a prompt turn: system, user or tool)
with one assistant reply each. `regenerate_conversations` keeps every prompt turn, asks the backend for
every assistant turn in order (each conditioned on the answers regenerated before it) and answers a
trailing prompt turn too, so prompt-only rows come back with the target's answer.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, Protocol

from dflash.errors import BadInput

Thinking = Literal["keep", "strip", "disable"]
THINKING_MODES = ("keep", "strip", "disable")

# progress(replies, tokens): increments, called as replies arrive (skipped prompts count as replies)
Progress = Callable[[int, int], None]


@dataclass
class SamplingParams:
    """How the target answers. temperature 0 = greedy (what greedy serving and `dflash eval` see)."""

    max_new_tokens: int = 2048
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    thinking: Thinking = "keep"  # keep the reasoning / strip <think>…</think> from answers / enable_thinking=False
    max_prompt_tokens: int | None = None  # longer prompts are skipped; None: model max positions - max_new_tokens

    def validate(self) -> SamplingParams:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise BadInput(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise BadInput(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise BadInput(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.thinking not in THINKING_MODES:
            raise BadInput(f"thinking must be one of {', '.join(THINKING_MODES)}, got {self.thinking!r}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise BadInput(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def template_kwargs(self) -> dict[str, Any]:
        """Extra chat-template variables: thinking=disable renders with enable_thinking=False."""
        return {"enable_thinking": False} if self.thinking == "disable" else {}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Reply:
    """One answer of a backend. text None: the prompt was longer than max_prompt_tokens (skipped)."""

    text: str | None
    prompt_tokens: int = 0
    new_tokens: int = 0  # generated tokens, the stop token included
    hit_max_new_tokens: bool = False  # stopped by max_new_tokens, not by an end-of-turn token
    roundtrip_ok: bool | None = None  # re-rendering + re-tokenizing reproduced the generated ids (None: unchecked)


class Backend(Protocol):
    name: str

    def generate(self, prefixes: list[list[dict[str, str]]], params: SamplingParams,
                 progress: Progress | None = None) -> list[Reply]:
        """One reply per prefix, in order."""

    def describe(self) -> dict[str, Any]:
        """What answered (for the manifest)."""


@dataclass
class RegenStats:
    prompts: int = 0  # conversations given
    skipped: int = 0  # dropped: the prompt of their first answer was too long
    truncated: int = 0  # kept up to the last answer that fit (a later prompt was too long)
    turns: int = 0  # assistant turns generated (and kept)
    generated_tokens: int = 0
    hit_max_new_tokens: int = 0  # answers cut by max_new_tokens
    roundtrip_mismatches: int = 0  # answers whose re-tokenized text differs from the generated ids
    seconds: float = 0.0
    skipped_indices: list[int] = field(default_factory=list)  # positions (in the input list) of skipped ones

    def add(self, other: RegenStats) -> RegenStats:
        for f in fields(self):
            if f.name == "skipped_indices":
                continue
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def to_dict(self, with_indices: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_indices:
            d.pop("skipped_indices")
        d["seconds"] = round(self.seconds, 3)
        return d


_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def strip_thinking(text: str) -> str:
    """Remove `<think>…</think>` blocks; a reply whose opening tag sat in the prompt (templates that end the
    generation prompt with `<think>`) loses everything up to its `</think>`. An unterminated `<think>` (cut
    by max_new_tokens) leaves no answer: the result is empty."""
    out = _THINK_BLOCK.sub("", text)
    if "</think>" in out:
        out = out.split("</think>", 1)[1]
    if "<think>" in out:
        out = out.split("<think>", 1)[0]
    return out.strip()


def derive_seed(seed: int, *parts: int | str) -> int:
    """A seed that depends only on (seed, parts): sampled answers do not depend on what ran before."""
    h = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def conversation_problem(messages: list[dict[str, str]]) -> str | None:
    """Why a (normalized) conversation cannot be regenerated, or None."""
    if not messages:
        return "no turns"
    if messages[0]["role"] == "assistant":
        if not any(m["role"] != "assistant" for m in messages):
            return "no prompt turn (system, user or tool): nothing to answer"
        return "turn 0 is an assistant turn before any prompt turn (system, user or tool)"
    return None


def generation_slots(messages: list[dict[str, str]]) -> int:
    """How many answers a conversation needs: one per run of consecutive assistant turns, plus one for a
    trailing prompt turn."""
    n, prev_assistant = 0, False
    for m in messages:
        is_assistant = m["role"] == "assistant"
        if is_assistant and not prev_assistant:
            n += 1
        prev_assistant = is_assistant
    return n + (0 if prev_assistant else 1)


class _Conversation:
    """Walks one conversation: prompt turns are copied, assistant runs become one generated answer."""

    def __init__(self, messages: list[dict[str, str]]):
        self.source = messages
        self.pos = 0
        self.history: list[dict[str, str]] = []
        self.answers = 0
        self.remaining = generation_slots(messages)
        self.result: list[dict[str, str]] | None = None
        self.done = False

    def next_prefix(self) -> list[dict[str, str]] | None:
        """The history to answer next, or None when the conversation is complete."""
        if self.done:
            return None
        src = self.source
        while self.pos < len(src) and src[self.pos]["role"] != "assistant":
            self.history.append({"role": src[self.pos]["role"], "content": src[self.pos]["content"]})
            self.pos += 1
        if not self.history or self.history[-1]["role"] == "assistant":  # nothing left to answer
            self.finish()
            return None
        return self.history

    def answer(self, text: str) -> None:
        self.history.append({"role": "assistant", "content": text})
        self.answers += 1
        self.remaining -= 1
        while self.pos < len(self.source) and self.source[self.pos]["role"] == "assistant":
            self.pos += 1  # the original answer(s) this one replaces

    def finish(self) -> None:
        """Done: the history up to its last answer (prompt turns after it have no answer: dropped)."""
        self.done = True
        last = max((k for k, m in enumerate(self.history) if m["role"] == "assistant"), default=None)
        self.result = None if last is None else self.history[: last + 1]


def regenerate_conversations(conversations: list[list[dict[str, str]]], backend: Backend, params: SamplingParams,
                             progress: Progress | None = None
                             ) -> tuple[list[list[dict[str, str]] | None], RegenStats]:
    """Every assistant turn answered by the backend, in order, each conditioned on the regenerated history.

    Returns one conversation per input (None where skipped: the prompt of its first answer was longer than
    `max_prompt_tokens`) and the counts. A conversation whose later prompt is too long keeps the turns up to
    its last answer (counted as truncated). Sampling is seeded per round from `params.seed`.
    """
    params.validate()
    t0 = time.perf_counter()
    stats = RegenStats(prompts=len(conversations))
    states = []
    for i, messages in enumerate(conversations):
        problem = conversation_problem(messages)
        if problem:
            raise BadInput(f"conversation {i}: {problem}")
        states.append(_Conversation(messages))
    round_index = 0
    while True:
        pending = [(s, p) for s in states if (p := s.next_prefix()) is not None]
        if not pending:
            break
        round_params = replace(params, seed=derive_seed(params.seed, "round", round_index))
        replies = backend.generate([list(p) for _, p in pending], round_params, progress)
        if len(replies) != len(pending):
            raise RuntimeError(f"backend {backend.name} returned {len(replies)} replies for {len(pending)} prompts")
        lost = 0
        for (state, _), reply in zip(pending, replies, strict=True):
            stats.generated_tokens += reply.new_tokens
            if reply.text is None:  # prompt too long: stop this conversation here
                lost += state.remaining - 1  # the backend counted this one
                state.finish()
                if state.result is not None:
                    stats.truncated += 1
                continue
            text = strip_thinking(reply.text) if params.thinking == "strip" else reply.text
            state.answer(text)
            stats.turns += 1
            stats.hit_max_new_tokens += int(reply.hit_max_new_tokens)
            stats.roundtrip_mismatches += int(reply.roundtrip_ok is False)
        if progress is not None and lost:
            progress(lost, 0)  # turns that will never come: the progress total stays reachable
        round_index += 1
    results = [s.result for s in states]
    stats.skipped_indices = [i for i, r in enumerate(results) if r is None]
    stats.skipped = len(stats.skipped_indices)
    stats.seconds = time.perf_counter() - t0
    return results, stats
