"""Anchors, blocks, labels, the decayed cross-entropy and the acceptance metrics (DESIGN §2)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash.devices import to_device


@dataclass
class Blocks:
    """Training blocks of one batch; m = number of anchor slots per sequence (fixed shape)."""

    anchors: torch.Tensor  # (b, m) long: anchor positions (0 for empty slots)
    anchor_valid: torch.Tensor  # (b, m) bool
    block_ids: torch.Tensor  # (b, m, B): [x_a, MASK, ...]
    labels: torch.Tensor  # (b, m, B-1): x_{a+k}, k = 1..B-1
    label_valid: torch.Tensor  # (b, m, B-1) bool: inside the sequence and in the loss mask
    rows: torch.Tensor | None = None  # (N,) flat indices of the valid labels, found on the host by `to`
    row_mask: torch.Tensor | None = None  # (N,) float: 0 for padding rows (dflash/training/step_graph.py), else None

    def row_index(self) -> torch.Tensor:
        """Flat indices of the valid labels in (b, m, B-1), in order: the loss rows. Blocks moved by `to` carry
        them from the host (their count is known there: no device sync); otherwise found now."""
        if self.rows is not None:
            return self.rows
        return torch.nonzero(self.label_valid.flatten(), as_tuple=False).flatten()

    @property
    def num_rows(self) -> int:
        return int(self.row_index().numel())

    def to(self, device) -> Blocks:
        """The blocks on `device` with their loss rows; a GPU gets them through pinned memory, without waiting."""
        return Blocks(*(to_device(t, device) for t in (self.anchors, self.anchor_valid, self.block_ids,
                                                        self.labels, self.label_valid, self.row_index())))


def valid_anchor_positions(loss_mask: torch.Tensor, length: int) -> torch.Tensor:
    """Positions a whose first label x_{a+1} is a loss (assistant) token. loss_mask: (T,) bool."""
    if length < 2:
        return torch.empty(0, dtype=torch.long)
    return torch.nonzero(loss_mask[1:length], as_tuple=False).flatten()  # index i means a = i


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, num_anchors: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` anchors per sequence, without replacement, sorted; padded slots invalid."""
    b = loss_mask.shape[0]
    anchors = torch.zeros(b, num_anchors, dtype=torch.long)
    valid = torch.zeros(b, num_anchors, dtype=torch.bool)
    for i in range(b):
        candidates = valid_anchor_positions(loss_mask[i].cpu(), int(lengths[i]))
        if candidates.numel() == 0:
            continue
        take = min(num_anchors, candidates.numel())
        pick = candidates[torch.randperm(candidates.numel(), generator=generator)[:take]]
        anchors[i, :take] = pick.sort().values
        valid[i, :take] = True
    return anchors, valid


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
                 anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int,
                 mask_token_id: int) -> Blocks:
    """Block j = [x_{a_j}, MASK*(B-1)]; label k (1..B-1) = x_{a_j+k}, valid iff inside and in the loss mask."""
    b, t = input_ids.shape
    device = input_ids.device
    anchors = anchors.to(device)
    anchor_valid = anchor_valid.to(device)
    offsets = torch.arange(1, block_size, device=device)
    pos = anchors[:, :, None] + offsets  # (b, m, B-1)
    inside = pos < lengths.to(device)[:, None, None]
    pos_c = pos.clamp(max=t - 1)
    labels = torch.gather(input_ids[:, None, :].expand(-1, anchors.shape[1], -1), 2, pos_c)
    in_loss = torch.gather(loss_mask.to(device)[:, None, :].expand(-1, anchors.shape[1], -1), 2, pos_c)
    label_valid = inside & in_loss.bool() & anchor_valid[:, :, None]
    first = torch.gather(input_ids, 1, anchors)
    block_ids = torch.full((b, anchors.shape[1], block_size), mask_token_id, dtype=input_ids.dtype, device=device)
    block_ids[:, :, 0] = first
    return Blocks(anchors, anchor_valid, block_ids, labels, label_valid)


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..B-1."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def _ce_chunk(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor):
    logits = (hidden @ weight.t()).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * w).sum(), logits.argmax(-1) == labels


def ce_rows(logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor):
    """One chunk of the fused loss: (sum_i w_i * CE_i, argmax hits, (softmax - onehot) * w).

    The softmax runs in fp32 whatever the logits' dtype; the logits' gradient comes back in their dtype.
    Written as plain tensor algebra so that `torch.compile` makes it two passes over the logits (one
    reduction, one pointwise) instead of the ~10 full-size passes and fp32 temporaries of eager mode.
    """
    x, lse, picked, total, hits, onehot = _softmax_rows(logits, labels, w)
    grad = (torch.exp(x - lse[:, None]) - onehot.float()) * w[:, None].float()
    return total, hits, grad.to(logits.dtype)


def _softmax_rows(logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor):
    """What both loss kernels read off a chunk's logits: (fp32 logits, logsumexp, the labels' logits, the
    weighted CE sum, argmax hits, the labels' one-hot mask)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, labels[:, None]).squeeze(1)
    total = ((lse - picked) * w).sum()
    hits = x.argmax(-1) == labels
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]
    return x, lse, picked, total, hits, onehot


# where the gradient's largest magnitude lands in float8 e5m2: half its largest value, a margin for rounding
GRAD_FLOAT8_TOP = torch.finfo(torch.float8_e5m2).max / 2


def ce_rows_float8(logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor):
    """`ce_rows` with the logits' gradient in float8 e5m2 and one fp32 scale per row, for the rows' gradient
    matmul in float8 (`drafter.float8_head`): (total, hits, grad8, scale), grad ~= grad8 * scale.

    A row's largest gradient magnitude is known without another pass: |p_j - onehot_j| * w is largest at the
    label, (1 - p_label) * w, since the other probabilities sum to 1 - p_label. So the cast fuses into the
    gradient's own pass; 1 - p_label comes from expm1, exact where p_label is near 1."""
    x, lse, picked, total, hits, onehot = _softmax_rows(logits, labels, w)
    top = (-torch.expm1(picked - lse)) * w.float().abs()
    scale = (top / GRAD_FLOAT8_TOP).clamp(min=1e-30)[:, None]
    grad = (torch.exp(x - lse[:, None]) - onehot.float()) * (w.float()[:, None] / scale)
    grad8 = grad.clamp(-2 * GRAD_FLOAT8_TOP, 2 * GRAD_FLOAT8_TOP).to(torch.float8_e5m2)
    return total, hits, grad8, scale


_COMPILED_CE_ROWS: dict[bool, object] = {}


def ce_rows_kernel(device: torch.device, float8: bool = False):
    """`ce_rows` (or `ce_rows_float8`) compiled once per process when the compile plan says so (`compile.loss`;
    default: on CUDA), guarded by the eager fallback; eager otherwise."""
    from dflash.compile import EagerFallback, active

    eager = ce_rows_float8 if float8 else ce_rows
    if not active(device).loss:
        return eager
    if float8 not in _COMPILED_CE_ROWS:
        _COMPILED_CE_ROWS[float8] = EagerFallback("loss", compile_ce_rows(eager), eager)
    return _COMPILED_CE_ROWS[float8]


def compile_ce_rows(fn=ce_rows, **compile_kwargs):
    """`fn` (`ce_rows`) compiled with the row count symbolic: one graph for every chunk length (the last chunk
    of a batch has as many rows as the batch has leftover labels, different at every step)."""
    compiled = torch.compile(fn, **compile_kwargs)

    def run(logits, labels, w):
        for t in (logits, labels, w):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(logits, labels, w)
    return run


class _FusedHeadCE(torch.autograd.Function):
    """sum_i w_i * CE(rows_i @ W^T, label_i), with d/d rows computed in the forward, chunk by chunk.

    The LM head is frozen, so only the rows need a gradient: (softmax - onehot) * w @ W. Computing it while
    the chunk's logits exist saves the logits recompute of the checkpointed path: 2 head-sized matmuls per
    row instead of 3. Backward only scales the saved gradient. Returns (total, hits). With `float8`, both
    matmuls run in float8 (dflash.components.float8.Float8Head); the softmax and the loss stay in fp32.
    """

    @staticmethod
    def forward(ctx, rows, weight, labels, w, chunk_size: int, compute_dtype: torch.dtype, float8: bool = False):
        grad = torch.empty_like(rows)
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        hits = torch.empty(rows.shape[0], dtype=torch.bool, device=rows.device)
        kernel = ce_rows_kernel(rows.device, float8)
        if float8:
            from dflash.components.float8 import float8_head

            head8 = float8_head(weight)
        else:
            head = weight.to(compute_dtype)
        for start in range(0, rows.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            chunk = rows[sl].to(compute_dtype)
            if float8:
                part, hits[sl], grad8, scale = kernel(head8.logits(chunk, compute_dtype), labels[sl], w[sl])
                grad[sl] = head8.rows_grad(grad8, scale, compute_dtype).to(grad.dtype)
            else:
                part, hits[sl], grad_logits = kernel(chunk @ head.t(), labels[sl], w[sl])
                grad[sl] = (grad_logits @ head).to(grad.dtype)
            total += part
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, grad_total, _grad_hits):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None, None


LOSS_IMPLS = ("checkpoint", "fused")


def weighted_block_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, blocks: Blocks, gamma: float,
                        chunk_size: int = 4096, impl: str = "fused", float8_head: bool = False):
    """Decayed CE over valid positions, divided by the sum of their weights; logits built in chunks.

    hidden: (b, m, B, H) drafter outputs. Returns (loss, correct (b, m, B-1) bool).
    Full-vocabulary logits for all block positions never exist at once. impl="checkpoint": each chunk's
    logits are recomputed in backward; impl="fused": the gradient of the rows is computed in the forward
    while the chunk's logits exist (no recompute; the head is frozen). `float8_head`: the fused path's two
    head matmuls in float8 when training (an evaluation's logits stay in the run's precision).
    """
    if impl not in LOSS_IMPLS:
        raise ValueError(f"loss impl {impl!r}: expected one of {LOSS_IMPLS}")
    b, m, bs, h = hidden.shape
    pred = hidden[:, :, 1:, :]  # positions 1..B-1 predict x_{a+k}
    valid = blocks.label_valid
    w_pos = position_weights(bs, gamma, hidden.device)
    index = blocks.row_index()  # the valid labels' flat indices: their count is known on the host, no sync
    rows = pred.reshape(-1, h).index_select(0, index)  # (N, H)
    labels = blocks.labels.flatten().index_select(0, index)
    w = w_pos.expand(b, m, -1).flatten().index_select(0, index)
    if blocks.row_mask is not None:  # rows padded to a fixed count (a CUDA graph's shape): the pads weigh 0
        w = w * blocks.row_mask
    correct = torch.zeros_like(valid)
    if index.numel() == 0:
        return hidden.sum() * 0.0, correct
    if impl == "fused" and torch.is_grad_enabled() and rows.requires_grad:
        device_type = rows.device.type
        compute_dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                         else rows.dtype)
        total, hit = _FusedHeadCE.apply(rows, lm_head_weight, labels, w, chunk_size, compute_dtype, float8_head)
        correct.view(-1).index_copy_(0, index, hit)
        return total / w.sum(), correct
    total = rows.new_zeros((), dtype=torch.float32)
    hits = []
    for start in range(0, rows.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        if torch.is_grad_enabled() and rows.requires_grad:
            part, hit = checkpoint(_ce_chunk, rows[sl], lm_head_weight, labels[sl], w[sl], use_reentrant=False)
        else:
            part, hit = _ce_chunk(rows[sl], lm_head_weight, labels[sl], w[sl])
        total = total + part
        hits.append(hit)
    correct.view(-1).index_copy_(0, index, torch.cat(hits))
    return total / w.sum(), correct


def dflash2_block_loss(drafter, hidden: torch.Tensor, lm_head_weight: torch.Tensor, blocks: Blocks, gamma: float,
                       chunk_size: int = 4096):
    """A DFlash2 drafter's loss (docs/method.md): the decayed CE of its scaled, soft-capped draft logits plus the
    candidate selector's term (dflash.models.dflash2.selector_loss), both divided by the sum of the weights.
    `correct` is the selector's greedy pick, teacher-forced on the true previous token."""
    from dflash.models.dflash2 import selector_loss

    b, m, bs, h = hidden.shape
    pred = hidden[:, :, 1:, :]
    index = blocks.row_index()
    rows = pred.reshape(-1, h).index_select(0, index)
    labels = blocks.labels.flatten().index_select(0, index)
    prev = torch.cat([blocks.block_ids[:, :, :1], blocks.labels[:, :, :-1]], dim=-1).flatten().index_select(0, index)
    w = position_weights(bs, gamma, hidden.device).expand(b, m, -1).flatten().index_select(0, index)
    if blocks.row_mask is not None:
        w = w * blocks.row_mask
    correct = torch.zeros_like(blocks.label_valid)
    if index.numel() == 0:
        return hidden.sum() * 0.0, correct
    total = rows.new_zeros((), dtype=torch.float32)
    hits = []
    for start in range(0, rows.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        logits = drafter.logits(rows[sl], lm_head_weight)
        ce = (F.cross_entropy(logits.float(), labels[sl], reduction="none") * w[sl]).sum()
        sel, hit = selector_loss(drafter.candidate_selector, rows[sl], logits, labels[sl], prev[sl], w[sl])
        total = total + ce + sel
        hits.append(hit)
    correct.view(-1).index_copy_(0, index, torch.cat(hits))
    return total / w.sum(), correct


@dataclass
class BlockStats:
    """Sums, so that batches and ranks can be added before dividing."""

    correct_per_pos: torch.Tensor  # (B-1,)
    valid_per_pos: torch.Tensor  # (B-1,)
    accepted_sum: torch.Tensor  # () sum over blocks of leading correct predictions
    num_blocks: torch.Tensor  # ()

    @classmethod
    def of(cls, correct: torch.Tensor, blocks: Blocks) -> BlockStats:
        hit = (correct & blocks.label_valid).float()
        accepted = torch.cumprod(hit, dim=-1).sum(-1)  # leading correct predictions per block
        return cls(hit.sum((0, 1)), blocks.label_valid.float().sum((0, 1)),
                   (accepted * blocks.anchor_valid).sum(), blocks.anchor_valid.float().sum())

    def __add__(self, other: BlockStats) -> BlockStats:
        return BlockStats(self.correct_per_pos + other.correct_per_pos, self.valid_per_pos + other.valid_per_pos,
                          self.accepted_sum + other.accepted_sum, self.num_blocks + other.num_blocks)

    def to_vector(self) -> torch.Tensor:
        return torch.cat([self.correct_per_pos, self.valid_per_pos, self.accepted_sum[None], self.num_blocks[None]])

    @classmethod
    def from_vector(cls, v: torch.Tensor) -> BlockStats:
        n = (v.numel() - 2) // 2
        return cls(v[:n], v[n:2 * n], v[2 * n], v[2 * n + 1])

    @property
    def accuracy(self) -> list[float]:
        return (self.correct_per_pos / self.valid_per_pos.clamp(min=1)).tolist()

    @property
    def tau(self) -> float:
        """Simulated acceptance length: 1 + mean leading correct predictions per block."""
        return 1.0 + float(self.accepted_sum / self.num_blocks.clamp(min=1))


# ------------------------------------------------------------------------------------ the drafter's pass
def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """Anchors depend only on (seed, step, rank): a resumed run draws exactly what an unbroken one would."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1009 + rank)


def autocast_for(device: torch.device):
    """The run's autocast: bfloat16 on CUDA; none elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@dataclass
class PassResult:
    """One batch through the drafter: its blocks and, after the forward, its loss and which labels it predicted."""

    anchors: torch.Tensor  # (b, m) on the host
    valid: torch.Tensor  # (b, m) on the host
    on_host: Blocks  # the blocks on the host (their counts need no device sync)
    blocks: Blocks  # the same blocks on the device
    loss: torch.Tensor | None = None  # 0-d
    correct: torch.Tensor | None = None  # (b, m, B-1) bool, on the device

    @property
    def stats(self) -> BlockStats:
        return BlockStats.of(self.correct, self.blocks)

    def leading_correct(self) -> torch.Tensor:
        """(b, m) leading correct predictions of each block, on the host."""
        hit = (self.correct & self.blocks.label_valid).float()
        return torch.cumprod(hit, dim=-1).sum(-1).long().cpu()


@dataclass
class BlockPass:
    """Anchors -> blocks -> the drafter forward -> the decayed loss, for one batch given its target features: the
    pass training and the held-out evaluation share (docs/method.md). Two halves: `prepare` builds anchors, blocks
    and counts on the host (the GPU is never waited for) and sends the blocks to the device; `loss` runs the
    forward under the run's autocast."""

    drafter: Any  # dflash.models.drafter.Drafter: its mask token and its weights' dtype
    block_size: int
    gamma: float
    num_anchors: int  # anchors per sequence (drafter.num_anchors)
    loss_chunk_size: int
    loss_impl: str
    attention_kind: str  # "sdpa" or "flex" (dflash.models.attention)
    device: torch.device
    flex: Callable | None = None  # the compiled flex_attention, where used
    float8_head: bool = False  # the training loss's LM-head matmuls in float8 (drafter.float8_head)

    def autocast(self):
        return autocast_for(self.device)

    def prepare(self, batch, generator: torch.Generator, num_anchors: int | None = None) -> PassResult:
        """The host half for `batch` (a dflash.data Batch on the device); `num_anchors`: anchors per sequence if
        not the training's (the decoding-path walk anchors every position)."""
        host = batch.on_host
        anchors, valid = sample_anchors(host.loss_mask, host.lengths, num_anchors or self.num_anchors, generator)
        on_host = build_blocks(host.input_ids, host.loss_mask, host.lengths, anchors, valid, self.block_size,
                               self.drafter.arch.mask_token_id)
        return PassResult(anchors, valid, on_host, on_host.to(self.device))

    def loss(self, forward: Callable, features: torch.Tensor, blocks: Blocks, embed: torch.nn.Embedding,
             head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The device half: `forward` (the drafter's compiled forward, or a DDP wrapper) over the blocks and the
        weighted block loss. Returns (loss, correct (b, m, B-1))."""
        if self.device.type != "cuda":  # no autocast off CUDA: a bf16 target's tensors meet fp32 drafter weights
            dtype = next(self.drafter.parameters()).dtype
            features, head = features.to(dtype), head.to(dtype)
        with self.autocast():
            hidden = forward(features, blocks.block_ids, blocks.anchors, embed, self.attention_kind, self.flex)
            if self.drafter.arch.dflash2:
                return dflash2_block_loss(self.drafter, hidden, head, blocks, self.gamma, self.loss_chunk_size)
            return weighted_block_loss(hidden, head, blocks, self.gamma, self.loss_chunk_size, self.loss_impl,
                                       self.float8_head)

    def __call__(self, forward: Callable, features: torch.Tensor, batch, generator: torch.Generator,
                 embed: torch.nn.Embedding, head: torch.Tensor, num_anchors: int | None = None) -> PassResult:
        """Both halves."""
        result = self.prepare(batch, generator, num_anchors)
        result.loss, result.correct = self.loss(forward, features, result.blocks, embed, head)
        return result
