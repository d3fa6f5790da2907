"""Hand-computed cases for anchors, blocks, labels, weights and tau."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflash.components.loss import (
    BlockStats,
    build_blocks,
    position_weights,
    sample_anchors,
    valid_anchor_positions,
    weighted_block_loss,
)

MASK = 99


def test_valid_anchors_are_positions_whose_first_label_is_a_loss_token():
    loss_mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0], dtype=torch.bool)
    # labels x_{a+1} at 3,4,5 are in the loss mask -> a in {2,3,4}
    assert valid_anchor_positions(loss_mask, 8).tolist() == [2, 3, 4]
    # a shorter true length cuts candidates
    assert valid_anchor_positions(loss_mask, 5).tolist() == [2, 3]


def test_sample_anchors_without_replacement_sorted_and_padded():
    loss_mask = torch.zeros(2, 10, dtype=torch.bool)
    loss_mask[0, 2:10] = True  # candidates a = 1..8
    loss_mask[1, 5:7] = True  # candidates a = 4, 5
    g = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(loss_mask, torch.tensor([10, 10]), 4, g)
    a0 = anchors[0][valid[0]].tolist()
    assert len(a0) == 4 and len(set(a0)) == 4 and a0 == sorted(a0) and all(1 <= a <= 8 for a in a0)
    assert anchors[1][valid[1]].tolist() == [4, 5] and valid[1].tolist() == [True, True, False, False]
    # resampled: another generator draws another set (with overwhelming probability over many draws)
    draws = {tuple(sample_anchors(loss_mask, torch.tensor([10, 10]), 4, torch.Generator().manual_seed(s))[0][0].tolist())
             for s in range(20)}
    assert len(draws) > 5


def test_block_construction_and_label_alignment():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    lengths = torch.tensor([7])
    anchors = torch.tensor([[1, 4]])
    valid = torch.tensor([[True, True]])
    b = build_blocks(ids, loss_mask, lengths, anchors, valid, block_size=4, mask_token_id=MASK)
    assert b.block_ids.tolist() == [[[11, MASK, MASK, MASK], [14, MASK, MASK, MASK]]]
    # position k predicts x_{a+k}: anchor 1 -> 12, 13, 14 ; anchor 4 -> 15, 16, (17 outside)
    assert b.labels[0, 0].tolist() == [12, 13, 14]
    assert b.labels[0, 1, :2].tolist() == [15, 16]
    # anchor 1: labels at 2,3,4 all in loss; anchor 4: 5 in loss, 6 not in loss, 7 beyond length
    assert b.label_valid.tolist() == [[[True, True, True], [True, False, False]]]


def test_position_weights_decay():
    w = position_weights(16, 7.0)
    assert w.shape == (15,)
    assert math.isclose(float(w[0]), 1.0)
    assert math.isclose(float(w[7]), math.exp(-1.0), rel_tol=1e-6)  # k = 8


def test_weighted_loss_matches_hand_computation():
    torch.manual_seed(0)
    vocab, hdim = 7, 5
    hidden = torch.randn(1, 2, 3, hdim, requires_grad=True)
    head = torch.randn(vocab, hdim)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    blocks = build_blocks(ids, loss_mask, torch.tensor([6]), torch.tensor([[0, 3]]), torch.tensor([[True, True]]),
                          3, MASK)
    loss, correct = weighted_block_loss(hidden, head, blocks, gamma=2.0, chunk_size=2)
    # valid: anchor 0 -> labels x1, x2 (both loss); anchor 3 -> x4 (loss), x5 (not loss)
    w = [1.0, math.exp(-0.5)]
    terms = []
    for (j, k, label) in [(0, 1, 2), (0, 2, 3), (1, 1, 5)]:
        logits = hidden[0, j, k] @ head.t()
        terms.append(w[k - 1] * F.cross_entropy(logits[None], torch.tensor([label])))
    expected = sum(terms) / (w[0] + w[1] + w[0])
    assert torch.allclose(loss, expected, atol=1e-6)
    loss.backward()
    assert hidden.grad[0, 1, 2].abs().sum() == 0  # invalid position gets no gradient
    assert hidden.grad[0, :, 0].abs().sum() == 0  # position 0 has no loss


def test_tau_counts_leading_correct_predictions():
    labels = torch.zeros(1, 3, 4, dtype=torch.long)
    valid = torch.ones(1, 3, 4, dtype=torch.bool)
    valid[0, 2, 2:] = False
    from dflash.components.loss import Blocks

    blocks = Blocks(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[True, True, True]]),
                    torch.zeros(1, 3, 5, dtype=torch.long), labels, valid)
    correct = torch.tensor([[[1, 1, 0, 1],   # 2 leading
                             [0, 1, 1, 1],   # 0 leading
                             [1, 1, 1, 1]]], dtype=torch.bool)  # 2 leading (then invalid)
    stats = BlockStats.of(correct, blocks)
    assert stats.tau == pytest.approx(1 + (2 + 0 + 2) / 3)
    assert stats.accuracy == pytest.approx([2 / 3, 3 / 3, 1 / 2, 2 / 2])
    merged = BlockStats.from_vector((stats + stats).to_vector())
    assert merged.tau == pytest.approx(stats.tau)


def _random_blocks(b=2, t=40, m=6, bs=5, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    loss_mask = torch.rand(b, t, generator=g) > 0.3
    lengths = torch.tensor([t, t - 9])
    anchors, valid = sample_anchors(loss_mask, lengths, m, g)
    return build_blocks(ids, loss_mask, lengths, anchors, valid, bs, MASK)


@pytest.mark.parametrize("chunk_size", [1, 7, 4096])
def test_fused_head_loss_matches_checkpointed_loss_and_gradients(chunk_size):
    """The fused path computes the row gradients in its forward (no logits recompute); loss, accuracy and
    gradients must equal the checkpointed chunked path's."""
    torch.manual_seed(1)
    blocks = _random_blocks()
    hidden = torch.randn(2, 6, 5, 16)
    head = torch.randn(50, 16)
    results = {}
    for impl in ("checkpoint", "fused"):
        h = hidden.clone().requires_grad_(True)
        loss, correct = weighted_block_loss(h, head, blocks, gamma=3.0, chunk_size=chunk_size, impl=impl)
        (loss * 2.5).backward()  # a non-unit upstream gradient reaches the saved row gradients
        results[impl] = (loss.detach(), correct, h.grad)
    (la, ca, ga), (lb, cb, gb) = results["checkpoint"], results["fused"]
    assert torch.allclose(la, lb, rtol=1e-6, atol=1e-7)
    assert torch.equal(ca, cb)
    assert torch.allclose(ga, gb, rtol=1e-5, atol=1e-7)
    assert ga.abs().sum() > 0


def test_fused_head_loss_without_grad_and_with_no_valid_rows():
    blocks = _random_blocks()
    hidden = torch.randn(2, 6, 5, 16)
    head = torch.randn(50, 16)
    with torch.no_grad():
        a, _ = weighted_block_loss(hidden, head, blocks, 3.0, impl="fused")
        b, _ = weighted_block_loss(hidden, head, blocks, 3.0, impl="checkpoint")
    assert torch.allclose(a, b, atol=1e-6)
    empty = _random_blocks()
    empty.label_valid.zero_()
    h = hidden.clone().requires_grad_(True)
    loss, correct = weighted_block_loss(h, head, empty, 3.0, impl="fused")
    loss.backward()
    assert float(loss.detach()) == 0.0 and not correct.any() and h.grad.abs().sum() == 0
    with pytest.raises(ValueError, match="impl"):
        weighted_block_loss(hidden, head, blocks, 3.0, impl="liger")


def test_compiled_ce_rows_matches_eager_with_one_graph_for_every_row_count():
    """On CUDA the fused loss runs `ce_rows` compiled (inductor; here its CPU code generation): the same
    loss, hits and logits gradient as eager, and one compilation serves chunks of any row count, since the
    last chunk's length changes with every batch."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from dflash.components.loss import ce_rows, compile_ce_rows

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = compile_ce_rows(backend=counter)
    g = torch.Generator().manual_seed(3)
    for n in (37, 64, 5):
        logits = (torch.randn(n, 300, generator=g) * 4).to(torch.bfloat16)
        labels = torch.randint(0, 300, (n,), generator=g)
        w = torch.rand(n, generator=g)
        total, hits, grad = compiled(logits, labels, w)
        ref_total, ref_hits, ref_grad = ce_rows(logits, labels, w)
        manual = (F.cross_entropy(logits.float(), labels, reduction="none") * w).sum()
        assert torch.allclose(ref_total, manual, rtol=1e-5)
        assert torch.allclose(total, ref_total, rtol=1e-5)
        assert torch.equal(hits, ref_hits) and hits.dtype == torch.bool
        assert grad.dtype == torch.bfloat16
        assert torch.allclose(grad.float(), ref_grad.float(), atol=1e-2)
        assert torch.allclose(grad.float().sum(-1), torch.zeros(n), atol=2e-2)  # softmax - onehot sums to 0
    assert counter.frame_count == 1, counter.frame_count
    torch._dynamo.reset()
