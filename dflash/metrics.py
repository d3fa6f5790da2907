"""What the training loop accumulates between two log lines, typed (one window per logging.interval)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dflash.loss import BlockStats


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


__all__ = ["MetricsWindow", "StepResult"]
