"""DFlash training attention: each block sees the context strictly before its anchor and itself, nothing else.

Keys are laid out as [context (T positions) ; blocks (m*B positions)], queries as [blocks (m*B)].
Two equivalent implementations: a dense boolean mask for SDPA (CPU, reference) and a flex_attention
BlockMask (CUDA). Both read the same predicate, `visible`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def visible(q_idx, kv_idx, anchors_b, ctx_len: int, block_size: int):
    """True where query `q_idx` (a block token) may attend key `kv_idx`. `anchors_b`: (m,) of one sequence."""
    block = q_idx // block_size
    in_ctx = kv_idx < ctx_len
    ctx_ok = kv_idx < anchors_b[block]  # strictly before the anchor
    own_block = (kv_idx - ctx_len) // block_size == block
    return torch.where(in_ctx, ctx_ok, own_block)


def dense_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """(b, 1, m*B, T+m*B) boolean mask for SDPA."""
    b, m = anchors.shape
    q_idx = torch.arange(m * block_size, device=anchors.device)[:, None]
    kv_idx = torch.arange(ctx_len + m * block_size, device=anchors.device)[None, :]
    masks = [visible(q_idx, kv_idx, anchors[i], ctx_len, block_size) for i in range(b)]
    return torch.stack(masks)[:, None]


def flex_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int):
    """BlockMask of `visible`. On CUDA its construction is compiled (`_compile=True`): eager construction
    materialises the whole (b, m*B, T+m*B) predicate in int64 temporaries (gigabytes at training shapes)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, m = anchors.shape

    def mask_mod(bi, _h, q_idx, kv_idx):
        return visible(q_idx, kv_idx, anchors[bi], ctx_len, block_size)

    return create_block_mask(mask_mod, b, None, m * block_size, ctx_len + m * block_size,
                             device=anchors.device, _compile=anchors.is_cuda)


class AttentionBackend:
    """Builds the mask once per batch and runs every layer's attention with it."""

    def __init__(self, kind: str, anchors: torch.Tensor, ctx_len: int, block_size: int, compiled=None):
        self.kind = kind
        if kind == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            self.mask = flex_block_mask(anchors, ctx_len, block_size)
            self._flex = compiled or flex_attention
        else:
            self.mask = dense_mask(anchors, ctx_len, block_size)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (b, hq, Lq, d); k, v: (b, hkv, Lk, d)."""
        gqa = q.shape[1] != k.shape[1]
        if self.kind == "flex":
            return self._flex(q, k, v, block_mask=self.mask, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa)


_COMPILED_FLEX = None


def compiled_flex_attention():
    """flex_attention compiled once per process (one process per GPU: no cross-thread FX tracing)."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def resolve_kind(requested: str, device: torch.device) -> str:
    if requested == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return requested
