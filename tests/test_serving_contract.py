"""The serving contract (dflash.models.serving_contract, `dflash export --check`): exports pass it; a planted wrong
field fails it naming the rule and the engine file the rule comes from; the known traps are warnings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.cli import main
from dflash.components.export import export
from dflash.errors import BadInput
from dflash.models.drafter import Drafter, DrafterArch
from dflash.models.serving_contract import check_export

D2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 3,
      "output_multiplier": 0.5, "final_logit_softcapping": 10.0}


def arch(**kw) -> DrafterArch:
    base = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=60, block_size=4, target_layer_ids=[1, 3],
                mask_token_id=59, rope_theta=10000.0, num_target_layers=6)
    base.update(kw)
    return DrafterArch(**base)


def exported(tmp_path: Path, name: str, a: DrafterArch, dtype: str = "bfloat16") -> Path:
    torch.manual_seed(0)
    ckpt = tmp_path / name / "checkpoints" / "step-00000001"
    Drafter(a).save(ckpt)
    return export(ckpt, tmp_path / f"{name}-export", dtype)


LAYOUTS = {
    "plain": {},
    "sliding": {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 8},
    "mixed": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
    "dflash2": {"layer_types": ["sliding_attention"] * 2, "sliding_window": 8, "is_causal": False, **D2},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_exports_and_passes_the_check(tmp_path, layout, capsys):
    out = exported(tmp_path, layout, arch(**LAYOUTS[layout]))
    errors, warnings = check_export(out)
    assert errors == []
    rules = {w.rule for w in warnings}
    assert ("vllm_v2_runner" in rules) == (layout == "mixed")
    assert ("logit_order" in rules) == (layout == "dflash2")
    assert "llama.cpp" in rules and "lm_head" not in rules
    assert main(["export", str(out), "--check"]) == 0
    assert "serving check passed" in capsys.readouterr().out


def _plant(out: Path, change) -> None:
    cfg = json.loads((out / "config.json").read_text())
    change(cfg)
    (out / "config.json").write_text(json.dumps(cfg))


def _weights(out: Path, change) -> None:
    state = load_file(str(out / "model.safetensors"))
    change(state)
    save_file(state, str(out / "model.safetensors"))


PLANTED = {
    "mask_token_id": (lambda c: c["dflash_config"].update(mask_token_id=60), "mask_token_id", "qwen3_dflash.py"),
    "architectures": (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "architectures", "registry.py"),
    "dflash2_arch": (lambda c: c.update(architectures=["DFlash2DraftModel"]), "architectures", "qwen3_dflash2.py"),
    "target_layer_ids": (lambda c: c["dflash_config"].update(target_layer_ids=[1, 6]), "target_layer_ids",
                         "dflash_utils.py"),
    "block_size": (lambda c: c.update(block_size=8), "block_size", "dflash_utils.py"),
    "rope": (lambda c: c["rope_parameters"].update(rope_theta=5.0), "rope", "qwen3_dflash.py"),
    "layer_types": (lambda c: c.update(layer_types=["sliding_attention"]), "layer_types", "qwen3_dflash.py"),
    "window": (lambda c: c.update(layer_types=["sliding_attention"] * 2, sliding_window=None), "sliding_window",
               "qwen3_dflash.py"),
    "hidden_act": (lambda c: c.update(hidden_act="gelu"), "hidden_act", "models/dflash.py"),
    "dtype": (lambda c: c.update(dtype="float16"), "dtype", "qwen3_dflash.py"),
    "model_type": (lambda c: c.update(model_type="llama"), "model_type", "qwen3_dflash.py"),
    "num_hidden_layers": (lambda c: c.update(num_hidden_layers=3), "layer_types", "qwen3_dflash.py"),
    "weight_names": (lambda c: c.update(num_hidden_layers=3, layer_types=None), "weights", "dflash/model.py"),
    "intermediate_size": (lambda c: c.update(intermediate_size=64), "weights", "qwen3_dflash.py"),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_a_planted_wrong_field_fails_naming_the_rule_and_its_source(tmp_path, name, capsys):
    out = exported(tmp_path, "plain", arch())
    change, rule, source = PLANTED[name]
    _plant(out, change)
    errors, _ = check_export(out)
    assert errors, name
    assert any(e.rule == rule and source in e.source for e in errors), [str(e) for e in errors]
    assert main(["export", str(out), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"[{rule}]" in err and source in err


def test_planted_weights_fail_and_a_draft_lm_head_is_a_warning(tmp_path):
    out = exported(tmp_path, "d2", arch(**LAYOUTS["dflash2"]))
    _weights(out, lambda s: s.update({"layers.0.mlp_conv.base_kernel": torch.zeros(2, 3, 32, dtype=torch.bfloat16)}))
    errors, _ = check_export(out)
    assert [e.rule for e in errors] == ["weights"] and "mlp_conv.base_kernel" in str(errors[0])
    out2 = exported(tmp_path, "head", arch())
    _weights(out2, lambda s: s.update({"lm_head.weight": torch.zeros(60, 32, dtype=torch.bfloat16)}))
    errors, warnings = check_export(out2)
    assert errors == [] and "lm_head" in {w.rule for w in warnings}
    _weights(out2, lambda s: s.update({"layers.0.mlp.up_proj.weight": s["layers.0.mlp.up_proj.weight"].float()}))
    assert [e.rule for e in check_export(out2)[0]] == ["dtype"]


def test_the_check_runs_inside_export_and_a_failing_one_leaves_nothing(tmp_path, monkeypatch):
    import dflash.models.drafter as drafter_module

    real = drafter_module.DrafterArch.to_hf_config

    def broken(self):
        cfg = real(self)
        cfg["dflash_config"]["mask_token_id"] = 10_000
        return cfg

    monkeypatch.setattr(drafter_module.DrafterArch, "to_hf_config", broken)
    torch.manual_seed(0)
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000001"
    Drafter(arch()).save(ckpt)
    with pytest.raises(BadInput, match=r"\[mask_token_id\].*qwen3_dflash.py"):
        export(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_check_of_a_directory_without_weights_exits_2(tmp_path, capsys):
    out = exported(tmp_path, "plain", arch())
    shutil.copytree(out, tmp_path / "copy")
    (tmp_path / "copy" / "model.safetensors").unlink()
    assert main(["export", str(tmp_path / "copy"), "--check"]) == 2
    assert "[files]" in capsys.readouterr().err


def test_a_released_layout_dflash2_directory_passes_and_warm_starts(tmp_path, capsys):
    """z-lab's published DFlash2 config.json, every key kept, scaled down to a tiny geometry, with bf16 weights of the
    published names: `dflash export --check` passes (a one-spelling RoPE is a warning) and init_from loads it."""
    from dflash.components.export import load_init_drafter
    from dflash.models.serving_contract import expected_shapes

    released = json.loads((Path(__file__).parent / "data" / "dflash2-released-config.json").read_text())
    cfg = {**released, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 60, "num_hidden_layers": 2,
           "layer_types": ["sliding_attention"] * 2, "max_window_layers": 2, "num_target_layers": 6,
           "dflash_config": {**released["dflash_config"], "target_layer_ids": [1, 3], "mask_token_id": 59,
                             "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 3}}
    directory = tmp_path / "released"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    save_file({k: torch.randn(shape).bfloat16() for k, shape in expected_shapes(cfg).items()},
              str(directory / "model.safetensors"))
    errors, warnings = check_export(directory)
    assert errors == [] and "rope" in {w.rule for w in warnings}
    assert main(["export", str(directory), "--check"]) == 0
    drafter = load_init_drafter(directory, {"block_size": ("drafter.block_size", 16)})
    assert drafter.arch.dflash2 and drafter.arch.selector_top_k == 3 and drafter.arch.rope_theta == 500000.0
    assert drafter.arch.final_logit_softcapping == 20.0 and drafter.arch.is_causal is False
    state = load_file(str(directory / "model.safetensors"))
    assert all(torch.equal(drafter.state_dict()[k], v.float()) for k, v in state.items())
