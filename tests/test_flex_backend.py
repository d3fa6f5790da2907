"""compile.flex_backend: which kernels run the drafter's flex_attention, and what happens when FlashAttention-4's
cannot. The kernels themselves need a Hopper GPU (bench/flex_tiles.py, bench/gpu_bench.py, docs/PERFORMANCE.md);
here the choice, its start-up check's verdicts and the fallback are exercised with the GPU's answers faked."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import dflash.compile as compile_mod
import dflash.models.attention as attention
import dflash.training.drafter_setup as drafter_setup
from dflash.config import CompileConfig, ConfigError, load_config
from dflash.errors import BadInput
from dflash.training.trainer import Trainer

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def hopper_with_flash(monkeypatch):
    """A machine whose GPU 0 is sm_90 and whose flash-attn-4 is importable (as far as dflash can tell)."""
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability["value"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    version = {"value": "4.0.0b5"}
    monkeypatch.setattr(compile_mod, "flash_version", lambda: version["value"])
    monkeypatch.setattr(drafter_setup, "flash_version", lambda: version["value"])
    return SimpleNamespace(capability=capability, version=version)


def test_auto_picks_flash_only_where_it_can_run(hopper_with_flash):
    assert attention.resolve_flex_backend("auto", CUDA0, 128) == ("flash", None)
    assert attention.resolve_flex_backend("auto", CUDA0, 64)[0] == "triton"  # not measured: not chosen
    backend, why = attention.resolve_flex_backend("auto", CUDA0, 16)  # the tiny recipe's drafter
    assert backend == "triton" and "head_dim is 16" in why
    hopper_with_flash.capability["value"] = (8, 0)
    backend, why = attention.resolve_flex_backend("auto", CUDA0, 128)
    assert backend == "triton" and "sm_80" in why and "Hopper" in why
    hopper_with_flash.capability["value"] = (10, 0)  # Blackwell: newer is fine
    assert attention.resolve_flex_backend("auto", CUDA0, 128) == ("flash", None)
    hopper_with_flash.version["value"] = None
    backend, why = attention.resolve_flex_backend("auto", CUDA0, 128)
    assert backend == "triton" and "flash-attn-4 is not installed" in why and "dflash-trainer[flash]" in why
    backend, why = attention.resolve_flex_backend("auto", torch.device("cpu"), 128)
    assert backend == "triton" and "on cpu" in why
    assert attention.resolve_flex_backend("triton", CUDA0, 128)[0] == "triton"


def test_flash_asked_for_where_it_cannot_run_is_refused_naming_the_reason(hopper_with_flash):
    hopper_with_flash.version["value"] = None
    with pytest.raises(BadInput, match=r"compile.flex_backend=flash but flash-attn-4 is not installed .*"
                                       r"compile.flex_backend=auto"):
        attention.resolve_flex_backend("flash", CUDA0, 128)
    with pytest.raises(BadInput, match=r"expected one of auto, triton, flash"):
        attention.resolve_flex_backend("cute", CUDA0, 128)


def test_config_refuses_an_unknown_backend_and_tiles_with_flash(write_config, tiny_dict):
    assert CompileConfig().flex_backend == "auto"
    tiny_dict["compile"] = {"flex_backend": "cutlass"}
    with pytest.raises(ConfigError, match="flex_backend"):
        load_config(write_config(tiny_dict))
    tiny_dict["runtime"]["device"] = "cuda"  # what flash needs (validation does not look for the GPU)
    tiny_dict["compile"] = {"flex_backend": "flash", "flex_kernel_options": {"bwd_num_warps": 4}}
    with pytest.raises(ConfigError, match=r"compile.flex_kernel_options sets Triton tiles but "
                                          r"compile.flex_backend is flash"):
        load_config(write_config(tiny_dict))
    tiny_dict["compile"] = {"flex_backend": "triton", "flex_kernel_options": {"bwd_num_warps": 4}}
    assert load_config(write_config(tiny_dict)).compile.flex_backend == "triton"


def _fake_trainer(backend: str, kernel_options=None):
    from dflash.models.drafter import DrafterArch

    arch = DrafterArch(hidden_size=4096, intermediate_size=12288, num_hidden_layers=3, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=1000, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=4096, block_size=16, target_layer_ids=[1], mask_token_id=5,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                       sliding_window=64)
    return SimpleNamespace(config=SimpleNamespace(compile=CompileConfig(flex_backend=backend,
                                                                        flex_kernel_options=kernel_options)),
                           drafter=SimpleNamespace(arch=arch), device=CUDA0)


def _flex_kernel_options(trainer, mode: str) -> dict:
    """The kernel options the trainer's drafter setup picks for `trainer`'s config, drafter and device."""
    return drafter_setup.flex_kernel_options(trainer.config.compile, trainer.drafter.arch, trainer.device, mode)


def test_trainer_uses_flash_when_its_check_passes_and_triton_with_one_warning_when_not(hopper_with_flash,
                                                                                      monkeypatch, caplog):
    verdict = {"value": None}
    calls = []

    def probe(mode, heads, kv_heads, head_dim, block_size, device, layers):
        calls.append((mode, heads, kv_heads, head_dim, block_size, device, set(layers)))
        return verdict["value"]

    monkeypatch.setattr(drafter_setup, "probe_flash", probe)
    caplog.set_level(logging.INFO, logger="dflash")
    assert _flex_kernel_options(_fake_trainer("auto"), "default") == {"BACKEND": "FLASH"}
    # checked at the drafter's own head layout and each of its layer layouts
    assert calls == [("default", 32, 8, 128, 16, CUDA0, {attention.LayerMask(64, True), attention.FULL})]
    assert "flex_attention on FlashAttention-4's kernels (flash-attn-4 4.0.0b5" in caplog.text

    caplog.clear()
    verdict["value"] = "its result differs from the Triton kernels' by 3.00e-01 (relative), above 2e-02"
    options = _flex_kernel_options(_fake_trainer("auto"), "default")
    assert options == attention.TUNED_FLEX_OPTIONS[((9, 0), 128)]  # the measured Triton tiles
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "failed their start-up check (its result differs" in warnings[0].getMessage()
    assert "compile.flex_backend=triton" in warnings[0].getMessage()

    calls.clear()
    caplog.clear()
    assert _flex_kernel_options(_fake_trainer("triton", {"bwd_num_warps": 8}), "default") == {
        "bwd_num_warps": 8}
    assert calls == []  # no check when Triton is asked for
    assert "(Triton: compile.flex_backend=triton)" in caplog.text


def test_flash_options_fall_back_to_triton_with_the_flash_fix_named(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **_kwargs: fn)
    monkeypatch.setattr(attention, "_COMPILED_FLEX", {})
    guarded = attention.compiled_flex_attention("default", attention.FLASH_OPTIONS)
    assert "compile.flex_backend=triton" in guarded.then
    assert guarded.eager is attention.compiled_flex_attention("default")


def test_the_kernel_cache_key_names_flash_attn_4(monkeypatch):
    monkeypatch.setattr(compile_mod, "flash_version", lambda: None)
    without = compile_mod.cache_key(torch.device("cpu"))
    monkeypatch.setattr(compile_mod, "flash_version", lambda: "4.0.0b5")
    assert compile_mod.cache_key(torch.device("cpu")) == without.replace("-cpu", "-fa4-4.0.0b5-cpu")


def test_flash_version_is_none_without_the_package():
    # this machine's venv has no flash-attn-4: the CuTe DSL kernels are not importable
    assert compile_mod.flash_version() is None


def test_the_start_up_check_compares_flash_with_triton_forward_and_backward(monkeypatch):
    """probe_flash's verdicts, with both kernels replaced by CPU attention: agree, differ, or fail to build."""
    import torch.nn.functional as F

    behaviour = {"flash": "same"}

    def kernels(mode, options):
        def run(q, k, v, block_mask, enable_gqa):
            assert block_mask.shape[-2:] == (8 * 16, 256 + 8 * 16)  # the drafter's mask at the probe's size
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=enable_gqa)
            if options is not None:  # the FLASH build
                if behaviour["flash"] == "raise":
                    raise RuntimeError("BACKEND='FLASH' but flash attention cannot be used: no cute")
                if behaviour["flash"] == "wrong":
                    out = out * 1.5
            return out.to(q.dtype)
        return run

    monkeypatch.setattr(attention, "_compiled_flex_unguarded", kernels)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    cpu = torch.device("cpu")
    assert attention.probe_flash("default", 4, 2, 64, 16, cpu) is None
    sliding = attention.LayerMask(32, True)
    assert attention.probe_flash("default", 4, 2, 64, 16, cpu, (sliding, attention.FULL, sliding)) is None
    behaviour["flash"] = "wrong"
    assert "differs from the Triton kernels' by 5.0" in attention.probe_flash("default", 4, 2, 64, 16, cpu)
    behaviour["flash"] = "raise"
    assert attention.probe_flash("default", 4, 2, 64, 16, cpu) == (
        "RuntimeError: BACKEND='FLASH' but flash attention cannot be used: no cute")


def test_flash_asked_for_on_a_run_without_compiled_flex_is_refused(tiny_config, write_config, tiny_dict):
    import copy

    tiny_dict["compile"] = {"flex_backend": "flash"}  # the tiny config runs on the CPU
    with pytest.raises(ConfigError, match=r"compile.flex_backend=flash but runtime.device is cpu \(Flash"):
        load_config(write_config(tiny_dict))
    tiny_dict["runtime"]["device"] = "cuda"
    tiny_dict["drafter"]["attention"] = "sdpa"
    tiny_dict["compile"]["flex"] = False
    with pytest.raises(ConfigError, match=r"but drafter.attention is sdpa and compile.flex is false"):
        load_config(write_config(tiny_dict))
    cfg = copy.deepcopy(tiny_config)  # what the config cannot know (runtime.device auto on a machine without
    cfg.compile.flex_backend = "flash"  # a GPU): refused when the trainer builds the drafter
    cfg.runtime.device = "auto"
    with pytest.raises(BadInput, match=r"compile.flex_backend=flash but this run's drafter attention is not "
                                       r"compiled flex_attention \(sdpa on cpu"):
        Trainer(cfg).setup()
