"""The training loop: target features -> anchors/blocks -> drafter -> decayed CE -> AdamW step.

Read top to bottom: `Trainer.setup()` builds every component, `Trainer.run()` loops over `train_step()`.
One `Trainer` serves every topology; what differs is given to it (docs/architecture.md):

* an input source, where a micro-batch and its target features come from: `LocalTarget` (the target in
  this process) or `dflash.distributed.ranks.RemoteTargets` (sent by target ranks);
* a step reducer, how the ranks' steps meet: `SingleProcess` or `dflash.distributed.ranks.DataParallel`.

The evals are `dflash.evaluate.Evaluator`'s: the trainer builds one at setup and calls it at every
`logging.eval_interval` and at the end; what it keeps of an eval is the best checkpoint (`Checkpointer.keep_if_best`). Which checkpoint a start resumes
from, the resume contract, the saves and the best pointer are dflash/checkpointer.py's.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from dflash import failures, step_graph, stop
from dflash.checkpoint import CheckpointManager, ensure_writable
from dflash.checkpointer import Checkpointer
from dflash.compile import compile_drafter, compile_target_layers, configure_for_run, flash_version
from dflash.config import RunConfig, check_dflash2, default_gamma
from dflash.data.buckets import Batch
from dflash.data.chat import TokenizedSet
from dflash.devices import pick_device
from dflash.errors import BadInput
from dflash.evaluate import Evaluator, TargetFeatures
from dflash.float8 import check_float8, check_float8_head, convert_linears, float8_linears, target_float8
from dflash.flops import drafter_step_flops, peak_flops
from dflash.inputs import RunInputs, build_run_inputs, layer_ids_of
from dflash.logs import get_logger
from dflash.loss import BlockPass, Blocks, BlockStats, autocast_for, position_weights, step_generator
from dflash.metrics import InputTimer, MetricsWindow, StepResult
from dflash.models.attention import (
    FLASH_OPTIONS,
    compiled_flex_attention,
    flex_options_for,
    probe_flash,
    resolve_flex_backend,
    resolve_kind,
)
from dflash.models.drafter import Drafter, arch_from_target
from dflash.models.target import Target, build_hf_model, require_fast_path
from dflash.notify import Notifier
from dflash.observability import RunObserver
from dflash.stacks import previous_end
from dflash.trackers import open_trackers

log = get_logger(__name__)



def cosine_schedule(total_steps: int, warmup_ratio: float, min_ratio: float):
    warmup = max(1, math.ceil(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# ---------------------------------------------------------------------------------------- input sources
class InputSource(Protocol):
    """Where the trainer's micro-batches and their target features come from. Its `target`, `features`,
    `embed_tokens` and `lm_head_weight` are also what the evaluator reads (`dflash.evaluate.FeatureSource`)."""

    target: Target | None  # the target in this process (evaluation needs it), or None

    def open(self, config: RunConfig, layer_ids: list[int], device: torch.device) -> Target | None:
        """At setup, before the data is built (regeneration needs the target): load what this process holds."""

    def connect(self, trainer: Trainer) -> None:
        """After the drafter is built and resumed: the data position and the schedule are known."""

    def next(self) -> tuple[int, Batch, torch.Tensor]:
        """(epoch, batch on the device, target features) of this rank's next micro-batch."""

    def features(self, batch: Batch) -> torch.Tensor: ...

    def embed_tokens(self) -> torch.nn.Embedding: ...

    def lm_head_weight(self) -> torch.Tensor: ...

    def finish(self) -> None:
        """After the last step."""


class LocalTarget(TargetFeatures):
    """The target in this process (single process, colocated ranks): features of the rank's own batches (its
    features, embedding and LM head as an evaluation reads them: `TargetFeatures`)."""

    def __init__(self) -> None:
        super().__init__(None)  # loaded by `open`

    def open(self, config: RunConfig, layer_ids: list[int], device: torch.device) -> Target:
        c = config
        model = build_hf_model(c.target.path, c.target.random_init, c.target.dtype, c.target.attn_implementation,
                               seed=c.seed, device=device)
        target = Target(model.to(device), layer_ids)
        report = target.fast_path_report()
        log.info(f"target: {target.num_layers} layers, hidden {target.hidden_size}, tapped {layer_ids}; "
                 f"{report.describe()}")
        require_fast_path(report, device, c.target.allow_slow_path)
        self.target = target
        return target

    def connect(self, trainer: Trainer) -> None:
        self.inputs, self.sampler, self.device = trainer.inputs, trainer.sampler, trainer.device
        c = trainer.config
        self.cache = None
        if c.data.feature_cache:
            from dflash.data.feature_cache import FeatureCache

            t = c.target
            identity = {"target": t.path, "random_init": t.random_init, "seed": c.seed, "dtype": t.dtype,
                        "float8": t.float8, "layer_ids": self.inputs.layer_ids}
            self.cache = FeatureCache(Path(c.output_dir) / "feature-cache", identity, c.data.feature_cache_dtype,
                                      next(self.target.model.parameters()).dtype)

    def features(self, batch: Batch) -> torch.Tensor:
        cache = getattr(self, "cache", None)
        if cache is None:
            return super().features(batch)
        return cache.features(batch, super().features)

    def next(self) -> tuple[int, Batch, torch.Tensor]:
        epoch, blen, idx = self.sampler.next()
        batch = self.inputs.batch(blen, idx).to(self.device)
        return epoch, batch, self.features(batch)

    def finish(self) -> None:
        if getattr(self, "cache", None) is not None:
            log.info(self.cache.describe())


# ----------------------------------------------------------------------------------------- step reducers
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


# ----------------------------------------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, config: RunConfig, source: InputSource | None = None, reducer: StepReducer | None = None,
                 device: torch.device | None = None):
        self.config = config
        self.source = source if source is not None else LocalTarget()
        self.reducer = reducer if reducer is not None else SingleProcess()
        self.rank, self.world_size = self.reducer.rank, self.reducer.world_size
        self.is_reporter = self.reducer.is_reporter
        self._device = device  # set by dflash.distributed (the rank's GPU); else runtime.device
        self.step = 0
        self.input_seconds = 0.0  # time spent obtaining inputs since the last report window
        self.previous_end: dict[str, Any] | None = None  # how the previous start ended (dflash/stacks.py)
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

    def _mask_token_id(self, vocab_size: int) -> int:
        c = self.config.drafter
        mid = c.mask_token_id
        if mid is None:
            mid = getattr(self.tokenizer, "mask_token_id", None)
        if mid is None:
            mid = self.tokenizer.pad_token_id
        if mid is None or not 0 <= mid < vocab_size:
            raise BadInput(f"drafter.mask_token_id {mid} is not a token of the target's vocabulary (0..{vocab_size - 1}); "
                           "set drafter.mask_token_id to a reserved token id")
        return int(mid)

    def _build_drafter(self) -> None:
        c = self.config
        from dflash.models.target import target_config, text_config_of

        tcfg = target_config(c.target.path, c.target.random_init)
        text_cfg = text_config_of(tcfg)
        vocab = self.target.vocab_size if self.target is not None else text_cfg.vocab_size
        if c.drafter.init_from:  # must agree with this config: what it trains is the config's drafter
            from dflash.export import load_init_drafter

            mask_key = "drafter.mask_token_id" if c.drafter.mask_token_id is not None else (
                "drafter.mask_token_id (unset: the tokenizer's mask or pad token)")
            expected = {"block_size": ("drafter.block_size", c.drafter.block_size),
                        "num_hidden_layers": ("drafter.num_layers", c.drafter.num_layers),
                        "target_layer_ids": ("target.layer_ids (resolved)", list(self.layer_ids)),
                        "mask_token_id": (mask_key, self._mask_token_id(vocab)),
                        "hidden_size": ("the target's hidden_size", int(text_cfg.hidden_size))}
            for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads"):  # when set
                if getattr(c.drafter, key) is not None:
                    expected[key] = (f"drafter.{key}", getattr(c.drafter, key))
            for key, value in (check_dflash2(c.drafter.dflash2, "drafter.dflash2") or {}).items():
                expected[key] = (f"drafter.dflash2.{key}", value)  # where set, the init must be that DFlash2
            self.drafter = load_init_drafter(c.drafter.init_from, expected)
        else:
            arch = arch_from_target(tcfg, num_layers=c.drafter.num_layers, block_size=c.drafter.block_size,
                                    layer_ids=self.layer_ids, mask_token_id=self._mask_token_id(vocab),
                                    vocab_size=vocab, intermediate_size=c.drafter.intermediate_size,
                                    num_attention_heads=c.drafter.num_attention_heads,
                                    num_key_value_heads=c.drafter.num_key_value_heads,
                                    layer_types=c.drafter.layer_types, sliding_window=c.drafter.sliding_window,
                                    dflash2=check_dflash2(c.drafter.dflash2, "drafter.dflash2"))
            gen_state = torch.random.get_rng_state()
            torch.manual_seed(c.seed + 17)
            self.drafter = Drafter(arch)
            torch.random.set_rng_state(gen_state)
        self.drafter.to(self.device)
        if c.drafter.float8_head:
            check_float8_head(self.drafter.arch.vocab_size, self.drafter.arch.hidden_size)
        if c.drafter.float8:  # before compilation: the compiled forward fuses the float8 casts
            kept = convert_linears(self.drafter)
            log.info(f"drafter: {len(float8_linears(self.drafter))} linear layers in float8 (torchao, tensorwise)"
                     + ("; the loss's LM head in float8 (rowwise)" if c.drafter.float8_head else "")
                     + (f"; kept in their precision (dimensions not divisible by 16): {', '.join(kept)}"
                        if kept else ""))
        self.gamma = c.drafter.gamma or default_gamma(c.drafter.block_size)
        self.attention_kind = resolve_kind(c.drafter.attention, self.device)
        plan = self.compile_plan
        self._flex = None
        if self.attention_kind == "flex" and plan.flex:
            self._flex = compiled_flex_attention(plan.drafter_mode, self._flex_kernel_options(plan.drafter_mode))
        elif c.compile.flex_backend == "flash":
            raise BadInput("compile.flex_backend=flash but this run's drafter attention is not compiled "
                           f"flex_attention ({self.attention_kind} on {self.device.type}"
                           f"{'' if plan.flex else ', compile.flex off'}); set compile.flex_backend=auto")
        if plan.drafter:  # the whole forward (measured faster than per layer); the BlockMask stays eager
            compile_drafter(self.drafter, plan.drafter_mode)
        d = c.drafter
        self.block_pass = BlockPass(self.drafter, d.block_size, self.gamma, d.num_anchors, d.loss_chunk_size,
                                    d.loss_impl, self.attention_kind, self.device, self._flex, d.float8_head)

    def _flex_kernel_options(self, mode: str) -> dict:
        """flex_attention's kernel options: FlashAttention-4's kernels where they run here and pass the start-up
        check (dflash.models.attention.probe_flash), else the Triton tiles. One log line says which and why."""
        c, arch = self.config.compile, self.drafter.arch
        backend, why = resolve_flex_backend(c.flex_backend, self.device, arch.head_dim)
        if backend == "flash":
            t0 = time.monotonic()
            layers = tuple(arch.layer_mask(i) for i in range(arch.num_hidden_layers))
            why = probe_flash(mode, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim,
                              arch.block_size, self.device, layers)
            if why is None:
                log.info(f"compile: flex_attention on FlashAttention-4's kernels (flash-attn-4 {flash_version()}; "
                         f"checked against the Triton kernels in {time.monotonic() - t0:.0f}s)")
                return dict(FLASH_OPTIONS)
            log.warning(f"compile: FlashAttention-4's kernels failed their start-up check ({why}); flex_attention "
                        "runs on the Triton kernels. Set compile.flex_backend=triton to skip the check")
        tiles = flex_options_for(c.flex_kernel_options, self.device, arch.head_dim)
        log.info(f"compile: flex_attention kernel options {tiles or 'torch defaults'}"
                 + (f" (Triton: {why})" if why and self.device.type == "cuda" else ""))
        return tiles

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
        """The host half of a micro-batch's loss (`dflash.loss.BlockPass.prepare`: anchors and blocks from the
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
        pass is `dflash.loss.BlockPass`, which the evals share)."""
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
            # the whole step (forward to AdamW) from a CUDA graph where it can (dflash/step_graph.py)
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
        notifier = Notifier()  # the supervisor's watchdog: a ping per step (dflash/notify.py)
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
            self._export_to_trackers()
        self.observer.close()
        return result

    def _export_to_trackers(self) -> None:
        """The final checkpoint exported for serving (OUTPUT_DIR/trackers/export) and uploaded to the trackers as
        the artifact `export`; a failure is one warning, never the run's."""
        from dflash.export import export

        target = Path(self.config.output_dir) / "trackers" / "export"
        try:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            self.observer.artifact(export(self.ckpt.path_for(self.step), target, which="latest"), "export")
        except Exception as exc:  # noqa: BLE001 - the trained checkpoint is kept whatever the export does
            log.warning(f"trackers: the export of step {self.step} for the trackers failed ({type(exc).__name__}: "
                        f"{exc}); the checkpoint is kept, `dflash export` makes it")

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
        """The eval of this step (dflash.evaluate.Evaluator: simulated tau on the held-out set, the real
        acceptance length of speculative decoding), run by the reporter alone; a new best real acceptance length
        keeps its checkpoint."""
        if not self.is_reporter:
            return None
        record = self.evaluator.report(self.step)
        self.checkpointer.keep_if_best(self.step, record)
        return record


def run_to_end(trainer: Trainer) -> dict[str, Any]:
    """trainer.run(), then the input source's finish(); the reporter's heartbeat says `failed` (with the
    reason) if either raises."""
    try:
        result = trainer.run()
        trainer.source.finish()
        return result
    except BaseException as exc:
        # the failure's class (dflash/failures.py) goes into the heartbeat and, as its exit code, to the supervisor
        cls = failures.classify(exc) if isinstance(exc, Exception) else None
        classified = cls in failures.RAISED_CLASSES and not isinstance(exc, failures.ClassifiedFailure)
        reason = failures.describe(cls, exc, trainer.config) if classified else (
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        with contextlib.suppress(OSError):  # a full disk must not hide the error itself
            trainer.observer.heartbeat(trainer.step, trainer.sampler.epoch, "failed", error=reason,
                                       **({"failure_class": cls} if cls else {}))
        with contextlib.suppress(Exception):
            trainer.observer.close(failed=True)  # the trackers' runs end as failed
        if classified:
            raise failures.ClassifiedFailure(cls, reason) from exc
        raise


def train(config: RunConfig) -> dict[str, Any]:
    """Single-process training. A stop signal during start-up (caught by the launcher's `stop.install()`)
    ends it cleanly: before setup, nothing is loaded; during setup, it stops before the first step."""
    if stop.requested():
        log.info("received a stop signal during start-up: not starting")
        return {"step": 0, "stopped": True}
    trainer = Trainer(config).setup()
    stop.install(lambda signum: log.info(f"received signal {signum}: stopping at the next step boundary with a "
                                         f"checkpoint (an eval under way ends early)"))
    if stop.requested():
        log.info("received a stop signal during start-up: stopping before training")
    try:
        return run_to_end(trainer)
    finally:
        stop.finished()


__all__ = ["LocalTarget", "SingleProcess", "Trainer", "cosine_schedule", "run_to_end", "step_generator", "train"]
