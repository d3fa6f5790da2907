"""The drafter step through the CUDA-graph path's static inputs (dflash/training/step_graph.py), run eagerly on the CPU:
padded label rows, copied inputs and the trainer's own clip and AdamW give the step the trainer takes without
it. The capture itself needs a GPU (bench/step_graph_check.py runs it there)."""

import pytest
import torch

from dflash.components.loss import Blocks, weighted_block_loss
from dflash.config import load_config
from dflash.errors import ConfigError
from dflash.training import step_graph
from dflash.training.trainer import Trainer

TINY = "configs/tiny-cpu.yaml"


def tiny_trainer(tmp_path, name, **extra):
    overrides = [f"output_dir={tmp_path / name}", "data.regenerate=null", "data.synthetic.num_samples=64",
                 "eval.speculative_prompts=0", "logging.eval_interval=0", "runtime.num_threads=1",
                 *[f"{k}={v}" for k, v in extra.items()]]
    return Trainer(load_config(TINY, overrides)).setup()


def test_padded_rows_leave_loss_and_gradient_unchanged():
    torch.manual_seed(0)
    b, m, bs, h, vocab = 2, 3, 5, 8, 11
    valid = torch.rand(b, m, bs - 1) > 0.3
    blocks = Blocks(anchors=torch.zeros(b, m, dtype=torch.long), anchor_valid=torch.ones(b, m, dtype=torch.bool),
                    block_ids=torch.zeros(b, m, bs, dtype=torch.long), labels=torch.randint(vocab, (b, m, bs - 1)),
                    label_valid=valid)
    head = torch.randn(vocab, h)
    hidden = torch.randn(b, m, bs, h, requires_grad=True)
    for impl in ("fused", "checkpoint"):
        loss, correct = weighted_block_loss(hidden, head, blocks, 3.0, chunk_size=4, impl=impl)
        (grad,) = torch.autograd.grad(loss, hidden)
        padded = step_graph.padded_blocks(blocks, step_graph.row_capacity(int(valid.sum())))
        assert padded.rows.numel() == step_graph.ROW_QUANTUM > int(valid.sum())
        loss_p, correct_p = weighted_block_loss(hidden, head, padded, 3.0, chunk_size=4, impl=impl)
        (grad_p,) = torch.autograd.grad(loss_p, hidden)
        torch.testing.assert_close(loss_p, loss)
        torch.testing.assert_close(grad_p, grad)
        assert torch.equal(correct_p, correct)


def test_static_input_step_takes_the_trainers_step(tmp_path):
    plain = tiny_trainer(tmp_path, "plain")
    graphed = tiny_trainer(tmp_path, "graphed")
    assert plain.step_graphs is None  # off CUDA: the trainer steps kernel by kernel
    graphed.step_graphs = step_graph.StepGraphs(graphed, max_shapes=8, capture=False)
    losses, losses_g, stats, stats_g = [], [], [], []
    # 12 steps: a shape is captured on its second sight, so only from about the tenth step on is a graph
    # replayed on a batch other than the one it was captured with (a static input left stale shows only then)
    for _ in range(12):
        result, result_g = plain.train_step()[1], graphed.train_step()[1]
        losses.append(result.loss)
        losses_g.append(result_g.loss)
        stats.append(result.stats.to_vector())
        stats_g.append(result_g.stats.to_vector())
    assert graphed.step_graphs.replays >= 4, graphed.step_graphs.seen
    torch.testing.assert_close(torch.tensor(losses_g), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(stats_g), torch.stack(stats))  # accuracy and tau from the same labels
    for p, q in zip(plain.drafter.parameters(), graphed.drafter.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)
    assert graphed.scheduler.get_last_lr() == plain.scheduler.get_last_lr()


def test_unsupported_runs_say_why(tmp_path):
    t = tiny_trainer(tmp_path, "cpu")
    assert "not CUDA" in step_graph.unsupported(t)
    t.config.compile.step_graph = False
    assert step_graph.for_trainer(t) is None


def test_a_shape_limit_below_one_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"compile.step_graph_shapes must be >= 1 \(got 0\).*compile.step_graph=false"):
        load_config(TINY, ["compile.step_graph_shapes=0"])
