"""The training step's inputs without host-device syncs, and flex_attention's kernel options.

A step's anchors, blocks, loss rows and loss weights come from the host copy of its batch, so the GPU is
never waited for between the target forward, the drafter forward and the backward. These tests check that
what is computed that way equals what the device-side computation gave (the step's numbers do not change),
and that the flex tile options are validated and reach flex_attention.
"""

from __future__ import annotations

import time

import pytest
import torch

from dflash.components.loss import (
    BlockStats,
    build_blocks,
    position_weights,
    sample_anchors,
    weighted_block_loss,
)
from dflash.components.metrics import InputTimer
from dflash.config import ConfigError, check_flex_options, load_config
from dflash.data.buckets import Batch
from dflash.models.attention import TUNED_FLEX_OPTIONS, flex_options_for

MASK = 49


def _batch(b=3, t=40, vocab=50, seed=0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([t, t - 9, t - 17][:b])
    ids = torch.randint(0, vocab - 1, (b, t), generator=g)
    loss_mask = (torch.rand(b, t, generator=g) > 0.3) & (torch.arange(t)[None] < lengths[:, None])
    attention = (torch.arange(t)[None] < lengths[:, None]).long()
    return Batch(ids, loss_mask, attention, lengths, list(range(b)))


def test_a_moved_batch_keeps_its_host_copy():
    batch = _batch()
    assert batch.on_host is batch and batch.num_tokens == 40 + 31 + 23
    moved = batch.to("cpu")
    assert moved.host is batch and moved.on_host is batch
    assert torch.equal(moved.input_ids, batch.input_ids) and moved.num_tokens == batch.num_tokens
    again = moved.to("cpu")
    assert again.host is batch  # the original host copy, not a copy of a copy


def test_blocks_moved_with_their_rows_give_the_same_loss_stats_and_weight():
    """Blocks built on the host and moved carry the flat indices of their valid labels; the loss, the
    correct mask and the stats equal those of blocks that find them on the device (the earlier path)."""
    torch.manual_seed(0)
    batch = _batch()
    anchors, valid = sample_anchors(batch.loss_mask, batch.lengths, 7, torch.Generator().manual_seed(3))
    host = build_blocks(batch.input_ids, batch.loss_mask, batch.lengths, anchors, valid, 5, MASK)
    moved = host.to("cpu")
    assert host.rows is None and moved.rows is not None
    assert torch.equal(moved.rows, torch.nonzero(host.label_valid.flatten()).flatten())
    assert moved.num_rows == int(host.label_valid.sum()) > 0
    hidden = torch.randn(3, 7, 5, 16, requires_grad=True)
    head = torch.randn(50, 16)
    for impl in ("fused", "checkpoint"):
        a, ca = weighted_block_loss(hidden, head, host, 3.0, 4, impl)
        b, cb = weighted_block_loss(hidden, head, moved, 3.0, 4, impl)
        ga, = torch.autograd.grad(a, hidden)
        gb, = torch.autograd.grad(b, hidden)
        assert torch.equal(a, b) and torch.equal(ca, cb) and torch.equal(ga, gb)
        # the valid labels, taken by boolean indexing as before, are the rows the loss used
        pred = hidden[:, :, 1:, :][host.label_valid]
        assert torch.equal(pred, hidden[:, :, 1:, :].reshape(-1, 16)[moved.rows])
    stats = BlockStats.of(ca, moved)
    hit = (ca & host.label_valid).float()
    accepted = torch.cumprod(hit, dim=-1).sum(-1)
    assert float(stats.accepted_sum) == float(accepted[host.anchor_valid].sum())
    w = position_weights(5, 3.0)
    assert float((w * stats.valid_per_pos).sum()) == pytest.approx(
        float((w * host.label_valid.float().sum((0, 1))).sum()))


def test_blocks_whose_labels_change_after_building_are_not_read_stale():
    """Host blocks find their rows when asked, so a test or caller that edits label_valid is respected."""
    batch = _batch()
    anchors, valid = sample_anchors(batch.loss_mask, batch.lengths, 4, torch.Generator().manual_seed(1))
    blocks = build_blocks(batch.input_ids, batch.loss_mask, batch.lengths, anchors, valid, 5, MASK)
    blocks.label_valid.zero_()
    assert blocks.num_rows == 0
    loss, correct = weighted_block_loss(torch.randn(3, 4, 5, 8), torch.randn(50, 8), blocks, 3.0)
    assert float(loss) == 0.0 and not correct.any()


def test_input_timer_counts_host_time_and_resets():
    timer = InputTimer(torch.device("cpu"))
    outer = time.perf_counter()
    with timer():
        time.sleep(0.05)
    with timer():
        time.sleep(0.02)
    outer = time.perf_counter() - outer
    first = timer.collect()
    assert 0.07 <= first <= outer  # both blocks, and nothing outside them
    assert timer.collect() == 0.0


def test_flex_kernel_options_are_checked_with_a_message_naming_the_entry(write_config, tiny_dict):
    assert check_flex_options({"bwd_BLOCK_M1": 32, "fwd_num_warps": 8, "USE_TMA": False}) == {
        "bwd_BLOCK_M1": 32, "fwd_num_warps": 8, "USE_TMA": False}
    for bad, message in (({"BLOCK_Q": 64}, r"BLOCK_Q: not a flex_attention tile option"),
                         ({"bwd_BLOCK_N1": 48}, r"bwd_BLOCK_N1: 48 must be a power of two dividing"),
                         ({"bwd_BLOCK_N1": 256}, r"256 must be a power of two dividing the BlockMask tile"),
                         ({"num_warps": 0}, r"num_warps: expected a positive integer"),
                         ({"fwd_USE_TMA": 1}, r"fwd_USE_TMA: expected true or false")):
        tiny_dict["compile"] = {"flex_kernel_options": bad}
        with pytest.raises(ConfigError, match=message):
            load_config(write_config(tiny_dict))
    tiny_dict["compile"] = {"flex_kernel_options": {"bwd_num_stages": 2}}
    assert load_config(write_config(tiny_dict)).compile.flex_kernel_options == {"bwd_num_stages": 2}


def test_flex_options_default_to_the_tuned_entry_only_on_a_gpu():
    assert flex_options_for(None, torch.device("cpu"), 128) == {}
    assert flex_options_for({}, torch.device("cpu"), 128) == {}  # {}: torch's own choice
    assert flex_options_for({"bwd_num_warps": 4}, torch.device("cpu"), 128) == {"bwd_num_warps": 4}
    for (capability, head_dim), options in TUNED_FLEX_OPTIONS.items():  # every tuned entry is valid
        assert capability >= (8, 0) and head_dim in (64, 128, 256)
        assert check_flex_options(options) == options


def test_compiled_flex_is_one_callable_per_options_and_passes_them_to_flex_attention(monkeypatch):
    from torch.nn.attention import flex_attention as flex_module

    import dflash.models.attention as attention

    seen = []

    def spy(q, k, v, **kwargs):
        seen.append(kwargs.get("kernel_options"))
        return q

    monkeypatch.setattr(flex_module, "flex_attention", spy)
    monkeypatch.setattr(torch, "compile", lambda fn, **_kwargs: fn)  # the callable itself: what it passes is seen
    monkeypatch.setattr(attention, "_COMPILED_FLEX", {})
    plain = attention.compiled_flex_attention("default")
    tuned = attention.compiled_flex_attention("default", {"bwd_num_warps": 4})
    assert tuned is attention.compiled_flex_attention("default", {"bwd_num_warps": 4}) and tuned is not plain
    assert tuned.eager is plain  # its fallback: torch's own tiles, compiled
    q = torch.randn(1, 2, 4, 8)
    tuned(q, q, q, block_mask=None)
    plain(q, q, q, block_mask=None)
    assert seen == [{"bwd_num_warps": 4}, None]


def test_the_trainer_hands_its_flex_options_to_flex_attention(tiny_config, monkeypatch, capsys):
    import dflash.training.drafter_setup as drafter_setup
    import dflash.training.trainer as train_module

    seen = []

    def record(mode, options=None):
        seen.append((mode, options))
        return None

    monkeypatch.setattr(drafter_setup, "compiled_flex_attention", record)
    tiny_config.drafter.attention = "flex"
    tiny_config.compile.flex = True
    tiny_config.compile.flex_kernel_options = {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N2": 32}
    train_module.Trainer(tiny_config).setup()
    assert seen == [("default", {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N2": 32})]
    assert "flex_attention kernel options {'bwd_BLOCK_M1': 32, 'bwd_BLOCK_N2': 32}" in capsys.readouterr().out


def test_flex_tiles_that_fail_to_compile_fall_back_to_torchs_tiles_not_to_eager(monkeypatch, caplog):
    """A tile choice the compiler rejects (say, too much shared memory on another GPU) costs one log line and
    the run goes on with torch's own tiles, compiled: not with the eager reference, which materialises every
    score."""
    import functools
    import logging

    from torch._dynamo.exc import TorchDynamoException
    from torch.nn.attention.flex_attention import flex_attention

    import dflash.models.attention as attention

    compiled_calls = []
    real_compile = torch.compile

    def fake_compile(fn, **kwargs):
        if fn is not flex_attention and not isinstance(fn, functools.partial):
            return real_compile(fn, **kwargs)  # flex_attention's own internal use

        def run(*args, **kwargs):
            if isinstance(fn, functools.partial):
                raise TorchDynamoException("out of resource: shared memory")
            compiled_calls.append(fn)
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(attention, "_COMPILED_FLEX", {})
    tuned = attention.compiled_flex_attention("default", {"bwd_BLOCK_M1": 128})
    mask = attention.flex_block_mask(torch.tensor([[3, 9, 20]]), 32, 4)
    q, k, v = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 44, 8), torch.randn(1, 2, 44, 8)
    with caplog.at_level(logging.WARNING, logger="dflash.compile"):
        out = tuned(q, k, v, block_mask=mask)
        again = tuned(q, k, v, block_mask=mask)
    assert torch.allclose(out, flex_attention(q, k, v, block_mask=mask), atol=1e-6) and torch.equal(out, again)
    assert compiled_calls == [flex_attention, flex_attention]  # torch's tiles, through the compiled path
    lines = [r.getMessage() for r in caplog.records if "could not be compiled" in r.getMessage()]
    assert len(lines) == 1 and "flex with kernel options {'bwd_BLOCK_M1': 128}" in lines[0]
    assert "it runs with torch's own tiles" in lines[0] and "compile.flex_kernel_options={}" in lines[0]
