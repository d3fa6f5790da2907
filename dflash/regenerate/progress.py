"""Progress on stderr: a tqdm bar on a terminal, else one JSON line per interval and per shard, logged through
dflash/logs.py (the `regenerate` command's log stream is stderr; each rank reports its own progress)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from dflash.logs import EVERY_RANK, get_logger

log = get_logger(__name__)


class ProgressReporter:
    def __init__(self, total_answers: int, shards_total: int, rank: int = 0, world_size: int = 1,
                 interval_s: float = 10.0, bar: bool | None = None, stream=None):
        self.stream = stream or sys.stderr  # the bar's terminal
        self.total, self.shards_total = total_answers, shards_total
        self.rank, self.world_size = rank, world_size
        self.interval_s = interval_s
        self.done = self.tokens = self.shards_done = 0
        self.t0 = self._last = time.monotonic()
        if bar is None:
            bar = world_size == 1 and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar = None
        if bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_answers, unit="answer", file=self.stream, dynamic_ncols=True,
                             desc="regenerate", smoothing=0.05)

    def __call__(self, answers: int, tokens: int) -> None:
        self.done += answers
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(answers)
            self._bar.set_postfix_str(f"{self.tokens_per_s:.0f} tok/s, shard {self.shards_done}/{self.shards_total}",
                                      refresh=False)
        elif time.monotonic() - self._last >= self.interval_s:
            self.emit("progress")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(1e-9, time.monotonic() - self.t0)

    def snapshot(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else None
        return {"answers_done": self.done, "answers_total": self.total, "shards_done": self.shards_done,
                "shards_total": self.shards_total, "generated_tokens": self.tokens,
                "tokens_per_s": round(self.tokens_per_s, 1), "elapsed_s": round(elapsed, 1),
                "eta_s": None if eta is None else round(eta, 1)}

    def emit(self, event: str, **extra: Any) -> None:
        """One JSON line (without a bar: the bar shows the same numbers on a terminal)."""
        self._last = time.monotonic()
        record = {"event": f"regenerate_{event}", "rank": self.rank, **self.snapshot(), **extra}
        log.info(json.dumps(record), extra=EVERY_RANK)

    def shard_done(self, index: int, stats: dict[str, Any]) -> None:
        self.shards_done += 1
        if self._bar is None:
            self.emit("shard", shard=index, shard_stats=stats)
        else:
            self._bar.set_postfix_str(f"{self.tokens_per_s:.0f} tok/s, shard {self.shards_done}/{self.shards_total}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
