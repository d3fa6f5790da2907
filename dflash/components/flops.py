"""Counted FLOPs of a drafter training step and of the target forward (for MFU).

Drafter, per layer, forward (Nq = blocks * B query tokens, Nc = context tokens):
  q, o projections   2 * Nq * H * (heads * d) each
  k, v projections   2 * (Nc + Nq) * H * (kv_heads * d) each      (KV injection: context + block)
  SwiGLU MLP         3 * 2 * Nq * H * I
  attention          4 * d * heads * sum over queries of visible keys  (useful work only; a sliding layer
                     counts the keys within its window, a causal one the block's earlier keys)
fc fusion            2 * Nc * (n_tapped * H) * H
LM head (frozen)     2 * rows * H * V  for the rows that carry a loss
Training = 3x forward for the layers (weights and inputs need gradients), 2x for fc (weight gradient
only: target features need none) and 2x for the frozen LM head (input gradient only). Recomputation
(checkpointed loss chunks) is extra work and is not counted as useful.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.models.attention import LayerMask
from dflash.models.drafter import DrafterArch

PEAK_BF16_TFLOPS = {"H200": 790.0, "H100": 790.0, "A100": 312.0}  # measured H200 matmul rate (docs/PERFORMANCE.md)


@dataclass
class StepFlops:
    layers: float
    fc: float
    lm_head: float
    attention: float

    @property
    def training(self) -> float:
        return 3 * self.layers + 2 * self.fc + 2 * self.lm_head

    @property
    def forward(self) -> float:
        return self.layers + self.fc + self.lm_head


def drafter_step_flops(arch: DrafterArch, ctx_tokens: int, anchors: torch.Tensor, anchor_valid: torch.Tensor,
                       loss_rows: int) -> StepFlops:
    """anchors/anchor_valid: (b, m). Padded anchor slots still cost compute but are not useful: not counted."""
    h, d, bsz = arch.hidden_size, arch.head_dim, arch.block_size
    hq, hkv, inter = arch.num_attention_heads * d, arch.num_key_value_heads * d, arch.intermediate_size
    n_blocks = int(anchor_valid.sum())
    nq = n_blocks * bsz
    attn = sum(4.0 * d * arch.num_attention_heads * visible_keys(arch.layer_mask(i), anchors, anchor_valid, bsz)
               for i in range(arch.num_hidden_layers))
    per_layer = 2 * nq * h * hq * 2 + 2 * (ctx_tokens + nq) * h * hkv * 2 + 6 * nq * h * inter
    layers = arch.num_hidden_layers * per_layer + attn
    fc = 2.0 * ctx_tokens * len(arch.target_layer_ids) * h * h
    lm = 2.0 * loss_rows * h * arch.vocab_size
    return StepFlops(float(layers), fc, lm, float(attn))


def visible_keys(layer: LayerMask, anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int) -> float:
    """Keys the valid blocks' queries see in one layer, summed (dflash.models.attention.visible's count): the
    context before each anchor (within the window for a sliding layer) and the block's own keys (the earlier
    ones for a causal layer)."""
    a = anchors.float()[anchor_valid.bool()]  # (n,) anchors of the valid blocks
    o = torch.arange(block_size, dtype=torch.float32)
    if layer.window is None:
        ctx = a[:, None].expand(-1, block_size)
    else:
        ctx = torch.minimum(a[:, None], (layer.window - 1 - o)[None, :]).clamp(min=0)
    kv = o[None, :]
    own = torch.ones(block_size, block_size, dtype=torch.bool)
    if layer.window is not None:
        own &= (o[:, None] - kv) < layer.window
        if not layer.causal:
            own &= (kv - o[:, None]) < layer.window
    if layer.causal:
        own &= kv <= o[:, None]
    return float(ctx.sum()) + float(own.sum()) * a.numel()


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def target_forward_flops(num_params_used: int, tokens: int, seq_len: int, attn_layers: int, heads: int,
                         head_dim: int) -> float:
    """2 * params * tokens + causal attention (QK^T and PV over half the square) for full-attention layers."""
    sequences = max(tokens // max(seq_len, 1), 1)
    attention = attn_layers * 4.0 * heads * head_dim * (seq_len * seq_len / 2) * sequences
    return 2.0 * num_params_used * tokens + attention
