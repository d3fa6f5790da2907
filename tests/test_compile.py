"""The compile section: compiled target layers equal eager, the eager fallback, the persistent kernel cache."""

from __future__ import annotations

import copy
import logging
import os
import time

import pytest
import torch

from dflash.compile import (
    CompilePlan,
    EagerFallback,
    cache_key,
    compile_drafter,
    compile_target_layers,
    resolve,
    use_kernel_cache,
)
from dflash.config import CompileConfig, ConfigError, load_config
from dflash.models.target import Target, build_hf_model
from dflash.training.trainer import Trainer

QWEN3 = {"model_type": "qwen3", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


def broken_backend(gm, example_inputs):
    raise RuntimeError("this backend always fails")


CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "DFLASH_KERNEL_CACHE")


@pytest.fixture(autouse=True)
def fresh_dynamo_and_cache_variables():
    """Each test starts with no compiled graphs and leaves the kernel-cache variables as it found them."""
    saved = {name: os.environ.get(name) for name in CACHE_VARIABLES}
    for name in CACHE_VARIABLES:
        os.environ.pop(name, None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def test_unset_pieces_compile_exactly_on_cuda():
    section = CompileConfig()
    assert resolve(section, torch.device("cpu")) == CompilePlan()
    on_gpu = resolve(section, torch.device("cuda"))
    assert on_gpu.target and on_gpu.drafter and on_gpu.flex and on_gpu.loss
    forced = resolve(CompileConfig(target=True, loss=False), torch.device("cuda"))
    assert forced.target and not forced.loss and forced.drafter


def test_config_section_and_the_moved_drafter_switch(write_config, tiny_dict):
    tiny_dict["compile"] = {"target": True, "drafter": None, "target_mode": "default"}
    config = load_config(write_config(tiny_dict))
    assert config.compile.target is True and config.compile.drafter is None
    with pytest.raises(ConfigError, match=r"'drafter.compile' has moved: set compile.drafter"):
        load_config(write_config(tiny_dict), ["drafter.compile=true"])
    with pytest.raises(ConfigError, match="compile.target: expected bool or null"):
        load_config(write_config(tiny_dict), ["compile.target=sometimes"])


def _target(spec=None):
    model = build_hf_model(None, dict(spec or QWEN3), "float32", seed=0)
    return Target(model, [1, 3])


def test_compiled_hybrid_target_layers_give_the_eager_features():
    """The layers of a hybrid target compile around their GatedDeltaNet mixers (here the PyTorch path: no
    fast kernels on the CPU), which stay eager: traced, the fast kernels were slower than eager."""
    from dflash.runtime.doctor import PROBE_HYBRID

    eager, compiled = _target(PROBE_HYBRID), _target(PROBE_HYBRID)
    mixers = [m for m in compiled.model.modules() if "GatedDeltaNet" in type(m).__name__]
    assert mixers
    traced = []
    for mixer in mixers:
        inner = mixer.forward

        def recording(*args, inner=inner, **kwargs):
            traced.append(torch.compiler.is_compiling())
            return inner(*args, **kwargs)
        mixer.forward = recording
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = torch.randint(0, PROBE_HYBRID["vocab_size"], (2, 16))
    reference = eager.features(ids)
    guard = compile_target_layers(compiled, mode="default", backend=counting_backend)
    out = compiled.features(ids)
    assert guard.failed is None
    assert torch.allclose(out, reference, atol=1e-4, rtol=1e-4)
    assert graphs, "the layers were not compiled"
    assert traced and not any(traced), "a GatedDeltaNet mixer ran inside a compiled graph"
    assert any("linear_attn" not in str(gm.graph) and "mlp" in str(gm.graph) for gm in graphs)


def test_compiled_target_layers_give_the_eager_features_and_stop_early():
    eager, compiled = _target(), _target()
    ids = torch.randint(0, 50, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # padding: the mask path runs compiled too
    reference = eager.features(ids, mask)
    guard = compile_target_layers(compiled, mode="default")
    calls = []
    for i, layer in enumerate(compiled.layers):
        layer.register_forward_pre_hook(lambda *_a, i=i: calls.append(i))
    out = compiled.features(ids, mask)
    assert guard.failed is None
    assert torch.allclose(out, reference, atol=1e-5, rtol=1e-5)
    assert calls == [0, 1, 2, 3]  # the deepest tapped layer's hook still ends the forward
    # outside `features` (decoding in the eval, regeneration) the layers are the eager ones
    assert all("forward" not in layer.__dict__ for layer in compiled.layers)
    with torch.no_grad(), compiled.capture_all():
        logits = compiled.model(input_ids=ids).logits
    assert logits.shape == (2, 16, 50)


def test_a_target_that_cannot_compile_runs_eagerly_with_one_log_line(caplog):
    target = _target()
    ids = torch.randint(0, 50, (1, 8))
    reference = target.features(ids)
    guard = compile_target_layers(target, mode="default", backend=broken_backend)
    with caplog.at_level(logging.WARNING, logger="dflash.compile"):
        first = target.features(ids)
        second = target.features(ids)
    assert torch.equal(first, reference) and torch.equal(second, reference)
    assert guard.failed and "this backend always fails" in guard.failed
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "target (its decoder layers) could not be compiled" in lines[0]
    assert "compile.target=false" in lines[0]


def test_an_error_of_the_computation_is_not_taken_for_a_compiler_error():
    target = _target()
    guard = compile_target_layers(target, mode="default")
    with pytest.raises(IndexError):
        target.features(torch.full((1, 4), 99))  # not a token of the vocabulary: fails eagerly too
    assert guard.failed is None


def test_a_drafter_that_cannot_compile_trains_eagerly(tiny_config, caplog):
    cfg = copy.deepcopy(tiny_config)
    trainer = Trainer(cfg).setup()
    reference = copy.deepcopy(trainer.drafter)
    guard = compile_drafter(trainer.drafter, mode="default", backend=broken_backend)
    with caplog.at_level(logging.WARNING, logger="dflash.compile"):
        _, stats = trainer.train_step()
    assert guard.failed and stats.loss == stats.loss
    assert any("drafter could not be compiled" in r.getMessage() for r in caplog.records)
    assert set(trainer.drafter.state_dict()) == set(reference.state_dict())  # same module, still savable


def test_trainer_with_a_compiled_target_matches_the_eager_trainer(tiny_config, tmp_path):
    losses = {}
    for compiled in (False, True):
        cfg = copy.deepcopy(tiny_config)
        cfg.output_dir = str(tmp_path / f"compiled-{compiled}")
        cfg.compile.target = compiled
        cfg.compile.target_mode = "default"
        cfg.compile.cache_dir = str(tmp_path / "kernels")
        trainer = Trainer(cfg).setup()
        losses[compiled] = [trainer.train_step()[1].loss for _ in range(3)]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
    assert (tmp_path / "kernels" / cache_key(torch.device("cpu")) / "inductor").is_dir()


def test_kernel_cache_is_keyed_and_stale_keys_go(tmp_path):
    root = tmp_path / "compile-cache"
    old = root / "torch-0.0.1-triton-none-cpu"  # an older torch's kernels, unused for two days
    (old / "inductor").mkdir(parents=True)
    in_use = root / "torch-0.0.2-triton-none-cpu"  # another node's key in a shared run directory: recent
    (in_use / "inductor").mkdir(parents=True)
    two_days_ago = time.time() - 2 * 86400
    for path in (old / "inductor", old):
        os.utime(path, (two_days_ago, two_days_ago))
    (root / "notes").mkdir()  # not ours: kept
    here = use_kernel_cache(root, torch.device("cpu"))
    assert here == root / cache_key(torch.device("cpu"))
    assert here.name.startswith(f"torch-{torch.__version__}-") and here.name.endswith("-cpu")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(here / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(here / "triton")
    assert sorted(p.name for p in root.iterdir()) == sorted([here.name, in_use.name, "notes"])
    # a restart finds the same folder with what it held
    (here / "inductor" / "kernel.bin").write_bytes(b"x")
    assert use_kernel_cache(root, torch.device("cpu")) == here and (here / "inductor" / "kernel.bin").exists()
    # an operator's own inductor cache directory wins
    del os.environ["DFLASH_KERNEL_CACHE"]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "operator")
    assert use_kernel_cache(root, torch.device("cpu")) == tmp_path / "operator"


def test_the_fallback_passes_other_errors_through():
    def fails(_x):
        raise ValueError("not a compiler problem")

    guard = EagerFallback("loss", fails, lambda x: x)
    with pytest.raises(ValueError):
        guard(1)
    assert guard.failed is None
