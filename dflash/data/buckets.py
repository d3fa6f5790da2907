"""Length buckets, token-budget batches, and a resumable sampler that visits buckets round-robin."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dflash.devices import to_device


def bucket_length(length: int, bucket_size: int, max_length: int) -> int:
    return min(max_length, math.ceil(length / bucket_size) * bucket_size)


@dataclass(frozen=True)
class BatchShape:
    """The batching rule (data.token_budget, data.bucket_size, data.max_length): a sequence goes to the bucket
    of its length rounded up to bucket_size, and a batch of that bucket holds token_budget // length rows.
    The sampler cuts batches by it and the transfer buffers are sized by its bounds (`max_rows`, `max_tokens`)."""

    token_budget: int
    bucket_size: int
    max_length: int

    @classmethod
    def of(cls, data) -> BatchShape:
        """From the run config's `data` section."""
        return cls(data.token_budget, data.bucket_size, data.max_length)

    def bucket_length(self, length: int) -> int:
        return bucket_length(length, self.bucket_size, self.max_length)

    def rows(self, bucket_len: int) -> int:
        return max(1, self.token_budget // bucket_len)

    def padding_share(self, lengths: list[int]) -> float:
        """The share of the padded positions (each sequence rounded up to its bucket) that are padding: work
        the target's forward does for nothing (a smaller bucket_size lowers it, at one compiled shape more
        per bucket)."""
        padded = sum(self.bucket_length(n) for n in lengths)
        return 1.0 - sum(min(n, self.max_length) for n in lengths) / padded if padded else 0.0

    @property
    def max_rows(self) -> int:
        """Rows of the largest batch: that of the shortest bucket."""
        return self.rows(min(self.bucket_size, self.max_length))

    @property
    def max_tokens(self) -> int:
        """Padded tokens of the largest batch (one row of max_length may exceed the budget)."""
        return max(self.token_budget, self.max_length)


@dataclass
class Batch:
    input_ids: torch.Tensor  # (b, L) padded to the bucket length
    loss_mask: torch.Tensor  # (b, L) bool
    attention_mask: torch.Tensor  # (b, L) long
    lengths: torch.Tensor  # (b,)
    indices: list[int]
    host: Batch | None = field(default=None, repr=False, compare=False)  # the batch in host memory, if moved

    @property
    def on_host(self) -> Batch:
        """This batch in host memory (what anchors, blocks and counts are computed from, with no device sync)."""
        if self.host is not None:
            return self.host
        if self.input_ids.device.type == "cpu":
            return self
        return Batch(self.input_ids.cpu(), self.loss_mask.cpu(), self.attention_mask.cpu(), self.lengths.cpu(),
                     self.indices)

    @property
    def num_tokens(self) -> int:
        return int((self.host if self.host is not None else self).lengths.sum())

    def to(self, device) -> Batch:
        """On `device`, keeping the host copy; a GPU gets it asynchronously (pinned memory)."""
        return Batch(to_device(self.input_ids, device), to_device(self.loss_mask, device),
                     to_device(self.attention_mask, device), to_device(self.lengths, device), self.indices,
                     host=self.on_host)


class RoundRobinBatchSampler:
    """Each epoch: shuffle inside every bucket, cut batches of `token_budget // bucket_length` sequences,
    then emit one batch per bucket in turn, so rare lengths are not starved by a random pool draw.

    Deterministic in (seed, epoch), so the data position (epoch, index) is all that resume needs.
    With `world_size > 1` each rank takes every world_size-th batch (equal counts across ranks).
    `multiple_of` (gradient accumulation) trims each rank's epoch to whole optimizer steps, so a step never
    straddles two epochs and any split of a global batch over ranks and micro-batches reads the same data.
    """

    def __init__(self, lengths: list[int], shape: BatchShape, seed: int = 0, rank: int = 0, world_size: int = 1,
                 multiple_of: int = 1):
        self.shape = shape
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        self.multiple_of = multiple_of
        self.buckets: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            self.buckets.setdefault(shape.bucket_length(n), []).append(i)
        self.epoch = 0
        self.index = 0  # batches of this epoch already consumed by this rank
        self._cache: tuple[int, list[tuple[int, list[int]]]] | None = None

    @property
    def max_rows(self) -> int:
        return self.shape.max_rows

    @property
    def max_tokens(self) -> int:
        return self.shape.max_tokens

    def epoch_batches(self, epoch: int) -> list[tuple[int, list[int]]]:
        """[(bucket_length, indices)] for this rank, in visiting order."""
        if self._cache and self._cache[0] == epoch:
            return self._cache[1]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        queues = []
        for blen in sorted(self.buckets):
            members = self.buckets[blen]
            perm = [members[j] for j in torch.randperm(len(members), generator=g).tolist()]
            bs = self.shape.rows(blen)
            queues.append([(blen, perm[i:i + bs]) for i in range(0, len(perm), bs)])
        order = []
        while any(queues):
            for q in queues:
                if q:
                    order.append(q.pop(0))
        per_rank = len(order) // self.world_size // self.multiple_of * self.multiple_of
        mine = order[self.rank::self.world_size][:per_rank]
        self._cache = (epoch, mine)
        return mine

    def batches_per_epoch(self) -> int:
        return len(self.epoch_batches(self.epoch))

    def next(self) -> tuple[int, int, list[int]]:
        """(epoch, bucket_length, indices) of the next batch; advances the position."""
        batches = self.epoch_batches(self.epoch)
        if self.index >= len(batches):
            self.epoch += 1
            self.index = 0
            batches = self.epoch_batches(self.epoch)
            if not batches:
                raise RuntimeError("the dataset yields no batch for this rank; add data or lower the rank count")
        blen, idx = batches[self.index]
        self.index += 1
        return self.epoch, blen, idx

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.seed = int(state.get("seed", self.seed))
        self._cache = None


def collate(samples: list[tuple[torch.Tensor, torch.Tensor]], indices: list[int], length: int,
            pad_id: int) -> Batch:
    b = len(indices)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    mask = torch.zeros((b, length), dtype=torch.bool)
    attn = torch.zeros((b, length), dtype=torch.long)
    lengths = torch.zeros(b, dtype=torch.long)
    for row, i in enumerate(indices):
        sid, smask = samples[i]
        n = min(sid.numel(), length)
        ids[row, :n] = sid[:n]
        mask[row, :n] = smask[:n]
        attn[row, :n] = 1
        lengths[row] = n
    return Batch(ids, mask, attn, lengths, list(indices))
