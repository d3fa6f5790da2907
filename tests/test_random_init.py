"""A random-init target is the same model on every device: small ones are drawn on the CPU, then moved.

On 2026-12-04 the demo recipe trained on a GPU reached a real acceptance length of 3.7 against 6.7 on the CPU:
its target, drawn by the GPU's generator, was another model, answering the prompts differently (every one of
1900 regenerated answers differed). A drafter trained on a GPU and evaluated on a CPU met a stranger."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

import dflash.models.target as target_mod
from dflash.models.target import build_hf_model

TINY = {"model_type": "qwen3", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "max_position_embeddings": 128}


def _drawn_on(monkeypatch) -> list[str]:
    """The default device at each model built from its config (the first: the size, on the meta device)."""
    seen = []
    original = AutoModelForCausalLM.from_config

    def spy(config, **kwargs):
        seen.append(torch.get_default_device().type)
        return original(config, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", spy)
    return seen


def test_a_small_random_target_is_drawn_on_the_cpu_whatever_the_run_device(monkeypatch):
    seen = _drawn_on(monkeypatch)
    model = build_hf_model(None, dict(TINY), "float32", seed=3, device="meta")
    assert seen == ["meta", "cpu"]  # drawn by the CPU's generator...
    assert next(model.parameters()).device.type == "meta"  # ...then moved to the run's device


def test_a_large_random_target_is_drawn_on_the_run_device(monkeypatch):
    monkeypatch.setattr(target_mod, "RANDOM_INIT_CPU_MAX_PARAMS", 1000)
    seen = _drawn_on(monkeypatch)
    build_hf_model(None, dict(TINY), "float32", seed=3, device="meta")
    assert seen == ["meta", "meta"]


def test_the_same_seed_gives_the_same_weights_and_leaves_the_callers_generator_alone():
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a = build_hf_model(None, dict(TINY), "float32", seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = build_hf_model(None, dict(TINY), "float32", seed=3)
    c = build_hf_model(None, dict(TINY), "float32", seed=4)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert any(not torch.equal(pa[k], pc[k]) for k in pa)
