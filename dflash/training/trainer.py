"""The training loop: target features -> anchors/blocks -> drafter -> decayed CE -> AdamW step.

Read top to bottom: `Trainer.setup()` builds every component, `Trainer.run()` loops over `train_step()`.
One `Trainer` serves every topology; what differs is given to it (docs/architecture.md):

* an input source, where a micro-batch and its target features come from (`dflash.training.sources`):
  `LocalTarget` (the target in this process) or `dflash.training.ranks.RemoteTargets` (sent by target ranks);
* a step reducer, how the ranks' steps meet (`dflash.training.reducers`): `SingleProcess` or
  `dflash.training.ranks.DataParallel`.

The drafter, its attention and its block pass are built by `dflash.training.drafter_setup`. The evals are
`dflash.evaluation.evaluate.Evaluator`'s: the trainer builds one at setup and calls it at every
`logging.eval_interval` and at the end; what it keeps of an eval is the best checkpoint
(`Checkpointer.keep_if_best`). Which checkpoint a start resumes from, the resume contract, the saves and the best
pointer are dflash/training/checkpointer.py's. `dflash.training.run` runs a trainer to its end.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch

from dflash.compile import compile_target_layers, configure_for_run
from dflash.components.checkpoint import CheckpointManager, ensure_writable
from dflash.components.float8 import check_float8, target_float8
from dflash.components.flops import drafter_step_flops, peak_flops
from dflash.components.loss import Blocks, BlockStats, autocast_for, position_weights, step_generator
from dflash.components.metrics import InputTimer, MetricsWindow, StepResult
from dflash.config import RunConfig
from dflash.data.buckets import Batch
from dflash.data.chat import TokenizedSet
from dflash.devices import pick_device
from dflash.errors import BadInput
from dflash.evaluation.evaluate import Evaluator
from dflash.inputs import RunInputs, build_run_inputs, layer_ids_of
from dflash.logs import get_logger
from dflash.models.target import Target
from dflash.runtime import failures
from dflash.runtime.notify import Notifier
from dflash.runtime.observability import RunObserver
from dflash.runtime.stacks import previous_end
from dflash.runtime.trackers import open_trackers
from dflash.training import step_graph
from dflash.training.checkpointer import Checkpointer
from dflash.training.drafter_setup import build_drafter
from dflash.training.reducers import SingleProcess, StepReducer
from dflash.training.sources import InputSource, LocalTarget
from dflash.training.tracker_export import export_to_trackers

log = get_logger(__name__)


def cosine_schedule(total_steps: int, warmup_ratio: float, min_ratio: float):
    warmup = max(1, math.ceil(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# ----------------------------------------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, config: RunConfig, source: InputSource | None = None, reducer: StepReducer | None = None,
                 device: torch.device | None = None):
        self.config = config
        self.source = source if source is not None else LocalTarget()
        self.reducer = reducer if reducer is not None else SingleProcess()
        self.rank, self.world_size = self.reducer.rank, self.reducer.world_size
        self.is_reporter = self.reducer.is_reporter
        self._device = device  # set by dflash.training.ranks (the rank's GPU); else runtime.device
        self.step = 0
        self.input_seconds = 0.0  # time spent obtaining inputs since the last report window
        self.previous_end: dict[str, Any] | None = None  # how the previous start ended (dflash/runtime/stacks.py)
        self.step_graphs: step_graph.StepGraphs | None = None  # the drafter step's CUDA graphs, where it captures

    # the run's inputs and the target, as the rest of the loop reads them
    @property
    def target(self) -> Target | None:
        return self.source.target

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    @property
    def train_set(self) -> TokenizedSet:
        return self.inputs.train_set

    @property
    def eval_set(self) -> TokenizedSet | None:
        return self.inputs.eval_set

    @property
    def layer_ids(self) -> list[int]:
        return self.inputs.layer_ids

    # ------------------------------------------------------------------------------------------ setup
    def setup(self, with_target: bool = True) -> Trainer:
        """Build everything, resume, connect the input source. with_target=False: the drafter, its data and
        state only (no target loaded, the source not connected): what a resume or drafter.init_from yields.

        A failure here (bad data, a tokenizer that does not fit the target, damaged checkpoints) leaves the
        heartbeat at status `failed` with the reason in `error`, never `starting`, and removes the checkpoints
        directory again when this setup created it and nothing was saved."""
        ckpt_dir = Path(self.config.output_dir) / "checkpoints"
        created = not ckpt_dir.exists()
        try:
            return self._setup(with_target)
        except Exception as exc:
            observer = getattr(self, "observer", None)
            if observer is not None:
                reason = str(exc) if isinstance(exc, BadInput) else f"{type(exc).__name__}: {exc}"
                observer.heartbeat(self.step, 0, "failed", error=reason.splitlines()[0] if reason else type(exc).__name__,
                                   failure_class=failures.classify(exc))
            if created and self.is_reporter:
                with contextlib.suppress(OSError):
                    ckpt_dir.rmdir()  # only when empty
            raise

    def _setup(self, with_target: bool) -> Trainer:
        c = self.config
        if c.runtime.num_threads:
            torch.set_num_threads(c.runtime.num_threads)
        out = Path(c.output_dir)
        self.checkpointer = Checkpointer(c, ensure_writable(out / "checkpoints"), self.is_reporter)
        layer_ids = layer_ids_of(c)
        self.device = self._device or pick_device(c.runtime.device)
        if c.drafter.float8:  # before any model loads
            check_float8(self.device)
        if c.target.float8 and with_target:
            check_float8(self.device, "target.float8", torchao=False)
        self.input_timer = InputTimer(self.device)
        self.observer = RunObserver(out, c.logging.tensorboard or "tensorboard" in c.logging.trackers,
                                    enabled=self.is_reporter, trackers=open_trackers(c) if self.is_reporter else None)
        self.previous_end = previous_end(out) if self.is_reporter else None  # before the heartbeat is rewritten
        self.observer.heartbeat(0, 0, "starting")
        self.compile_plan, compile_line = configure_for_run(c.compile, c.output_dir, self.device)
        self.observer.event(compile_line)
        # before any model loads: a conflicting init_from, damaged checkpoints and changed settings stop here
        resume_from = self.checkpointer.plan(layer_ids)
        target = self.source.open(c, layer_ids, self.device) if with_target else None
        self.inputs: RunInputs = build_run_inputs(c, target, layer_ids)
        if target is not None and c.target.float8:  # after regeneration too: it decodes in the target's dtype
            target_float8(target)  # logs how many of its linear layers it puts in float8
        if target is not None and self.compile_plan.target:  # after regeneration: it decodes eagerly
            compile_target_layers(target, self.compile_plan.target_mode)
        self.sampler = self.inputs.sampler(self.rank, self.world_size)
        self.total_steps = self.inputs.total_steps(self.world_size)
        self._build_drafter()
        # the evals (the reporter runs them): the held-out split, its prompts, the drafter's compiled forward
        self.evaluator = Evaluator.for_run(c, self.drafter, self.source, self.tokenizer, self.eval_set,
                                           self.block_pass, forward=self.drafter.forward, autocast=self.autocast,
                                           observer=self.observer)
        self._build_optimizer()
        self.checkpointer.attach(self, layer_ids)
        self.checkpointer.load(resume_from, self.previous_end)
        if with_target:
            self.source.connect(self)
        self.train_model = self.reducer.wrap(self.drafter, self.step)
        self.step_graphs = step_graph.for_trainer(self) if with_target else None
        return self

    def _build_drafter(self) -> None:
        built = build_drafter(self.config, self.layer_ids, self.tokenizer, self.target, self.device, self.compile_plan)
        self.drafter, self.gamma, self.attention_kind = built.drafter, built.gamma, built.attention_kind
        self._flex, self.block_pass = built.flex, built.block_pass

    def _build_optimizer(self) -> None:
        o = self.config.optim
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay, fused=self.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_schedule(self.total_steps, o.warmup_ratio, o.min_lr_ratio))

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The train state's own keys in trainer_state.pt (the parts' states sit beside them)."""
        return {"step": self.step, "config": self.config.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])

    @property
    def ckpt(self) -> CheckpointManager:
        return self.checkpointer.store

    def save_checkpoint(self) -> Path | None:
        return self.checkpointer.save(self.step)

    # ------------------------------------------------------------------------------------------ steps
    def autocast(self):
        return autocast_for(self.device)

    def prepare_blocks(self, batch: Batch, generator: torch.Generator):
        """The host half of a micro-batch's loss (`dflash.components.loss.BlockPass.prepare`: anchors and blocks from the
        host copy, the GPU never waited for; the blocks sent to the device), and this micro-batch's FLOPs and loss
        weight. Returns the blocks on the device."""
        p = self.block_pass.prepare(batch, generator)
        self.last_flops = drafter_step_flops(self.drafter.arch, int(batch.on_host.lengths.sum()), p.anchors, p.valid,
                                             p.on_host.num_rows)
        self.last_weight = self.loss_weight(p.on_host.label_valid)
        return p.blocks

    def blocks_loss(self, features: torch.Tensor, blocks: Blocks, model=None):
        """The device half: drafter forward and the weighted block loss. Returns (loss, correct)."""
        return self.block_pass.loss(model if model is not None else self.drafter, features, blocks,
                                    self.source.embed_tokens(), self.source.lm_head_weight())

    def drafter_loss(self, features: torch.Tensor, batch: Batch, generator: torch.Generator,
                     model=None) -> tuple[torch.Tensor, BlockStats]:
        """Loss and stats of one training micro-batch given its target features (shared by every topology; the
        pass is `dflash.components.loss.BlockPass`, which the evals share)."""
        blocks = self.prepare_blocks(batch, generator)
        loss, correct = self.blocks_loss(features, blocks, model)
        return loss, BlockStats.of(correct, blocks)

    def optimizer_step(self, grad_scale: float | torch.Tensor = 1.0, schedule: bool = True) -> list[torch.Tensor]:
        """Scale the accumulated gradients (the loss normaliser; a 0-d tensor inside a CUDA graph), clip, step, and
        advance the learning-rate schedule unless `schedule` is false (a graph holds no host-side step). Returns
        the gradients it stepped with."""
        grads = [p.grad for p in self.drafter.parameters() if p.grad is not None]
        if grads and (isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0):
            torch._foreach_mul_(grads, grad_scale)
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.optim.grad_clip)
        self.optimizer.step()
        if schedule:
            self.scheduler.step()
        return grads

    def loss_weight(self, label_valid: torch.Tensor) -> float:
        """Sum of the position weights of the valid labels (b, m, B-1), on the host: the denominator of this
        micro-batch's loss."""
        w = position_weights(self.config.drafter.block_size, self.gamma, label_valid.device)
        return float((w * label_valid.float().sum((0, 1))).sum())

    def train_step(self) -> tuple[int, StepResult]:
        """One optimizer step over optim.grad_accum micro-batches on each of world_size ranks.

        The loss is the weighted CE over the whole global batch divided by its total weight, so any split
        of the same global batch over ranks and micro-batches gives the same step (DESIGN §3, topology.md).
        """
        c = self.config
        accum = c.optim.grad_accum
        self.reducer.start_step(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        # No host-device sync until the step's loss is read at its end: the micro-batches' inputs, anchors,
        # blocks and loss weights are host-side, so the GPU runs the target forward, the drafter forward, the
        # loss and the backward back to back (docs/performance-history.md, "Kernel tiles, one sync per step").
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        weight_sum = 0.0
        stats, tokens = None, 0
        self.step_flops = 0.0
        for k in range(accum):
            with self.input_timer():
                epoch, batch, feats = self.source.next()
            # micro-batch k of rank r is item k*world_size + r of the global batch: its anchors do not depend
            # on how the global batch is split
            generator = step_generator(c.seed, self.step, k * self.world_size + self.rank)
            blocks = self.prepare_blocks(batch, generator)
            self.step_flops += self.last_flops.training
            weight = self.last_weight
            # the whole step (forward to AdamW) from a CUDA graph where it can (dflash/training/step_graph.py)
            replayed = self.step_graphs.step(feats, blocks, weight) if self.step_graphs is not None else None
            if replayed is not None:
                loss, st = replayed
            else:
                with self.reducer.grad_sync(k == accum - 1):
                    loss, correct = self.blocks_loss(feats, blocks, self.train_model)
                    (loss * weight).backward()
                st = BlockStats.of(correct, blocks)
            loss_sum += loss.detach().double() * weight
            weight_sum += weight
            stats = st if stats is None else stats + st
            tokens += batch.num_tokens
        loss_total, weight_total = self.reducer.reduce_step(loss_sum, weight_sum)
        # DDP averaged the gradients over world_size ranks; undo that and divide by the global weight
        if replayed is None:
            self.optimizer_step(self.world_size / max(weight_total, 1e-12))
        else:  # the graph scaled, clipped and stepped
            self.scheduler.step()
        self.step += 1
        loss_total = float(loss_total)  # the step's one sync: the loss is checked for NaN before the next step
        self.input_seconds += self.input_timer.collect()
        return epoch, StepResult(loss_total / max(weight_total, 1e-12), stats, tokens)

    # ------------------------------------------------------------------------------------------ loop
    def memory_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return 0.0

    def run(self) -> dict[str, Any]:
        c = self.config
        self.drafter.train()
        window = MetricsWindow()
        epoch = self.sampler.epoch
        self.observer.heartbeat(self.step, epoch, "training")
        last: dict[str, Any] = {}
        notifier = Notifier()  # the supervisor's watchdog: a ping per step (dflash/runtime/notify.py)
        while self.step < self.total_steps and not self.reducer.stop_agreed():
            epoch, res = self.train_step()
            window.add(res, self.step_flops, self.input_seconds)
            self.input_seconds = 0.0
            if not math.isfinite(res.loss):
                raise self.checkpointer.diverged(f"the loss is {res.loss} at step {self.step}")
            if self.step % c.logging.interval == 0 or self.step == self.total_steps:
                last = self._report(epoch, window)
                window = MetricsWindow()
            if self.step % c.checkpoint.interval == 0:
                self.save_checkpoint()
            if c.logging.eval_interval and self.step % c.logging.eval_interval == 0:
                self._report_eval()
            notifier.step(self.step)
            if c.runtime.step_pause_s:
                time.sleep(c.runtime.step_pause_s)
        self.checkpointer.save(self.step, last_step=True)
        stopped = self.reducer.stop_agreed() and self.step < self.total_steps
        result = {**last, "step": self.step, "epoch": epoch, "stopped": stopped}  # the real step, not the last log's
        if not stopped:
            ev = self._report_eval()
            if ev is not None:
                result["eval_tau"] = ev["tau"]
                result["eval_tau_walk"] = ev.get("tau_walk")
                result["eval_acc"] = ev["acc"]
                if "acceptance_length" in ev:
                    result["eval_acceptance_length"] = ev["acceptance_length"]
                    result["eval_lossless"] = ev["lossless"]
        self.observer.heartbeat(self.step, epoch, "stopped" if stopped else "finished",
                                loss=last.get("loss"), tau=last.get("tau"), **self._eval_beat())
        if not stopped and self.observer.trackers:
            export_to_trackers(self.observer, self.ckpt, self.step, self.config.output_dir)
        self.observer.close()
        return result

    def _eval_beat(self) -> dict[str, Any]:
        return self.evaluator.heartbeat_fields()

    def _report(self, epoch: int, window: MetricsWindow) -> dict[str, Any]:
        window = self.reducer.reduce_window(window)
        stats, elapsed = window.stats, window.elapsed()
        record = {"step": self.step, "epoch": epoch, "loss": window.loss, "acc": stats.accuracy,
                  "tau": stats.tau, "tokens_per_s": window.tokens / elapsed,
                  "blocks_per_s": float(stats.num_blocks) / elapsed, "lr": float(self.scheduler.get_last_lr()[0]),
                  "mem_gib": self.memory_gib()}
        peak = peak_flops(self.device, self.config.runtime.peak_tflops)
        if peak:
            record["mfu"] = window.flops / elapsed / peak
        # share of the wall time this rank spent obtaining inputs: the target forward (colocated) or waiting
        # for a target rank's transfer (disaggregated drafter rank)
        record["input_frac"] = min(window.input_s / elapsed, 1.0)
        self.observer.log(record)
        self.observer.heartbeat(self.step, epoch, "training", loss=record["loss"], tau=record["tau"],
                                tokens_per_s=record["tokens_per_s"], **self._eval_beat())
        return record

    def _report_eval(self) -> dict[str, Any] | None:
        """The eval of this step (dflash.evaluation.evaluate.Evaluator: simulated tau on the held-out set, the real
        acceptance length of speculative decoding), run by the reporter alone; a new best real acceptance length
        keeps its checkpoint."""
        if not self.is_reporter:
            return None
        record = self.evaluator.report(self.step)
        self.checkpointer.keep_if_best(self.step, record)
        return record


__all__ = ["Trainer", "cosine_schedule"]
