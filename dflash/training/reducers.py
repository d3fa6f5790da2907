"""How one optimizer step of a rank meets those of the other data-parallel drafter ranks (the trainer's step
reducer): the protocol, and `SingleProcess`, one process training alone. Data-parallel drafter ranks reduce with
`dflash.training.ranks.DataParallel` (DDP, the global loss normaliser, the metrics and the stop decision summed)."""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from dflash.components.metrics import MetricsWindow
from dflash.models.drafter import Drafter
from dflash.runtime import stop


class StepReducer(Protocol):
    """How one optimizer step of this rank meets those of the other data-parallel drafter ranks."""

    rank: int  # among the data-parallel drafter ranks
    world_size: int
    is_reporter: bool  # logs, writes the heartbeat and checkpoints

    def wrap(self, drafter: Drafter, step: int) -> torch.nn.Module:
        """After resume: the module the training step calls (the drafter, or its DDP wrapper)."""

    def start_step(self, step: int) -> None: ...

    def grad_sync(self, last_micro_batch: bool) -> contextlib.AbstractContextManager: ...

    def reduce_step(self, loss_sum: torch.Tensor, weight_sum: float) -> tuple[torch.Tensor, float]:
        """This rank's weighted loss (a 0-d tensor, left on its device) and loss weight, summed over the ranks;
        also where the ranks agree to stop."""

    def reduce_window(self, window: MetricsWindow) -> MetricsWindow: ...

    def stop_agreed(self) -> bool: ...


class SingleProcess:
    """One process trains alone: nothing to reduce; a stop signal is seen directly."""

    rank, world_size, is_reporter = 0, 1, True

    def wrap(self, drafter: Drafter, step: int) -> torch.nn.Module:
        return drafter

    def start_step(self, step: int) -> None:
        pass

    def grad_sync(self, last_micro_batch: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def reduce_step(self, loss_sum: torch.Tensor, weight_sum: float) -> tuple[torch.Tensor, float]:
        return loss_sum, weight_sum  # nothing to sum, and no sync

    def reduce_window(self, window: MetricsWindow) -> MetricsWindow:
        return window

    def stop_agreed(self) -> bool:
        return stop.requested()
