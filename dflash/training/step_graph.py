"""The drafter's training step replayed from a CUDA graph (`compile.step_graph`; docs/PERFORMANCE.md).

One optimizer step of the drafter - forward, the fused loss, backward, the gradient scale, the clip and the
fused AdamW step - is captured once per input shape and replayed: one launch instead of a few thousand. What
changes between steps is copied into the graph's static inputs: the target features, the blocks, the loss's
label rows (padded to a multiple of ROW_QUANTUM with weight 0, so that their varying count does not change
the shape) and the loss weight; the learning rate is a tensor the scheduler fills.

A shape is captured the second time it is seen (its first step runs kernel by kernel and compiles the pieces);
at most `max_shapes` shapes are kept, each with the activation memory of one step held between replays; other
shapes run kernel by kernel. What keeps a run from capturing (not CUDA, several ranks or micro-batches) is
logged once at start; a capture that fails is logged once and the run goes on kernel by kernel.

`capture=False` runs the same static-input step eagerly (the CPU tests check it against the trainer's own
step: same losses, same weights), so everything but the capture itself is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from dflash.components.loss import Blocks, BlockStats
from dflash.logs import get_logger

log = get_logger(__name__)

ROW_QUANTUM = 256  # label rows are padded up to a multiple of this: one shape for nearby counts


def unsupported(trainer: Any) -> str | None:
    """Why this run's steps cannot be captured, or None."""
    if trainer.device.type != "cuda":
        return f"the drafter runs on {trainer.device.type}, not CUDA"
    if trainer.world_size > 1:
        return f"{trainer.world_size} ranks (the gradient all-reduce is not captured)"
    if trainer.config.optim.grad_accum > 1:
        return f"optim.grad_accum={trainer.config.optim.grad_accum} (one micro-batch per step is captured)"
    if not getattr(trainer.optimizer, "defaults", {}).get("fused"):
        return "the optimizer is not the fused AdamW"
    return None


def for_trainer(trainer: Any) -> StepGraphs | None:
    """The trainer's step graphs per `compile.step_graph` (null: where the run allows it), or None."""
    wanted = trainer.config.compile.step_graph
    if wanted is False:
        return None
    reason = unsupported(trainer)
    if reason is not None:
        if wanted:  # asked for explicitly: say why not; the default is quiet off CUDA
            log.warning(f"compile.step_graph: the drafter step runs kernel by kernel: {reason}")
        elif trainer.device.type == "cuda":
            log.info(f"compile: drafter step not captured in a CUDA graph: {reason}")
        return None
    log.info(f"compile: drafter step captured in a CUDA graph per input shape (at most "
             f"{trainer.config.compile.step_graph_shapes})")
    return StepGraphs(trainer, max_shapes=trainer.config.compile.step_graph_shapes)


def padded_blocks(blocks: Blocks, capacity: int) -> Blocks:
    """`blocks` with its label rows padded to `capacity`: the pads repeat the first row with weight 0 (the same
    position, label and hit: the loss, its gradient and the hits are those of the unpadded rows)."""
    rows = blocks.row_index()
    n = int(rows.numel())
    if n == 0:
        raise ValueError("no label rows to pad")
    mask = torch.zeros(capacity, dtype=torch.float32, device=rows.device)
    mask[:n] = 1.0
    full = torch.cat([rows, rows[:1].expand(capacity - n)])
    return replace(blocks, rows=full, row_mask=mask)


def row_capacity(n: int) -> int:
    return max(ROW_QUANTUM, math.ceil(n / ROW_QUANTUM) * ROW_QUANTUM)


@dataclass
class _Graph:
    """One captured shape: its static inputs and outputs, the gradients it writes, the graph."""

    features: torch.Tensor
    blocks: Blocks
    weight: torch.Tensor  # () the micro-batch's loss weight
    scale: torch.Tensor  # () the gradient scale (1 / the step's weight)
    graph: Any = None  # torch.cuda.CUDAGraph; None when replayed eagerly (capture=False)
    loss: torch.Tensor | None = None
    stats: BlockStats | None = None
    grads: list[torch.Tensor] | None = None  # kept alive: the graph writes them at every replay

    def load(self, features: torch.Tensor, blocks: Blocks, weight: float) -> None:
        self.features.copy_(features, non_blocking=True)
        for name in ("anchors", "anchor_valid", "block_ids", "labels", "label_valid", "rows", "row_mask"):
            getattr(self.blocks, name).copy_(getattr(blocks, name), non_blocking=True)
        self.weight.fill_(weight)
        self.scale.fill_(1.0 / max(weight, 1e-12))


class StepGraphs:
    """The trainer's drafter step, one CUDA graph per input shape (module docstring)."""

    def __init__(self, trainer: Any, max_shapes: int = 2, capture: bool = True):
        self.trainer = trainer  # a dflash.training.trainer.Trainer (not imported: it imports this module)
        self.max_shapes = max_shapes
        self.capture = capture
        self.graphs: dict[tuple, _Graph] = {}
        self.seen: set[tuple] = set()
        self.failed: str | None = None
        self.replays = 0
        self._optimizer_ready = False

    # -------------------------------------------------------------------------------------------- a step
    def step(self, features: torch.Tensor, blocks: Blocks, weight: float) -> tuple[torch.Tensor, BlockStats] | None:
        """Run the whole optimizer step (forward to AdamW) from the graph of this shape; None when this step
        must run kernel by kernel (a new shape, too many shapes, a failed capture): the caller runs it."""
        rows = int(blocks.row_index().numel())
        if self.failed is not None or rows == 0:
            return None
        padded = padded_blocks(blocks, row_capacity(rows))
        key = (tuple(features.shape), features.dtype, tuple(padded.block_ids.shape), int(padded.rows.numel()))
        g = self.graphs.get(key)
        if g is None:
            if len(self.graphs) >= self.max_shapes:
                return None
            if key not in self.seen:  # first sight: runs eagerly, compiles what this shape needs
                self.seen.add(key)
                return None
            g = self._new(key, features, padded, weight)
            if g is None:
                return None
        else:
            g.load(features, padded, weight)
        if g.graph is not None:
            g.graph.replay()
        else:
            self._body(g)
        self.replays += 1
        # the outputs are rewritten by the next replay: the caller keeps copies
        return g.loss.detach().clone(), BlockStats(*(t.clone() for t in (g.stats.correct_per_pos, g.stats.valid_per_pos,
                                                                          g.stats.accepted_sum, g.stats.num_blocks)))

    def _body(self, g: _Graph) -> None:
        """What the graph holds: the trainer's step on the static inputs (no host-device sync inside)."""
        t = self.trainer
        loss, correct = t.blocks_loss(g.features, g.blocks, t.train_model)
        (loss * g.weight).backward()
        g.grads = t.optimizer_step(g.scale, schedule=False)  # the scheduler steps outside, on the host
        g.loss, g.stats = loss.detach(), BlockStats.of(correct, g.blocks)

    # ------------------------------------------------------------------------------------------ capture
    def _static(self, features: torch.Tensor, blocks: Blocks, weight: float) -> _Graph:
        b = Blocks(*(x.clone() for x in (blocks.anchors, blocks.anchor_valid, blocks.block_ids, blocks.labels,
                                         blocks.label_valid, blocks.rows)), row_mask=blocks.row_mask.clone())
        dev = features.device
        g = _Graph(features.clone(), b, torch.zeros((), device=dev), torch.zeros((), device=dev))
        g.load(features, blocks, weight)
        return g

    def _prepare_optimizer(self) -> None:
        """Capturable AdamW with the learning rate as a tensor (the scheduler fills it; the graph reads it)."""
        if self._optimizer_ready:
            return
        for group in self.trainer.optimizer.param_groups:
            group["capturable"] = True
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.trainer.device)
        self._optimizer_ready = True

    def _new(self, key: tuple, features: torch.Tensor, blocks: Blocks, weight: float) -> _Graph | None:
        g = self._static(features, blocks, weight)
        if not self.capture:
            self.graphs[key] = g
            return g
        t = self.trainer
        try:
            self._prepare_optimizer()
            t.optimizer.zero_grad(set_to_none=True)
            # warm-up of forward and backward on a side stream (torch.cuda.graph's documented pattern); the
            # weights do not move (no optimizer step), the gradients are dropped again
            side = torch.cuda.Stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                loss, _ = t.blocks_loss(g.features, g.blocks, t.train_model)
                (loss * g.weight).backward()
                del loss
            torch.cuda.current_stream(t.device).wait_stream(side)
            t.optimizer.zero_grad(set_to_none=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._body(g)
            g.graph = graph
        except Exception as exc:  # noqa: BLE001 - any capture failure: this run goes on kernel by kernel
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            log.warning(f"compile: the drafter step could not be captured in a CUDA graph ({self.failed}); "
                        "it runs kernel by kernel. Set compile.step_graph=false to skip the attempt")
            self.graphs.clear()
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(t.device)
            t.optimizer.zero_grad(set_to_none=True)
            return None
        self.graphs[key] = g
        log.info(f"compile: drafter step captured in a CUDA graph for features {tuple(features.shape)}, "
                 f"label rows padded to {int(blocks.rows.numel())}")
        return g
