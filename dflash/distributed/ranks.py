"""What one torchrun worker runs: a data-parallel drafter rank (colocated or disaggregated) or a target rank.

Stopping: a signal only marks the rank; the ranks agree to stop in the per-step all-reduce of the drafter
group, so all of them leave the loop after the same step and the reporter checkpoints it. Target ranks
ignore signals and stop when the drafter ranks send STOP (transfer.py).
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dflash.config import RunConfig
from dflash.data.buckets import RoundRobinBatchSampler, collate
from dflash.distributed.topology import RankPlan
from dflash.distributed.transfer import FeatureConsumer, FeatureProducer, ItemSchedule, TransferLayout
from dflash.errors import BadInput
from dflash.models.target import DTYPES
from dflash.train import Trainer

FAULT_ENV = "DFLASH_FAULT_INJECT"


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
        print(f"rank {rank}: hanging after {step} steps ({FAULT_ENV}={spec})", flush=True)
        while True:
            time.sleep(3600)
    raise InjectedFault(f"injected fault ({FAULT_ENV}={spec}) on rank {rank} after {step} steps")


class DataParallelTrainer(Trainer):
    """A drafter rank: DDP over the drafter group, global loss normaliser, metrics and stop flag reduced."""

    def __init__(self, config: RunConfig, plan: RankPlan, global_rank: int, device: torch.device, group):
        super().__init__(config, rank=plan.drafter_index(global_rank), world_size=len(plan.drafter_ranks),
                         is_reporter=global_rank == plan.reporter, device=device)
        self.global_rank, self.plan, self.group = global_rank, plan, group
        self.signal_seen = False

    def wrap(self) -> None:
        """After setup (and resume): check every rank resumed the same step, then wrap the drafter in DDP."""
        steps = torch.tensor([self.step, -self.step], dtype=torch.long, device=self.device)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=self.group)
        if int(steps[0]) != -int(steps[1]):
            raise BadInput(f"drafter ranks resumed different steps ({-int(steps[1])}..{int(steps[0])}); every "
                           f"node must see the reporter's checkpoints: put output_dir ({self.config.output_dir}) "
                           "on a filesystem shared by all nodes")
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp_model = DistributedDataParallel(self.drafter, device_ids=ids, process_group=self.group)

    def install_signal_handlers(self) -> None:
        def mark(signum, _frame):
            if not self.signal_seen and self.is_reporter:
                print(f"received signal {signum}: all ranks stop and checkpoint after the current step", flush=True)
            self.signal_seen = True

        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.signal(signum, mark)
            self.signal_seen = self.signal_seen or getattr(previous, "seen", False)  # launch.SignalLatch

    def train_step(self):
        check_fault(self.global_rank, self.step)
        return super().train_step()

    def reduce_step(self, totals: torch.Tensor) -> torch.Tensor:
        flag = torch.tensor([1.0 if self.signal_seen else 0.0], dtype=torch.float64)
        v = torch.cat([totals, flag]).to(self.device)
        dist.all_reduce(v, group=self.group)
        if float(v[2]) > 0:
            self.stop_requested = True
        return v[:2].cpu()

    def reduce_stats(self, loss_sum, n, tokens, stats):
        head = torch.tensor([loss_sum, n, tokens], dtype=torch.float64, device=self.device)
        v = torch.cat([head, stats.to_vector().to(self.device, torch.float64)])
        dist.all_reduce(v, group=self.group)
        return float(v[0]), int(v[1]), int(v[2]), type(stats).from_vector(v[3:].float())

    def _report_eval(self):
        return super()._report_eval() if self.is_reporter else None  # evaluation needs no other rank


class DrafterRankTrainer(DataParallelTrainer):
    """Disaggregated drafter rank: no target; features arrive from target ranks, embedding/head by broadcast."""

    consumer: FeatureConsumer

    def use_frozen_head(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        self._embed = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self._lm_head = lm_head_weight

    def next_input(self):
        epoch, batch, features = self.consumer.receive()
        # the local sampler tracks the data position for checkpoints (target ranks resume from it)
        want_epoch, want_len, _ = self.sampler.next()
        if (epoch, batch.input_ids.shape[1]) != (want_epoch, want_len):
            raise RuntimeError(f"drafter rank {self.rank} received a batch of epoch {epoch}, length "
                               f"{batch.input_ids.shape[1]}; its data position says epoch {want_epoch}, length "
                               f"{want_len}: target and drafter ranks disagree on the schedule")
        return epoch, batch, features

    def embed_tokens(self) -> nn.Embedding:
        return self._embed

    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head

    def _report_eval(self):
        if self.is_reporter and self.eval_set is not None:
            self.observer.event("eval skipped: disaggregated drafter ranks hold no target "
                                "(evaluate the exported drafter with `dflash export` and a serving engine)")
        return None


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


def run_colocated(config: RunConfig, plan: RankPlan, rank: int, device: torch.device) -> dict:
    trainer = DataParallelTrainer(config, plan, rank, device, group=None)
    trainer.install_signal_handlers()  # before setup: a SIGTERM while models load must not kill the rank
    trainer.setup()
    trainer.wrap()
    return _run_reporting_failure(trainer)


def _run_reporting_failure(trainer: Trainer, then=None) -> dict:
    """trainer.run(), then `then()`; the reporter's heartbeat says 'failed' if either raises."""
    try:
        result = trainer.run()
        if then is not None:
            then()
        return result
    except BaseException:
        trainer.observer.heartbeat(trainer.step, trainer.sampler.epoch, "failed")
        raise


def run_disaggregated(config: RunConfig, plan: RankPlan, rank: int, device: torch.device) -> dict | None:
    timeout = timedelta(seconds=config.topology.timeout_s)
    # every rank creates every group, in the same order
    drafter_group = dist.new_group(list(plan.drafter_ranks), timeout=timeout)
    head_group = dist.new_group([plan.target_ranks[0], *plan.drafter_ranks], timeout=timeout)
    dtype = DTYPES[config.target.dtype]
    if plan.is_target(rank):
        if plan.target_stages > 1:
            from dflash.distributed.stages import run_target_stage

            return run_target_stage(config, plan, rank, device, head_group, dtype, timeout)
        return run_target_rank(config, plan, rank, device, head_group, dtype, timeout)
    trainer = DrafterRankTrainer(config, plan, rank, device, drafter_group)
    trainer.install_signal_handlers()
    trainer.setup(with_target=False)
    _broadcast_object({"step": trainer.step, "total_steps": trainer.total_steps,
                       "sampler": trainer.sampler.state_dict()}, plan.reporter)
    embed, head = share_frozen_head(None, head_group, plan.target_ranks[0], rank, device, dtype)
    trainer.use_frozen_head(embed, head)
    layout = TransferLayout.for_config(config.data.token_budget, config.data.bucket_size, config.data.max_length,
                                       len(trainer.layer_ids) * embed.shape[1], dtype)
    accum = config.optim.grad_accum
    schedule = ItemSchedule(plan.producers, plan.drafter_ranks, trainer.step * accum,
                            (trainer.total_steps - trainer.step) * accum)
    trainer.consumer = FeatureConsumer(schedule, trainer.rank, layout, config.topology.max_inflight, device, timeout)
    trainer.wrap()
    if trainer.is_reporter:
        staged = f" ({plan.target_stages} layer stages per target)" if plan.target_stages > 1 else ""
        trainer.observer.event(f"disaggregated: {len(plan.target_ranks)} target rank(s){staged} feed "
                               f"{len(plan.drafter_ranks)} drafter rank(s); {layout.bytes_per_item() / 2**20:.1f} "
                               f"MiB per micro-batch transfer, {config.topology.max_inflight} in flight per drafter")
    return _run_reporting_failure(trainer, then=trainer.consumer.finish)


def drafter_samplers(config: RunConfig, train_set, drafters: int, state: dict) -> list[RoundRobinBatchSampler]:
    """For a target rank: the data position of every drafter rank (what colocated rank d would read)."""
    c = config
    samplers = []
    for d in range(drafters):
        s = RoundRobinBatchSampler(train_set.lengths(), c.data.token_budget, c.data.bucket_size, c.data.max_length,
                                   seed=c.seed, rank=d, world_size=drafters, multiple_of=c.optim.grad_accum)
        s.load_state_dict(state)
        samplers.append(s)
    return samplers


def run_target_rank(config: RunConfig, plan: RankPlan, rank: int, device: torch.device, head_group,
                    dtype: torch.dtype, timeout: timedelta) -> None:
    # the drafter ranks decide when to stop and tell this rank (STOP credits)
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    trainer = Trainer(config, is_reporter=False, device=device).setup(with_drafter=False)
    info = _broadcast_object(None, plan.reporter)
    if rank == plan.target_ranks[0]:
        share_frozen_head(trainer.target, head_group, rank, rank, device, dtype)
    c, drafters = config, len(plan.drafter_ranks)
    samplers = drafter_samplers(c, trainer.train_set, drafters, info["sampler"])
    accum = c.optim.grad_accum
    schedule = ItemSchedule(plan.producers, plan.drafter_ranks, info["step"] * accum,
                            (info["total_steps"] - info["step"]) * accum)
    layout = TransferLayout.for_config(c.data.token_budget, c.data.bucket_size, c.data.max_length,
                                       len(trainer.layer_ids) * trainer.target.hidden_size, dtype)
    producer = FeatureProducer(schedule, rank, layout, c.topology.max_inflight, device, timeout)
    pad = trainer.tokenizer.pad_token_id or 0
    print(f"{plan.describe(rank)}: producing for {drafters} drafter rank(s) from step {info['step']}", flush=True)
    for d, n, producer_rank in schedule.items():  # every item advances drafter d's data position
        epoch, blen, idx = samplers[d].next()
        if producer_rank != rank:
            continue
        if producer.stopped:
            break
        check_fault(rank, info["step"] + n // accum)
        batch = collate(trainer.train_set.samples, idx, blen, pad).to(device)
        features = trainer.features(batch)  # computed before the credit arrives: the target works ahead
        if not producer.wants(d, n):
            break
        producer.send(d, n, epoch, batch, features)
    producer.finish()
    print(f"{plan.describe(rank)}: sent {producer.sent} micro-batches", flush=True)
    return None
