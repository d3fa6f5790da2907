"""Counted attention work of a drafter step (dflash/components/flops.py): per layer, the keys its mask lets each valid
block's queries see — the count of the mask itself (dflash.models.attention.dense_mask) for full, sliding and
causal layers."""

from __future__ import annotations

import pytest
import torch

from dflash.components.flops import visible_keys
from dflash.models.attention import LayerMask, dense_mask


@pytest.mark.parametrize("layer", [LayerMask(), LayerMask(window=5, causal=True), LayerMask(window=3),
                                   LayerMask(causal=True), LayerMask(window=12, causal=True)])
def test_visible_keys_is_the_masks_own_count(layer):
    block, ctx = 4, 20
    anchors = torch.tensor([[0, 3, 9, 17], [2, 6, 11, 15]])
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = dense_mask(anchors, ctx, block, layer)[:, 0]  # (b, m*B, T+m*B)
    rows = valid.repeat_interleave(block, dim=1)  # the queries of valid blocks
    assert visible_keys(layer, anchors, valid, block) == float(mask[rows].sum())


def test_a_full_layer_counts_anchor_plus_block_keys_per_query():
    anchors, valid = torch.tensor([[5, 9]]), torch.tensor([[1, 1]], dtype=torch.bool)
    assert visible_keys(LayerMask(), anchors, valid, 4) == (5 + 4) * 4 + (9 + 4) * 4
