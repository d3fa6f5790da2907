"""drafter.float8: the drafter's linear layers through torchao's Float8Linear (torch's float8 matmul runs on
the CPU too, so the whole path trains here; the speed needs float8 tensor cores: docs/PERFORMANCE.md)."""

import copy
import json
import sys

import pytest
import torch

from dflash.cli import main
from dflash.components.float8 import check_float8, float8_linears
from dflash.errors import ConfigError
from dflash.models.drafter import Drafter
from dflash.training.trainer import Trainer

pytest.importorskip("torchao.float8")


# torch's float8 matmul on the CPU is a slow reference kernel (its time grows with the rows of the batch): the
# float8 runs here take small batches (a few sequences, a few anchors each), which is all their assertions need.
SMALL_BATCH = {"token_budget": 256, "num_anchors": 4}


def _small(cfg):
    cfg.data.token_budget = SMALL_BATCH["token_budget"]
    cfg.drafter.num_anchors = SMALL_BATCH["num_anchors"]
    return cfg


def _linears(model):
    return sorted(name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear))


def test_float8_trains_like_bf16_and_its_checkpoints_resume_and_export_without_it(tiny_config, tmp_path):
    runs = {}
    for fp8 in (False, True):
        cfg = _small(copy.deepcopy(tiny_config))
        cfg.output_dir = str(tmp_path / f"fp8-{fp8}")
        cfg.drafter.float8 = fp8
        cfg.optim.max_steps = 6
        trainer = Trainer(cfg).setup()
        losses = [trainer.train_step()[1].loss for _ in range(6)]
        runs[fp8] = (trainer, losses)
    (plain, plain_losses), (fp8, fp8_losses) = runs[False], runs[True]
    # every linear layer of the drafter (attention, MLP, the feature fusion) runs in float8, none in plain
    assert sorted(float8_linears(fp8.drafter)) == _linears(fp8.drafter) and len(_linears(fp8.drafter)) == 2 * 7 + 1
    assert float8_linears(plain.drafter) == []
    # same parameters, same names: checkpoints and exports are interchangeable
    assert fp8.drafter.state_dict().keys() == plain.drafter.state_dict().keys()
    # same weights at step 0 (same seed), so the first loss differs only by float8 rounding; then it learns
    assert fp8_losses[0] == pytest.approx(plain_losses[0], rel=0.01)
    assert fp8_losses[0] != plain_losses[0]  # the float8 path did run
    assert all(x == x for x in fp8_losses) and fp8_losses[-1] < fp8_losses[0]
    assert fp8_losses[-1] == pytest.approx(plain_losses[-1], rel=0.03)

    assert fp8.save_checkpoint() is not None
    resumed_cfg = copy.deepcopy(fp8.config)
    resumed_cfg.drafter.float8 = False  # a float8 run resumed without float8
    resumed = Trainer(resumed_cfg).setup()
    assert resumed.step == 6 and float8_linears(resumed.drafter) == []
    for k, v in fp8.drafter.state_dict().items():
        assert torch.equal(resumed.drafter.state_dict()[k], v), k

    out = tmp_path / "export"
    assert main(["export", fp8.config.output_dir, str(out)]) == 0
    exported = Drafter.load(out)
    assert float8_linears(exported) == [] and json.loads((out / "config.json").read_text())


def test_float8_without_torchao_is_refused_before_anything_is_written(tiny_config, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    cfg = copy.deepcopy(tiny_config)
    cfg.output_dir = str(tmp_path / "no-torchao")
    cfg.drafter.float8 = True
    with pytest.raises(ConfigError, match=r"drafter\.float8 .*torchao.*pip install.*drafter\.float8: false"):
        Trainer(cfg).setup()
    assert not (tmp_path / "no-torchao" / "checkpoints").exists()


def test_float8_is_refused_on_a_gpu_without_float8_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"compute capability 8\.9.*cuda:1 is NVIDIA A100-SXM4-80GB, 8\.0.*"
                                          r"drafter\.float8: false"):
        check_float8(torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    check_float8(torch.device("cuda", 1))  # Hopper: accepted


def test_float8_leaves_layers_whose_dimensions_float8_cannot_take(monkeypatch):
    from dflash.components.float8 import convert_linears

    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 10, bias=False))
    kept = convert_linears(model)
    assert kept == ["1"] and float8_linears(model) == ["0"]
    y = model(torch.randn(4, 64))
    assert y.shape == (4, 10) and torch.isfinite(y).all()


def test_a_float8_run_ends_with_a_lossless_speculative_decoding_eval(tiny_config, tmp_path):
    """The whole run: training, then the final eval's real speculative decoding with the float8 drafter,
    whose output must equal the target's own greedy decoding (the target verifies every token)."""
    cfg = _small(copy.deepcopy(tiny_config))
    cfg.output_dir = str(tmp_path / "fp8-run")
    cfg.drafter.float8 = True
    cfg.optim.max_steps = 3
    cfg.eval.speculative_prompts = 2
    cfg.eval.max_new_tokens = 16
    result = Trainer(cfg).setup().run()
    assert result["step"] == 3 and result["eval_acceptance_length"] >= 1.0
    evals = [r for x in (tmp_path / "fp8-run" / "metrics.jsonl").read_text().splitlines()
             if (r := json.loads(x)).get("kind") == "eval"]
    assert evals and evals[-1]["lossless"] is True


def test_a_float8_run_from_the_cli_keeps_stderr_empty(write_config, tiny_dict, tmp_path):
    """torchao, once installed, is imported by transformers in every run and speaks at import (kernels built
    for another torch, no Triton); none of that reaches a run's stderr, which holds only a failure's line."""
    import subprocess

    tiny_dict.update(output_dir=str(tmp_path / "cli"))
    tiny_dict["drafter"]["float8"] = True
    tiny_dict["optim"]["max_steps"] = 2
    tiny_dict["data"]["synthetic"]["num_samples"] = 60
    tiny_dict["data"]["token_budget"] = SMALL_BATCH["token_budget"]
    tiny_dict["drafter"]["num_anchors"] = SMALL_BATCH["num_anchors"]
    tiny_dict["eval"]["speculative_prompts"] = 0
    proc = subprocess.run([sys.executable, "-m", "dflash", "train", str(write_config(tiny_dict))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "linear layers in float8" in proc.stdout and "done: step 2" in proc.stdout


def test_float8_conversion_can_keep_named_layers():
    from dflash.components.float8 import convert_linears

    model = torch.nn.ModuleDict({"q_proj": torch.nn.Linear(64, 64), "fc": torch.nn.Linear(64, 64)})
    assert convert_linears(model, skip=("fc",)) == ["fc"] and float8_linears(model) == ["q_proj"]


# ------------------------------------------------------------------ drafter.float8_head: the loss's LM head
def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_float8_head_matmuls_match_the_full_precision_ones_within_float8_rounding():
    from dflash.components.float8 import float8_head

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen) * 0.05
    rows = torch.randn(40, 64, generator=gen)
    head = float8_head(weight)
    assert float8_head(weight) is head  # cast once per frozen head, not per call
    assert _rel(head.logits(rows, torch.float32), rows @ weight.t()) < 0.06
    g = torch.randn(40, 96, generator=gen)
    from dflash.components.float8 import E5M2, rowwise

    g8, scale = rowwise(g, E5M2)
    assert _rel(head.rows_grad(g8, scale, torch.float32), g @ weight) < 0.1
    weight.mul_(2)  # a changed head (its version moves) is cast again
    assert float8_head(weight) is not head


def test_float8_loss_rows_give_the_loss_exactly_and_the_gradient_within_e5m2_rounding():
    from dflash.components.loss import GRAD_FLOAT8_TOP, ce_rows, ce_rows_float8

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 96, generator=gen) * 3
    logits[0, 5] = 80.0  # a row whose label is all but certain: its gradient is tiny, never inf or nan
    labels = torch.randint(0, 96, (64,), generator=gen)
    labels[0] = 5
    w = torch.rand(64, generator=gen)
    w[3] = 0.0  # a padding row
    total, hits, grad = ce_rows(logits, labels, w)
    total8, hits8, grad8, scale = ce_rows_float8(logits, labels, w)
    assert grad8.dtype == torch.float8_e5m2 and scale.shape == (64, 1)
    assert torch.equal(total, total8) and torch.equal(hits, hits8)  # the loss itself stays fp32
    restored = grad8.float() * scale
    assert torch.isfinite(restored).all() and restored[3].abs().max() == 0
    assert _rel(restored, grad) < 0.1
    # the row's largest magnitude, the label's, lands at the chosen point of the format (no overflow)
    label_entries = grad8.float().gather(1, labels[:, None]).squeeze(1).abs()
    live = w > 0
    live[0] = False  # its 1 - p_label (~1e-34) is under the scale's floor: all but zero, as it should be
    assert restored[0].abs().max() < 1e-20
    assert torch.allclose(label_entries[live], torch.full_like(label_entries[live], GRAD_FLOAT8_TOP), rtol=0.15)
    assert grad8.float().abs().max() <= torch.finfo(torch.float8_e5m2).max


def test_float8_head_loss_and_gradient_follow_the_full_precision_loss():
    from dflash.components.loss import Blocks, weighted_block_loss

    gen = torch.Generator().manual_seed(2)
    b, m, bs, h, vocab = 2, 5, 4, 64, 96
    hidden = torch.randn(b, m, bs, h, generator=gen)
    weight = torch.randn(vocab, h, generator=gen) * 0.1
    labels = torch.randint(0, vocab, (b, m, bs - 1), generator=gen)
    valid = torch.rand(b, m, bs - 1, generator=gen) > 0.2
    blocks = Blocks(torch.zeros(b, m, dtype=torch.long), torch.ones(b, m, dtype=torch.bool),
                    torch.zeros(b, m, bs, dtype=torch.long), labels, valid)
    out = {}
    for f8 in (False, True):
        x = hidden.clone().requires_grad_(True)
        loss, correct = weighted_block_loss(x, weight, blocks, gamma=4.0, impl="fused", float8_head=f8)
        loss.backward()
        out[f8] = (loss.detach(), x.grad)
    assert out[True][0] == pytest.approx(float(out[False][0]), rel=0.02)
    assert out[True][0] != out[False][0]  # the float8 path did run
    assert _rel(out[True][1], out[False][1]) < 0.1


def test_float8_head_trains_and_is_a_config_error_without_float8_or_the_fused_loss(tiny_config, tmp_path):
    from dflash.config import validate

    cfg = _small(copy.deepcopy(tiny_config))
    cfg.output_dir = str(tmp_path / "head")
    cfg.drafter.float8, cfg.drafter.float8_head = True, True
    cfg.optim.max_steps = 4
    trainer = Trainer(cfg).setup()
    losses = [trainer.train_step()[1].loss for _ in range(4)]
    assert all(x == x for x in losses) and losses[-1] < losses[0]
    bad = copy.deepcopy(tiny_config)
    bad.drafter.float8_head = True
    with pytest.raises(ConfigError, match="set drafter.float8: true too"):
        validate(bad)
    bad.drafter.float8, bad.drafter.loss_impl = True, "checkpoint"
    with pytest.raises(ConfigError, match="drafter.float8_head runs in the fused loss"):
        validate(bad)


def test_float8_head_refuses_a_head_shape_float8_matmuls_cannot_take(tiny_config, tmp_path):
    from dflash.components.float8 import check_float8_head

    check_float8_head(151936, 4096)  # Qwen3's: fine
    with pytest.raises(ConfigError, match="the LM head is 32001 x 4096.*set drafter.float8_head: false"):
        check_float8_head(32001, 4096)
    cfg = copy.deepcopy(tiny_config)
    cfg.output_dir = str(tmp_path / "odd")
    cfg.drafter.float8, cfg.drafter.float8_head = True, True
    cfg.target.random_init["vocab_size"] = 90  # not divisible by 16
    with pytest.raises(ConfigError, match="the LM head is 90 x"):
        Trainer(cfg).setup()
    assert not any((tmp_path / "odd").glob("checkpoints/step-*"))


# ------------------------------------------------------------------------------- target.float8
TARGET = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_target_float8_features_follow_the_full_precision_ones_and_decoding_keeps_its_precision():
    from dflash.components.float8 import target_float8
    from dflash.models.target import Target, build_hf_model

    model = build_hf_model(None, dict(TARGET), "float32", seed=0)
    target = Target(model, [1, 3])
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), target.capture_all():
        logits = model(input_ids=ids).logits
    want = target.features(ids)
    done, kept = target_float8(target)
    assert (done, kept) == (4 * 7, 0)  # layers 0-3 run (the deepest tap is 3): q, k, v, o, gate, up, down each
    got = target.features(ids)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert not torch.equal(got, want)  # the float8 matmuls did run
    assert _rel(got, want) < 0.08  # e4m3's 3 mantissa bits, rowwise scales: a few percent
    assert torch.equal(target.features(ids), got)  # the same cast every call
    # outside `features` the model is its own again: the eval's decoding and regeneration are unchanged
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))
    with torch.no_grad(), target.capture_all():
        assert torch.equal(model(input_ids=ids).logits, logits)


def test_target_float8_keeps_odd_layers_and_puts_back_an_instance_forward():
    from dflash.components.float8 import target_float8

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 10))])

        def features(self, x):
            return self.layers[0](x)

    holder = Holder()
    own = holder.layers[0][0].forward
    holder.layers[0][0].forward = own  # an instance-level forward set by someone else
    x = torch.randn(3, 5, 32)
    want = holder.features(x)
    assert target_float8(holder) == (1, 1)  # the 48 x 10 layer cannot take float8
    got = holder.features(x)
    assert got.shape == (3, 5, 10) and _rel(got, want) < 0.08 and not torch.equal(got, want)
    assert holder.layers[0][0].__dict__["forward"] is own and "forward" not in holder.layers[0][1].__dict__


def test_target_float8_in_compiled_layers_gives_the_eager_float8_features():
    from dflash.compile import compile_target_layers
    from dflash.components.float8 import target_float8
    from dflash.models.target import Target, build_hf_model

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    eager = Target(build_hf_model(None, dict(TARGET), "float32", seed=0), [1, 3])
    target_float8(eager)
    compiled = Target(build_hf_model(None, dict(TARGET), "float32", seed=0), [1, 3])
    target_float8(compiled)
    guard = compile_target_layers(compiled, "default", backend="aot_eager")
    want = eager.features(ids)
    for _ in range(2):  # the second call replays: same forwards installed, no recompile
        assert torch.allclose(compiled.features(ids), want, rtol=1e-4, atol=1e-4)
    assert guard.failed is None


def test_target_float8_trains_and_is_refused_on_a_gpu_without_float8_tensor_cores(tiny_config, tmp_path, monkeypatch,
                                                                                  caplog):
    losses = {}
    for fp8 in (False, True):
        cfg = _small(copy.deepcopy(tiny_config))
        cfg.output_dir = str(tmp_path / f"t8-{fp8}")
        cfg.target.float8 = fp8
        trainer = Trainer(cfg).setup()
        losses[fp8] = [trainer.train_step()[1].loss for _ in range(4)]
    assert losses[True][0] != losses[False][0]  # the features differ by float8 rounding
    assert losses[True][0] == pytest.approx(losses[False][0], rel=0.02)
    assert all(x == x for x in losses[True]) and losses[True][-1] < losses[True][0]
    assert "the feature forward's" in caplog.text and "linear layers in float8" in caplog.text

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"target\.float8 needs float8 tensor cores.*Set target\.float8: false"):
        check_float8(torch.device("cuda", 0), "target.float8", torchao=False)


def test_target_float8_stages_of_a_split_target_chain_to_the_unsplit_float8_features():
    """A layer-split target (topology.target_stages) puts each stage's layers in float8: chained, the stages give
    the unsplit float8 target's features."""
    from dflash.components.float8 import target_float8
    from dflash.models.target import Target, build_hf_model
    from dflash.runtime.stages import TargetStage, stage_bounds

    taps = [1, 2, 4]
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(2))
    unsplit = Target(build_hf_model(None, dict(TARGET), "float32", seed=3), taps)
    plain = unsplit.features(ids)
    assert target_float8(unsplit) == (5 * 7, 0)
    want = unsplit.features(ids)
    hidden, collected, converted = None, [], 0
    for s, (start, stop) in enumerate(stage_bounds(taps, 2)):
        stage = TargetStage(build_hf_model(None, dict(TARGET), "float32", seed=3), taps, start, stop,
                            keep_embedding=s == 0, keep_head=s == 0)
        converted += target_float8(stage)[0]
        hidden, got = stage(ids, None, hidden)
        collected += got
    feats = torch.cat(collected, dim=-1)
    assert converted == 5 * 7
    assert torch.allclose(feats, want, atol=1e-5) and not torch.allclose(feats, plain, atol=1e-3)
