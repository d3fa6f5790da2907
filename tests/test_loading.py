"""Loading paths: exports that transformers loads (trust_remote_code), real target checkpoints from a plain
install (no accelerate), drafter.init_from, and one-line exit-2 errors for paths that hold no model.

Every model here is tiny and saved by the test itself (save_pretrained); nothing is downloaded.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dflash.cli import main
from dflash.components.export import export
from dflash.config import RunConfig, _build, validate
from dflash.errors import BadInput
from dflash.models.drafter import Drafter
from dflash.models.target import build_hf_model
from dflash.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "configs" / "tiny-cpu.yaml").read_text())

QWEN3 = {"model_type": "qwen3", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 512}
QWEN3_NEXT = {"model_type": "qwen3_next", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 0,
              "max_position_embeddings": 512,
              "layer_types": ["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"]}


def tiny_dict(output_dir: Path) -> dict:
    d = copy.deepcopy(TINY)
    d["output_dir"] = str(output_dir)
    d["data"]["synthetic"]["num_samples"] = 200
    d["data"].pop("regenerate", None)  # loading paths, not data: some setups here hold no target
    d["optim"]["max_steps"] = 2
    d["checkpoint"]["interval"] = 2
    d["logging"]["interval"] = 1
    return d


def build_config(d: dict) -> RunConfig:
    cfg = _build(RunConfig, copy.deepcopy(d), "")
    validate(cfg)
    return cfg


def write_yaml(path: Path, d: dict) -> Path:
    path.write_text(yaml.safe_dump(d))
    return path


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("dflash: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step tiny run and its exports: {'run': dir, 'float32': dir, 'bfloat16': dir, 'float16': dir}."""
    base = tmp_path_factory.mktemp("trained")
    Trainer(build_config(tiny_dict(base / "run"))).setup().run()
    out = {"run": base / "run"}
    for dtype in ("float32", "bfloat16", "float16"):
        out[dtype] = export(base / "run", base / f"export-{dtype}", dtype)
    return out


def checkpoint_state(run: Path) -> dict[str, torch.Tensor]:
    latest = sorted((run / "checkpoints").glob("step-*"))[-1]
    return load_file(str(latest / "model.safetensors"))


# ------------------------------------------------------------------------------------------------ export
def test_export_weights_are_the_checkpoints_bit_for_bit(trained):
    ckpt = checkpoint_state(trained["run"])
    assert all(v.dtype == torch.float32 for v in ckpt.values())
    for dtype in ("float32", "bfloat16", "float16"):
        exported = load_file(str(trained[dtype] / "model.safetensors"))
        assert exported.keys() == ckpt.keys()
        want = getattr(torch, dtype)
        for key, value in ckpt.items():
            assert exported[key].dtype == want, key
            assert torch.equal(exported[key], value.to(want)), (dtype, key)
    cfg = json.loads((trained["float32"] / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == 8
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3, 4]
    assert (trained["float32"] / "modeling_dflash.py").is_file()


def test_shipped_modeling_file_imports_only_torch_and_transformers():
    import ast

    source = (ROOT / "dflash" / "models" / "hf_remote" / "modeling_dflash.py").read_text()
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import in the shipped file"
            roots.add(node.module.split(".")[0])
    assert roots <= {"__future__", "inspect", "torch", "transformers"}, roots


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_loads_with_automodel_trust_remote_code(trained, dtype):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(trained[dtype]), trust_remote_code=True, dtype="auto")
    assert type(model).__name__ == "DFlashDraftModel"
    assert model.dtype == getattr(torch, dtype)
    assert (model.block_size, model.target_layer_ids) == (8, [1, 3, 4])
    exported = load_file(str(trained[dtype] / "model.safetensors"))
    state = model.state_dict()
    assert state.keys() == exported.keys()
    for key, value in exported.items():
        assert torch.equal(state[key], value), key


def test_remote_forward_equals_drafter_forward_for_a_block_at_an_anchor(trained):
    """The transformers model over [context before the anchor ; block] gives Drafter.forward's hidden states
    for that block, also when the context arrives in two calls through a KV cache (the decoding loop)."""
    from transformers import AutoModel, DynamicCache

    drafter = Drafter.load(trained["float32"]).eval()
    model = AutoModel.from_pretrained(str(trained["float32"]), trust_remote_code=True).eval()
    a = drafter.arch
    torch.manual_seed(0)
    embed = torch.nn.Embedding(a.vocab_size, a.hidden_size)
    seq, anchor, bs = 24, 11, a.block_size
    feats = torch.randn(2, seq, len(a.target_layer_ids) * a.hidden_size)
    block = torch.full((2, 1, bs), a.mask_token_id)
    block[:, 0, 0] = torch.tensor([17, 42])
    with torch.no_grad():
        want = drafter(feats, block, torch.tensor([[anchor], [anchor]]), embed)[:, 0]
        got = model(position_ids=torch.arange(anchor + bs)[None], noise_embedding=embed(block[:, 0]),
                    target_hidden=feats[:, :anchor])
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        cache, first = DynamicCache(), 5
        model(position_ids=torch.arange(first + bs)[None], noise_embedding=embed(block[:, 0]),
              target_hidden=feats[:, :first], past_key_values=cache, use_cache=True)
        cache.crop(-(cache.get_seq_length() - first))  # drop the block's keys, keep the context
        again = model(position_ids=torch.arange(first, anchor + bs)[None], noise_embedding=embed(block[:, 0]),
                      target_hidden=feats[:, first:anchor], past_key_values=cache, use_cache=True)
        torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-5)


def test_remote_spec_generate_is_lossless(trained):
    """spec_generate (z-lab's entry point) reproduces the target's greedy decoding: with a trained-for-2-steps
    drafter (acceptance 1 per round) and with drafter and target both forced to token 0 (every block accepted)."""
    from transformers import AutoModel

    target = build_hf_model(None, dict(TINY["target"]["random_init"]), "float32", seed=0).eval()
    model = AutoModel.from_pretrained(str(trained["float32"]), trust_remote_code=True).eval()
    for seed in range(3):
        ids = torch.randint(0, 96, (1, 6 + seed), generator=torch.Generator().manual_seed(seed))
        want = target.generate(ids, max_new_tokens=21, min_new_tokens=21, do_sample=False)
        got, accepted = model.spec_generate(target=target, input_ids=ids, max_new_tokens=21,
                                            return_acceptance=True)
        assert torch.equal(got, want)
        assert all(1 <= n <= model.block_size for n in accepted)
        stop = int(want[0, ids.shape[1] + 3])
        stopped = model.spec_generate(target=target, input_ids=ids, max_new_tokens=21, stop_token_ids=[stop])
        first = [i for i in range(ids.shape[1], want.shape[1]) if int(want[0, i]) == stop][0]
        assert torch.equal(stopped, want[:, :first + 1])
    with torch.no_grad():
        target.model.norm.weight.zero_()  # logits 0 everywhere: greedy token 0
        model.norm.weight.zero_()
    ids = torch.tensor([[5, 9, 11]])
    got, accepted = model.spec_generate(target=target, input_ids=ids, max_new_tokens=21, return_acceptance=True)
    assert torch.equal(got, target.generate(ids, max_new_tokens=21, min_new_tokens=21, do_sample=False))
    assert accepted[:-1] == [model.block_size] * (len(accepted) - 1)


# ------------------------------------------------------------------------------------------------ init_from
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_init_from_loads_the_exported_weights(trained, tmp_path, dtype):
    d = tiny_dict(tmp_path / "fine-tune")
    d["drafter"]["init_from"] = str(trained[dtype])
    trainer = Trainer(build_config(d)).setup()
    assert trainer.step == 0
    exported = load_file(str(trained[dtype] / "model.safetensors"))
    state = trainer.drafter.state_dict()
    assert state.keys() == exported.keys()
    for key, value in exported.items():
        assert state[key].dtype == torch.float32  # trained in float32 whatever the export's dtype
        assert torch.equal(state[key], value.float()), key
    trainer.train_step()


def test_init_from_a_run_directory_takes_its_newest_checkpoint(trained, tmp_path):
    d = tiny_dict(tmp_path / "again")
    d["drafter"]["init_from"] = str(trained["run"])
    trainer = Trainer(build_config(d)).setup(with_target=False)
    ckpt = checkpoint_state(trained["run"])
    assert all(torch.equal(trainer.drafter.state_dict()[k], v) for k, v in ckpt.items())


@pytest.mark.parametrize("override, message", [
    ({"drafter": {"block_size": 16}}, r"has block_size 8 but drafter.block_size is 16"),
    ({"target": {"layer_ids": [1, 2, 4]}},
     r"has target_layer_ids \[1, 3, 4\] but target.layer_ids \(resolved\) is \[1, 2, 4\]"),
    ({"drafter": {"mask_token_id": 7}}, r"has mask_token_id \d+ but drafter.mask_token_id is 7"),
    ({"drafter": {"num_layers": 3}}, r"has num_hidden_layers 2 but drafter.num_layers is 3"),
], ids=["block_size", "target_layer_ids", "mask_token_id", "num_layers"])
def test_init_from_that_disagrees_with_the_config_exits_2_naming_the_key(trained, tmp_path, capsys, override,
                                                                        message):
    import re

    d = tiny_dict(tmp_path / "run")
    d["drafter"]["init_from"] = str(trained["float32"])
    for section, values in override.items():
        d[section].update(values)
    assert main(["train", str(write_yaml(tmp_path / "run.yaml", d))]) == 2
    err = one_line_error(capsys)
    assert re.search(message, err), err
    assert "drafter.init_from '" in err


def test_init_from_a_missing_path_exits_2(tmp_path, capsys):
    d = tiny_dict(tmp_path / "run")
    d["drafter"]["init_from"] = str(tmp_path / "no-such-drafter")
    assert main(["train", str(write_yaml(tmp_path / "run.yaml", d))]) == 2
    err = one_line_error(capsys)
    assert "drafter.init_from" in err and "does not exist" in err


# ------------------------------------------------------------------------------------------------ target.path
def _path_target(d: dict, path: Path) -> dict:
    d["target"] = {"path": str(path), "dtype": "float32", "layer_ids": [1, 3, 4]}
    return d


@pytest.mark.parametrize("kind", ["empty", "garbage-config", "config-without-weights", "a-drafter-export"])
def test_target_path_that_holds_no_model_exits_2_with_one_line(trained, tmp_path, capsys, kind):
    bad = tmp_path / "model"
    bad.mkdir()
    if kind == "garbage-config":
        (bad / "config.json").write_text('{"hello": "world"}')
    elif kind == "config-without-weights":
        build_hf_model(None, dict(QWEN3), "float32").config.save_pretrained(bad)
    elif kind == "a-drafter-export":
        bad = trained["float32"]
    d = _path_target(tiny_dict(tmp_path / "run"), bad)
    assert main(["train", str(write_yaml(tmp_path / "run.yaml", d))]) == 2
    err = one_line_error(capsys)
    assert f"target.path '{bad}'" in err
    expected = {"empty": "holds no config.json", "garbage-config": "not a transformers model config",
                "config-without-weights": "could not be loaded as a causal LM",
                "a-drafter-export": "is a DFlash drafter, not a target model"}[kind]
    assert expected in err, err


def test_target_path_with_missing_weights_is_refused(tmp_path):
    from safetensors.torch import save_file

    model = build_hf_model(None, dict(QWEN3), "float32")
    model.save_pretrained(tmp_path / "m")
    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    state.pop("model.layers.2.mlp.up_proj.weight")
    save_file(state, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BadInput, match=r"lack 1 tensors .*model.layers.2.mlp.up_proj.weight"):
        build_hf_model(str(tmp_path / "m"), None, "float32")


def _save_checkpoint(kind: str, directory: Path) -> torch.nn.Module:
    """A tiny checkpoint as a user has it on disk; returns the model that was saved."""
    torch.manual_seed(0)
    if kind == "qwen3_5-vl":
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        text = {k: v for k, v in QWEN3_NEXT.items() if k not in ("model_type", "num_experts", "layer_types")}
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                  "patch_size": 4, "num_position_embeddings": 16}
        config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=90, video_token_id=91,
                               vision_start_token_id=92, vision_end_token_id=93)
        model = Qwen3_5ForConditionalGeneration(config)
    else:
        model = build_hf_model(None, dict(QWEN3 if kind == "qwen3" else QWEN3_NEXT), "float32", seed=0)
    model.save_pretrained(directory)
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_next-hybrid", "qwen3_5-vl"])
def test_saved_checkpoint_trains_through_target_path(tmp_path, kind):
    """target.path with a checkpoint saved by save_pretrained (a Qwen3.5 one wraps its decoder in a
    vision-language model) loads without accelerate, taps the right layers and trains a step."""
    from dflash.data.synthetic import build_tokenizer

    saved = _save_checkpoint(kind, tmp_path / "model")
    d = _path_target(tiny_dict(tmp_path / "run"), tmp_path / "model")
    if kind == "qwen3":  # the tokenizer from target.path, as with a real checkpoint
        build_tokenizer(64).save_pretrained(tmp_path / "model")
        d["tokenizer"] = {}
    trainer = Trainer(build_config(d)).setup()
    target = trainer.target
    assert target.num_layers == 6 and target.layer_ids == [1, 3, 4] and target.hidden_size == 64
    if kind == "qwen3_5-vl":
        assert type(target.model).__name__ == "Qwen3_5ForCausalLM"
        assert trainer.drafter.arch.num_target_layers == 6
    ids = torch.randint(0, 90, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = saved(input_ids=ids, output_hidden_states=True).hidden_states  # entry i+1: output of layer i
    torch.testing.assert_close(target.features(ids), torch.cat([hidden[i + 1] for i in (1, 3, 4)], dim=-1))
    _, result = trainer.train_step()
    assert trainer.step == 1 and result.loss == result.loss and result.tokens > 0
