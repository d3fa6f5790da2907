"""Target ranks -> drafter ranks: tapped hidden states over point-to-point transfers (disaggregated mode).

Every micro-batch travels as three fixed-size messages into preallocated buffers, so the receiver posts its
receives before the sender has produced anything and no shape ever changes:

* meta (int64, META + max_rows): rows, padded length, epoch, sequence number, then the row lengths;
* tokens (int64, 2 x token_budget): input ids and loss mask, flattened (rows x length) and zero-padded;
* features (token_budget x n_tapped*hidden, target dtype): the concatenated tapped hidden states.

Flow control is credit based. A drafter rank keeps `max_inflight` receive slots; the producer of its item n
may send without asking only for n < max_inflight, and after that waits for the drafter's credit for n,
which the drafter sends once item n - max_inflight is consumed and its slot re-posted. The producer
computes item n before it waits for that credit, so the target works one item ahead of the drafter's
slots. A credit of 0 means "stop": every drafter rank sends one to every target rank when it finishes
(normally or on SIGTERM), so a target rank never waits on a drafter that has gone. A slow drafter therefore blocks its producers instead of
growing memory, and every wait has the topology timeout.

Item order: drafter rank d consumes its items n = 0, 1, ... (optim.grad_accum per step). The global index of
item n of rank d is g = (first_item + n) * D + d; target rank g % T produces it. Every drafter rank is thus fed
by every producer in turn, and the data is exactly what colocated rank d would have read itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash.data.buckets import Batch, BatchShape

META = 4
TAG_META, TAG_TOKENS, TAG_FEATURES, TAG_CREDIT = 11, 12, 13, 14
GO, STOP = 1, 0


@dataclass(frozen=True)
class TransferLayout:
    max_rows: int
    max_tokens: int
    feature_dim: int
    feature_dtype: torch.dtype

    @classmethod
    def for_batches(cls, shape: BatchShape, feature_dim: int, feature_dtype: torch.dtype) -> TransferLayout:
        """Buffers for the largest batch the sampler cuts (the batching rule's bounds)."""
        return cls(shape.max_rows, shape.max_tokens, feature_dim, feature_dtype)

    def bytes_per_item(self) -> int:
        fsize = torch.empty((), dtype=self.feature_dtype).element_size()
        return 8 * (META + self.max_rows + 2 * self.max_tokens) + fsize * self.max_tokens * self.feature_dim


@dataclass
class Slot:
    """Preallocated buffers of one micro-batch in flight, and the transfers that still use them."""

    meta: torch.Tensor
    tokens: torch.Tensor
    features: torch.Tensor
    works: list = field(default_factory=list)

    @classmethod
    def allocate(cls, layout: TransferLayout, device: torch.device) -> Slot:
        return cls(torch.zeros(META + layout.max_rows, dtype=torch.long, device=device),
                   torch.zeros(2, layout.max_tokens, dtype=torch.long, device=device),
                   torch.zeros(layout.max_tokens, layout.feature_dim, dtype=layout.feature_dtype, device=device))

    def wait(self, timeout: timedelta) -> None:
        for work in self.works:
            work.wait(timeout)
        self.works = []

    def pack(self, epoch: int, seq: int, batch: Batch, features: torch.Tensor) -> None:
        rows, length = batch.input_ids.shape
        n = rows * length
        if rows > self.meta.numel() - META or n > self.tokens.shape[1]:
            raise RuntimeError(f"batch of {rows} x {length} exceeds the transfer buffers "
                               f"({self.meta.numel() - META} rows, {self.tokens.shape[1]} tokens)")
        self.meta.zero_()
        self.meta[:META] = torch.tensor([rows, length, epoch, seq])
        self.meta[META:META + rows] = batch.lengths
        self.tokens.zero_()
        self.tokens[0, :n] = batch.input_ids.reshape(-1)
        self.tokens[1, :n] = batch.loss_mask.reshape(-1).long()
        self.features[:n] = features.reshape(n, -1)

    def unpack(self) -> tuple[int, int, Batch, torch.Tensor]:
        """(epoch, sequence number, batch, features); the tensors are views of this slot's buffers."""
        rows, length, epoch, seq = (int(x) for x in self.meta[:META].tolist())
        n = rows * length
        lengths = self.meta[META:META + rows].clone()
        input_ids = self.tokens[0, :n].view(rows, length)
        loss_mask = self.tokens[1, :n].view(rows, length).bool()
        attention_mask = (torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]).long()
        batch = Batch(input_ids, loss_mask, attention_mask, lengths, [])
        return epoch, seq, batch, self.features[:n].view(rows, length, -1)

    def isend(self, dst: int) -> None:
        self.works = [dist.isend(self.meta, dst, tag=TAG_META), dist.isend(self.tokens, dst, tag=TAG_TOKENS),
                      dist.isend(self.features, dst, tag=TAG_FEATURES)]

    def irecv(self, src: int) -> None:
        self.works = [dist.irecv(self.meta, src, tag=TAG_META), dist.irecv(self.tokens, src, tag=TAG_TOKENS),
                      dist.irecv(self.features, src, tag=TAG_FEATURES)]


@dataclass(frozen=True)
class ItemSchedule:
    """Who produces which item: shared by both sides so that every send has its receive."""

    target_ranks: tuple[int, ...]
    drafter_ranks: tuple[int, ...]
    first_item: int  # items consumed per drafter rank before this run (start step x grad_accum)
    num_items: int  # items each drafter rank consumes in this run

    def items(self):
        """(drafter index, item n, producing rank) for every item, in the global order all ranks share."""
        for n in range(self.num_items):
            for d in range(len(self.drafter_ranks)):
                yield d, n, self.producer(d, n)

    def producer(self, drafter_index: int, n: int) -> int:
        g = (self.first_item + n) * len(self.drafter_ranks) + drafter_index
        return self.target_ranks[g % len(self.target_ranks)]


def _credit(value: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.long, device=device)


class FeatureConsumer:
    """Drafter side: `receive()` returns the next micro-batch; `finish()` stops every producer."""

    def __init__(self, schedule: ItemSchedule, drafter_index: int, layout: TransferLayout, max_inflight: int,
                 device: torch.device, timeout: timedelta):
        self.schedule, self.d = schedule, drafter_index
        self.inflight, self.device, self.timeout = max_inflight, device, timeout
        self.slots = [Slot.allocate(layout, device) for _ in range(max_inflight)]
        self.credit_works: list[tuple[int, object]] = []  # (item, send of its credit)
        self.next_item = 0
        self.held: int | None = None  # item whose buffers the drafter is still using
        # Credits go out from an idle side stream: NCCL orders an operation after the work already queued on
        # the current stream, and on the compute stream a credit would wait for the previous step's backward
        # (measured on two H200s: the target rank then idled and the drafter waited 36% of its time).
        self.go = _credit(GO, device)
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream(device))  # self.go is written
        for n in range(min(max_inflight, schedule.num_items)):
            self.slots[n].irecv(schedule.producer(self.d, n))

    def _release(self, n: int) -> None:
        """Item n is consumed: its slot takes item n + max_inflight, whose producer gets a credit first."""
        later = n + self.inflight
        if later >= self.schedule.num_items:
            return
        src = self.schedule.producer(self.d, later)
        # credit before the receive: NCCL runs a pair's operations in issue order, and the producer sends
        # item `later` only after this credit arrives
        with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
            self.credit_works.append((later, dist.isend(self.go, src, tag=TAG_CREDIT)))
        self.slots[later % self.inflight].irecv(src)

    def receive(self) -> tuple[int, Batch, torch.Tensor]:
        if self.held is not None:
            self._release(self.held)
        n = self.next_item
        if n >= self.schedule.num_items:
            raise RuntimeError(f"drafter rank {self.d} asked for item {n} of {self.schedule.num_items}")
        slot = self.slots[n % self.inflight]
        slot.wait(self.timeout)
        epoch, seq, batch, features = slot.unpack()
        if seq != self.schedule.first_item + n:
            raise RuntimeError(f"drafter rank {self.d} expected item {self.schedule.first_item + n}, got {seq}")
        self.held, self.next_item = n, n + 1
        # credits for items up to n were matched before those items were sent: complete them
        for item, work in self.credit_works:
            if item <= n:
                work.wait(self.timeout)
        self.credit_works = [(item, work) for item, work in self.credit_works if item > n]
        return epoch, batch, features

    def finish(self) -> None:
        """Called once after the last step: drain what producers already sent, then tell each to stop."""
        for slot in self.slots:
            slot.wait(self.timeout)
        works = [dist.isend(_credit(STOP, self.device), t, tag=TAG_CREDIT) for t in self.schedule.target_ranks]
        for work in [*(w for _, w in self.credit_works), *works]:
            work.wait(self.timeout)
        self.credit_works = []


class FeatureProducer:
    """Target side: produce this rank's items in order, honouring credits, until every drafter says stop."""

    def __init__(self, schedule: ItemSchedule, target_rank: int, layout: TransferLayout, max_inflight: int,
                 device: torch.device, timeout: timedelta):
        self.schedule, self.rank = schedule, target_rank
        self.inflight, self.device, self.timeout = max_inflight, device, timeout
        self.layout = layout
        self.slots: dict[int, list[Slot]] = {}
        self.stopped: set[int] = set()  # drafter indices that sent STOP
        self.sent = 0

    def _slot(self, d: int, n: int) -> Slot:
        ring = self.slots.setdefault(d, [])
        if not ring:
            ring.extend(Slot.allocate(self.layout, self.device) for _ in range(self.inflight))
        return ring[n % self.inflight]

    def _recv_credit(self, d: int) -> int:
        buf = _credit(-1, self.device)
        dist.irecv(buf, self.schedule.drafter_ranks[d], tag=TAG_CREDIT).wait(self.timeout)
        value = int(buf.item())
        if value == STOP:
            self.stopped.add(d)
        return value

    def wants(self, d: int, n: int) -> bool:
        """Before sending item n of drafter d (already computed, so that the target runs one item ahead of
        the credits): False when the drafters have stopped."""
        if self.stopped:
            return False
        if n >= self.inflight:
            return self._recv_credit(d) == GO
        return True

    def send(self, d: int, n: int, epoch: int, batch: Batch, features: torch.Tensor) -> None:
        slot = self._slot(d, n)
        slot.wait(self.timeout)  # its previous item is delivered
        slot.pack(epoch, self.schedule.first_item + n, batch, features)
        slot.isend(self.schedule.drafter_ranks[d])
        self.sent += 1

    def finish(self) -> None:
        for ring in self.slots.values():
            for slot in ring:
                slot.wait(self.timeout)
        for d in range(len(self.schedule.drafter_ranks)):
            while d not in self.stopped:
                self._recv_credit(d)
