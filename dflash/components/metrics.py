"""What the training loop accumulates between two log lines, typed (one window per logging.interval)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from dflash.components.loss import BlockStats


@dataclass
class StepResult:
    """One optimizer step: the global batch's loss, its block statistics, the tokens it read on this rank."""

    loss: float
    stats: BlockStats
    tokens: int


@dataclass
class MetricsWindow:
    """Sums over the steps since the last report; `to_vector`/`from_vector` let ranks all-reduce it."""

    loss_sum: float = 0.0  # of the steps' global losses
    steps: int = 0
    tokens: int = 0
    flops: float = 0.0  # drafter training FLOPs counted on this rank
    input_s: float = 0.0  # seconds this rank spent obtaining inputs (target forward or transfer wait)
    stats: BlockStats | None = None
    started: float = field(default_factory=time.time)

    def add(self, result: StepResult, flops: float, input_s: float) -> None:
        self.loss_sum += result.loss
        self.steps += 1
        self.tokens += result.tokens
        self.flops += flops
        self.input_s += input_s
        self.stats = result.stats if self.stats is None else self.stats + result.stats

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.steps, 1)

    def elapsed(self) -> float:
        return max(time.time() - self.started, 1e-9)

    def to_vector(self) -> torch.Tensor:
        """[loss_sum, steps, tokens, stats...] in float64: what data-parallel ranks sum."""
        stats = self.stats.to_vector().to(torch.float64)
        head = torch.tensor([self.loss_sum, self.steps, self.tokens], dtype=torch.float64, device=stats.device)
        return torch.cat([head, stats])

    def with_sums(self, vector: torch.Tensor) -> MetricsWindow:
        """This window with loss, steps, tokens and stats replaced by the summed `vector` (timing stays local)."""
        v = vector.cpu()
        return MetricsWindow(float(v[0]), int(v[1]), int(v[2]), self.flops, self.input_s,
                             type(self.stats).from_vector(v[3:].float()), self.started)


class InputTimer:
    """Seconds spent obtaining a step's inputs (the target forward, or the wait for a transfer), measured
    without a sync: on a GPU by events around each fetch, read once the step has synced; on the CPU by the
    host clock."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.host_s = 0.0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            self.host_s += time.perf_counter() - t0
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.events.append((start, end))

    def collect(self) -> float:
        """The seconds since the last collect (waits for the last fetch's end on the GPU: free after a sync)."""
        seconds, self.host_s = self.host_s, 0.0
        for start, end in self.events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1e3
        self.events.clear()
        return seconds


__all__ = ["InputTimer", "MetricsWindow", "StepResult"]
