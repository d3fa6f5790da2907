"""What one torchrun worker runs: a data-parallel drafter rank (colocated or fed by target ranks) or a target rank.

A drafter rank is the one `Trainer` given a `DataParallel` step reducer and an input source: `LocalTarget`
(colocated) or `RemoteTargets` (disaggregated). A target rank runs `run_target_rank`, the one target-rank
loop: an unsplit target is stage 0 of 1 (dflash/runtime/stages.py).

Stopping (dflash/runtime/stop.py): a signal only marks the rank; the ranks agree to stop in the per-step all-reduce of
the drafter group, so all of them leave the loop after the same step and the reporter checkpoints it. Target
ranks absorb signals and stop when the drafter ranks send STOP (dflash/runtime/transfer.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dflash.compile import compile_target_layers, configure_for_run
from dflash.components.float8 import check_float8, target_float8
from dflash.components.metrics import MetricsWindow
from dflash.config import RunConfig
from dflash.data.buckets import Batch
from dflash.errors import BadInput
from dflash.inputs import build_run_inputs, check_token_range, layer_ids_of
from dflash.logs import EVERY_RANK, get_logger
from dflash.models.drafter import Drafter
from dflash.models.target import DTYPES, build_hf_model, require_fast_path
from dflash.runtime import setup_barrier, stop
from dflash.runtime.stages import TargetStage, stage_bounds
from dflash.runtime.topology import RankPlan
from dflash.runtime.transfer import FeatureConsumer, FeatureProducer, ItemSchedule, TransferLayout
from dflash.training.run import run_to_end
from dflash.training.sources import LocalTarget
from dflash.training.trainer import Trainer

FAULT_ENV = "DFLASH_FAULT_INJECT"
SETUP_FAULT_ENV = "DFLASH_SETUP_FAULT_INJECT"

log = get_logger(__name__)


class InjectedFault(RuntimeError):
    """Raised by the test hook DFLASH_FAULT_INJECT=RANK:STEP[:hang]: global rank RANK fails (or hangs) when it
    starts the step after STEP completed ones (a target rank: when it starts producing that step's items)."""


def check_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    try:
        want_rank, want_step = int(parts[0]), int(parts[1])
        kind = parts[2] if len(parts) > 2 else "raise"
        assert kind in ("raise", "hang") and len(parts) <= 3
    except (ValueError, IndexError, AssertionError):
        raise BadInput(f"{FAULT_ENV}={spec!r}: expected RANK:STEP or RANK:STEP:hang, e.g. 1:5") from None
    if rank != want_rank or step != want_step:
        return
    if kind == "hang":  # a silent hang: the peers must time out (topology.timeout_s), not wait forever
        log.info(f"rank {rank}: hanging after {step} steps ({FAULT_ENV}={spec})", extra=EVERY_RANK)
        while True:
            time.sleep(3600)
    raise InjectedFault(f"injected fault ({FAULT_ENV}={spec}) on rank {rank} after {step} steps")


def check_setup_fault(rank: int) -> None:
    """Test hook DFLASH_SETUP_FAULT_INJECT=RANK:SECONDS: global rank RANK's setup takes SECONDS longer (a slower
    disk, a busier machine), so that it ends after its peers' by more than topology.timeout_s."""
    spec = os.environ.get(SETUP_FAULT_ENV)
    if not spec:
        return
    try:
        want_rank, seconds = spec.split(":")
        want_rank, seconds = int(want_rank), float(seconds)
    except ValueError:
        raise BadInput(f"{SETUP_FAULT_ENV}={spec!r}: expected RANK:SECONDS, e.g. 0:30") from None
    if rank == want_rank:
        log.info(f"rank {rank}: setting up {seconds:g}s slower ({SETUP_FAULT_ENV}={spec})", extra=EVERY_RANK)
        time.sleep(seconds)


def _broadcast_object(obj, src: int, group=None):
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def share_frozen_head(target_model, group, src: int, rank: int, device: torch.device, dtype: torch.dtype):
    """Target rank `src` sends the frozen embedding table and LM head to the drafter ranks (once)."""
    if rank == src:
        embed, head = target_model.embed_tokens.weight, target_model.lm_head.weight
        header = [tuple(embed.shape), tuple(head.shape), head.data_ptr() == embed.data_ptr()]
    else:
        header = None
    embed_shape, head_shape, tied = _broadcast_object(header, src, group)
    if rank != src:
        embed = torch.empty(embed_shape, dtype=dtype, device=device)
        head = embed if tied else torch.empty(head_shape, dtype=dtype, device=device)
    dist.broadcast(embed.data, src=src, group=group)
    if not tied:
        dist.broadcast(head.data, src=src, group=group)
    return embed, head


def run_schedule(plan: RankPlan, step: int, total_steps: int, grad_accum: int) -> ItemSchedule:
    """The items of this run (from `step` to `total_steps`) and their producers; both sides build it alike."""
    return ItemSchedule(plan.producers, plan.drafter_ranks, step * grad_accum, (total_steps - step) * grad_accum)


def _announce_stop(signum: int) -> None:
    log.info(f"received signal {signum}: all ranks stop and checkpoint after the current step")


# ----------------------------------------------------------------------------------------- drafter ranks
class DataParallel:
    """Step reducer of a drafter rank: DDP over the drafter group, the global loss normaliser, the metrics
    window and the stop decision summed over the group."""

    def __init__(self, config: RunConfig, plan: RankPlan, global_rank: int, device: torch.device, group):
        self.rank, self.world_size = plan.drafter_index(global_rank), len(plan.drafter_ranks)
        self.is_reporter = global_rank == plan.reporter
        self.config, self.global_rank, self.device, self.group = config, global_rank, device, group
        self.ddp: DistributedDataParallel | None = None
        self._stop = False

    def wrap(self, drafter: Drafter, step: int) -> nn.Module:
        """After resume: check every rank resumed the same step, then wrap the drafter in DDP."""
        setup_barrier.wait()  # the first collective of a colocated rank: every rank's setup is done
        steps = torch.tensor([step, -step], dtype=torch.long, device=self.device)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=self.group)
        if int(steps[0]) != -int(steps[1]):
            raise BadInput(f"drafter ranks resumed different steps ({-int(steps[1])}..{int(steps[0])}); every "
                           f"node must see the reporter's checkpoints: put output_dir ({self.config.output_dir}) "
                           "on a filesystem shared by all nodes")
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(drafter, device_ids=ids, process_group=self.group)
        return self.ddp

    def start_step(self, step: int) -> None:
        check_fault(self.global_rank, step)

    def grad_sync(self, last_micro_batch: bool) -> contextlib.AbstractContextManager:
        """Gradients are all-reduced only in the backward of the last micro-batch."""
        return contextlib.nullcontext() if last_micro_batch else self.ddp.no_sync()

    def reduce_step(self, loss_sum: torch.Tensor, weight_sum: float) -> tuple[torch.Tensor, float]:
        flag = 1.0 if stop.requested() else 0.0
        v = torch.stack([loss_sum.to(self.device, torch.float64),
                         *torch.tensor([weight_sum, flag], dtype=torch.float64, device=self.device)])
        dist.all_reduce(v, group=self.group)
        v = v.cpu()
        self._stop = self._stop or float(v[2]) > 0
        return v[0], float(v[1])

    def reduce_window(self, window: MetricsWindow) -> MetricsWindow:
        v = window.to_vector().to(self.device)
        dist.all_reduce(v, group=self.group)
        return window.with_sums(v)

    def stop_agreed(self) -> bool:
        return self._stop


class RemoteTargets:
    """Input source of a disaggregated drafter rank: features arrive from target ranks, the frozen embedding
    and LM head once by broadcast; the local sampler tracks the data position (target ranks resume from it)."""

    target = None

    def __init__(self, config: RunConfig, plan: RankPlan, global_rank: int, device: torch.device, head_group,
                 timeout: timedelta):
        self.config, self.plan, self.global_rank, self.device = config, plan, global_rank, device
        self.head_group, self.timeout = head_group, timeout
        self.dtype = DTYPES[config.target.dtype]

    def open(self, config: RunConfig, layer_ids: list[int], device: torch.device) -> None:
        return None

    def connect(self, trainer: Trainer) -> None:
        c, plan = self.config, self.plan
        setup_barrier.wait()  # the first collective of a disaggregated drafter rank
        _broadcast_object({"step": trainer.step, "total_steps": trainer.total_steps,
                           "sampler": trainer.sampler.state_dict()}, plan.reporter)
        embed, self.head = share_frozen_head(None, self.head_group, plan.target_ranks[0], self.global_rank,
                                             self.device, self.dtype)
        self.embed = nn.Embedding.from_pretrained(embed, freeze=True)
        layout = TransferLayout.for_batches(trainer.sampler, len(trainer.layer_ids) * embed.shape[1], self.dtype)
        schedule = run_schedule(plan, trainer.step, trainer.total_steps, c.optim.grad_accum)
        self.sampler, self.rank = trainer.sampler, trainer.rank
        self.consumer = FeatureConsumer(schedule, trainer.rank, layout, c.topology.max_inflight, self.device,
                                        self.timeout)
        staged = f" ({plan.target_stages} layer stages per target)" if plan.target_stages > 1 else ""
        log.info(f"disaggregated: {len(plan.target_ranks)} target rank(s){staged} feed {len(plan.drafter_ranks)} "
                 f"drafter rank(s); {layout.bytes_per_item() / 2**20:.1f} MiB per micro-batch transfer, "
                 f"{c.topology.max_inflight} in flight per drafter")

    def next(self) -> tuple[int, Batch, torch.Tensor]:
        epoch, batch, features = self.consumer.receive()
        want_epoch, want_len, _ = self.sampler.next()
        if (epoch, batch.input_ids.shape[1]) != (want_epoch, want_len):
            raise RuntimeError(f"drafter rank {self.rank} received a batch of epoch {epoch}, length "
                               f"{batch.input_ids.shape[1]}; its data position says epoch {want_epoch}, length "
                               f"{want_len}: target and drafter ranks disagree on the schedule")
        return epoch, batch, features

    def features(self, batch: Batch) -> torch.Tensor:
        raise RuntimeError("a disaggregated drafter rank holds no target; features arrive with each batch")

    def embed_tokens(self) -> nn.Embedding:
        return self.embed

    def lm_head_weight(self) -> torch.Tensor:
        return self.head

    def finish(self) -> None:
        self.consumer.finish()


def run_drafter_rank(config: RunConfig, plan: RankPlan, rank: int, device: torch.device, source, group) -> dict:
    stop.install(_announce_stop)  # before setup: a SIGTERM while models load must not kill the rank
    trainer = Trainer(config, source, DataParallel(config, plan, rank, device, group), device=device).setup()
    return run_to_end(trainer)


def run_colocated(config: RunConfig, plan: RankPlan, rank: int, device: torch.device) -> dict:
    return run_drafter_rank(config, plan, rank, device, LocalTarget(), group=None)


def run_disaggregated(config: RunConfig, plan: RankPlan, rank: int, device: torch.device) -> dict | None:
    timeout = timedelta(seconds=config.topology.timeout_s)
    # every rank creates every group, in the same order
    drafter_group = dist.new_group(list(plan.drafter_ranks), timeout=timeout)
    head_group = dist.new_group([plan.target_ranks[0], *plan.drafter_ranks], timeout=timeout)
    if plan.is_target(rank):
        return run_target_rank(config, plan, rank, device, head_group, timeout)
    source = RemoteTargets(config, plan, rank, device, head_group, timeout)
    return run_drafter_rank(config, plan, rank, device, source, drafter_group)


# ------------------------------------------------------------------------------------------ target ranks
def run_target_rank(config: RunConfig, plan: RankPlan, rank: int, device: torch.device, head_group,
                    timeout: timedelta) -> None:
    """Every target rank: stage `s` of `target_stages` of one target replica (an unsplit target: 0 of 1).

    Stage 0 cuts the drafters' batches (the same samplers as colocated rank d), the last stage sends the
    tapped states to the drafter ranks; between stages the hidden state travels with the taps so far."""
    stop.hold()  # the drafter ranks decide when to stop (STOP credits)
    c = config
    dtype = DTYPES[c.target.dtype]
    stages = plan.target_stages
    replica, stage = plan.replica_of(rank), plan.stage_of(rank)
    chain = plan.replica_ranks(replica)
    layer_ids = layer_ids_of(c)
    if c.target.float8:  # before any model loads
        check_float8(device, "target.float8", torchao=False)
    inputs = build_run_inputs(c, None, layer_ids, need_data=stage == 0)
    bounds = stage_bounds(layer_ids, stages)
    start, stop_at = bounds[stage]
    # a split target is built on the CPU, then only this stage's layers move to the GPU; a random init is
    # thus the same as an unsplit target's on the CPU, and a checkpoint is read once per stage
    model = build_hf_model(c.target.path, c.target.random_init, c.target.dtype, c.target.attn_implementation,
                           seed=c.seed, device=device if stages == 1 else "cpu")
    part = TargetStage(model, layer_ids, start, stop_at, keep_embedding=stage == 0,
                       keep_head=rank == plan.target_ranks[0]).to(device)
    del model
    require_fast_path(part.fast_path_report(), device, c.target.allow_slow_path)
    if stage == 0:
        check_token_range(inputs.train_set, part.embed_tokens.weight.shape[0])
    compile_plan, _ = configure_for_run(c.compile, c.output_dir, device)
    if c.target.float8:
        target_float8(part)
    if compile_plan.target:
        compile_target_layers(part, compile_plan.target_mode)
    hidden = part.hidden_size
    setup_barrier.wait()  # the first collective of a target rank: every rank's setup is done
    info = _broadcast_object(None, plan.reporter)
    if rank == plan.target_ranks[0]:
        share_frozen_head(part, head_group, rank, rank, device, dtype)
    accum, drafters = c.optim.grad_accum, len(plan.drafter_ranks)
    schedule = run_schedule(plan, info["step"], info["total_steps"], accum)
    mine = [(d, n) for d, n, producer in schedule.items() if producer == chain[-1]]
    inflight = c.topology.max_inflight

    def link_layout(s: int) -> TransferLayout:  # stage s -> s + 1: hidden + the taps of layers < stop_s
        taps = sum(1 for i in layer_ids if i < bounds[s][1])
        return TransferLayout.for_batches(inputs.shape, (1 + taps) * hidden, dtype)

    def link(s: int) -> ItemSchedule:
        return ItemSchedule((chain[s],), (chain[s + 1],), 0, len(mine))

    up = (FeatureConsumer(link(stage - 1), 0, link_layout(stage - 1), inflight, device, timeout)
          if stage > 0 else None)
    last = stage == stages - 1
    if last:
        layout = TransferLayout.for_batches(inputs.shape, len(layer_ids) * hidden, dtype)
        down = FeatureProducer(schedule, rank, layout, inflight, device, timeout)
    else:
        down = FeatureProducer(link(stage), rank, link_layout(stage), inflight, device, timeout)
    if stages == 1:
        log.info(f"{plan.describe(rank)}: producing for {drafters} drafter rank(s) from step {info['step']}",
                 extra=EVERY_RANK)
    else:
        log.info(f"{plan.describe(rank)}: layers {start}..{stop_at - 1} of replica {replica}, {len(mine)} "
                 f"micro-batches from step {info['step']}", extra=EVERY_RANK)

    if stage == 0:
        samplers = [inputs.sampler(d, drafters, info["sampler"]) for d in range(drafters)]

        def items():
            for d, n, producer in schedule.items():  # every item advances drafter d's data position
                epoch, blen, idx = samplers[d].next()
                if producer == chain[-1]:
                    yield d, n, epoch, inputs.batch(blen, idx).to(device), None
    else:
        def items():
            for d, n in mine:
                epoch, batch, features = up.receive()
                yield d, n, epoch, batch, features

    for k, (d, n, epoch, batch, features) in enumerate(items()):
        check_fault(rank, info["step"] + n // accum)
        hidden_in = features[..., :hidden] if features is not None else None
        # computed before the credit arrives: the target works ahead
        out, taps = part.features(batch.input_ids, None, hidden_in)  # right-padded rows need no mask
        earlier = [features[..., hidden:]] if features is not None and features.shape[-1] > hidden else []
        if last:
            payload, item, dst = torch.cat([*earlier, *taps], dim=-1), n, d
        else:
            payload, item, dst = torch.cat([out, *earlier, *taps], dim=-1), k, 0
        if not down.wants(dst, item):
            break
        down.send(dst, item, epoch, batch, payload)
    down.finish()
    if up is not None:
        up.finish()
    log.info(f"{plan.describe(rank)}: sent {down.sent} micro-batches", extra=EVERY_RANK)
