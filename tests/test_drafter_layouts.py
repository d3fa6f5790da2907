"""Drafter attention layouts (full / sliding layers), scaled RoPE and foreign config.json keys: the training masks
(dense and flex) against a hand-built reference, the eval path and the exported modeling file against training,
a scaled-down SpecForge Qwen3.6-27B drafter through init_from, training and export (issue 30, items 1-4)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from dflash.cli import main
from dflash.components.export import export
from dflash.config import RunConfig, _build, validate
from dflash.errors import ConfigError
from dflash.evaluation.speculative import DrafterSession
from dflash.models.attention import FULL, LayerMask, dense_mask, flex_block_mask, visible
from dflash.models.drafter import Drafter, DrafterArch, arch_rope_cos_sin

ROOT = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "configs" / "tiny-cpu.yaml").read_text())
SLIDING = ["sliding_attention", "full_attention"]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def tiny_arch(**kw) -> DrafterArch:
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=50, block_size=4, target_layer_ids=[1, 3],
                mask_token_id=49, rope_theta=10000.0, max_position_embeddings=128)
    base.update(kw)
    return DrafterArch(**base)


def drafter_of(**kw) -> Drafter:
    torch.manual_seed(0)
    return Drafter(tiny_arch(**kw)).eval()


def inputs(arch: DrafterArch, seq: int = 16):
    torch.manual_seed(1)
    embed = torch.nn.Embedding(arch.vocab_size, arch.hidden_size)
    feats = torch.randn(2, seq, len(arch.target_layer_ids) * arch.hidden_size)
    block_ids = torch.randint(0, 49, (2, 3, arch.block_size))
    block_ids[:, :, 1:] = arch.mask_token_id
    anchors = torch.tensor([[2, 9, 13], [5, 11, 0]])  # the last slot of row 1 is empty (anchor 0)
    return embed, feats, block_ids, anchors


def reference_visible(ctx_len: int, block_size: int, anchors: list[int], window: int | None, causal: bool):
    """The rule written out per (query, key) from the serving engines' definition (dflash.models.attention):
    query at block offset o of the block anchored at a has position p = a + o; a context key k is visible when
    k < a and p - k < window; a key of its own block at offset j when j <= o (causal) and |o - j| < window."""
    rows = []
    for a in anchors:
        for o in range(block_size):
            p = a + o
            row = [k < a and (window is None or p - k < window) for k in range(ctx_len)]
            for blk in range(len(anchors)):
                for j in range(block_size):
                    ok = blk == anchors.index(a) and (not causal or j <= o)
                    if window is not None:
                        ok = ok and o - j < window and (causal or j - o < window)
                    row.append(ok)
            rows.append(row)
    return torch.tensor(rows)


# ------------------------------------------------------------------------------------------------ the masks
def test_sliding_mask_equals_the_hand_built_mask():
    """Context 6, blocks of 3 at anchors 2 and 5, window 2 (smaller than the sequence), causal (a sliding
    layer's default): each query sees itself and the one key before it, nothing of the context beyond."""
    got = dense_mask(torch.tensor([[2, 5]]), ctx_len=6, block_size=3, layer=LayerMask(2, True))[0, 0].int().tolist()
    expected = [
        # ctx 0..5          block 0   block 1
        [0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0],  # block 0, offset 0 (position 2): context 1, itself
        [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],  # offset 1 (position 3): offsets 0-1
        [0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0],  # offset 2: offsets 1-2 (the window bites inside the block)
        [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],  # block 1, offset 0 (position 5): context 4, itself
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1],
    ]
    assert got == expected


@pytest.mark.parametrize("window,causal", [(3, True), (3, False), (6, True), (1, True), (20, False), (None, True)])
def test_dense_mask_equals_the_written_out_rule(window, causal):
    anchors = [3, 7, 12]
    got = dense_mask(torch.tensor([anchors]), ctx_len=14, block_size=4, layer=LayerMask(window, causal))[0, 0]
    assert torch.equal(got, reference_visible(14, 4, anchors, window, causal))


def test_full_layer_mask_is_the_papers_mask():
    anchors = [3, 7, 12]
    assert torch.equal(dense_mask(torch.tensor([anchors]), 14, 4)[0, 0], reference_visible(14, 4, anchors, None, False))
    assert tiny_arch().layer_mask(0) == tiny_arch(layer_types=["full_attention"] * 2).layer_mask(1) == FULL


@pytest.mark.parametrize("tile", [128, 16])
@pytest.mark.parametrize("layer", [LayerMask(5, True), LayerMask(5, False), LayerMask(40, True), LayerMask(2, False),
                                   LayerMask(None, True)])
@pytest.mark.parametrize("ctx_len,m,block_size", [(12, 3, 4), (300, 20, 16), (1000, 7, 8)])
def test_structural_sliding_block_mask_equals_create_block_mask(ctx_len, m, block_size, tile, layer):
    """flex_block_mask's tiles from the interval structure equal create_block_mask evaluating `visible`."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(ctx_len + m)
    anchors = torch.stack([torch.randint(1, ctx_len, (m,), generator=g).sort().values for _ in range(2)])
    anchors[1, m // 2:] = 0  # empty anchor slots
    ours = flex_block_mask(anchors, ctx_len, block_size, tile, layer=layer)

    def mask_mod(bi, _h, q_idx, kv_idx):
        return visible(q_idx, kv_idx, anchors[bi], ctx_len, block_size, layer)

    ref = create_block_mask(mask_mod, 2, None, m * block_size, ctx_len + m * block_size, device="cpu",
                            BLOCK_SIZE=tile)
    for num in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(ours, num), getattr(ref, num)), num
    assert torch.equal(ours.to_dense(), ref.to_dense())


# ------------------------------------------------------------------------------------------------ the drafter
def test_flex_equals_dense_on_a_sliding_layout():
    drafter = drafter_of(layer_types=SLIDING, sliding_window=3)
    embed, feats, block_ids, anchors = inputs(drafter.arch)
    with torch.no_grad():
        dense = drafter(feats, block_ids, anchors, embed, "sdpa")
        flex = drafter(feats, block_ids, anchors, embed, "flex")
    torch.testing.assert_close(flex, dense, atol=1e-4, rtol=1e-4)


def test_a_compiled_sliding_drafter_breaks_only_at_the_eager_block_masks():
    """As the full drafter (tests/test_attention_and_drafter.py): the BlockMasks of all layouts are built in one
    eager call, the rest of the forward is one graph, and it computes the eager forward."""
    from torch.nn.attention.flex_attention import flex_attention

    drafter = drafter_of(layer_types=SLIDING, sliding_window=3)
    embed, feats, block_ids, anchors = inputs(drafter.arch)
    flex = torch.compile(flex_attention, backend="eager")
    with torch.no_grad():
        explained = torch._dynamo.explain(drafter.forward)(feats, block_ids, anchors, embed, "flex", flex)
        reasons = [r.reason for r in explained.break_reasons]
        assert explained.graph_break_count == 1 and "flex_block_masks" in reasons[0], reasons
        torch._dynamo.reset()
        compiled = torch.compile(drafter.forward, backend="aot_eager")
        out = compiled(feats, block_ids, anchors, embed, "flex", flex)
        torch.testing.assert_close(out, drafter(feats, block_ids, anchors, embed, "sdpa"), atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()


def test_sliding_layer_sees_only_its_window():
    """A change to context positions outside every query's window leaves the block unchanged; inside, not."""
    drafter = drafter_of(layer_types=["sliding_attention"] * 2, sliding_window=3)
    embed, feats, block_ids, anchors = inputs(drafter.arch)
    with torch.no_grad():
        base = drafter(feats, block_ids, anchors, embed)
        far = feats.clone()
        far[0, :9 - 2] += 1.0  # block 1 (anchor 9) sees context 7, 8 at most (offset 0: p - k < 3)
        out = drafter(far, block_ids, anchors, embed)
        assert torch.equal(out[0, 1], base[0, 1])
        near = feats.clone()
        near[0, 8] += 1.0
        assert not torch.allclose(drafter(near, block_ids, anchors, embed)[0, 1], base[0, 1])


def test_an_all_full_layout_is_unchanged_bit_for_bit():
    default = drafter_of()
    explicit = drafter_of(layer_types=["full_attention"] * 2)
    embed, feats, block_ids, anchors = inputs(default.arch)
    with torch.no_grad():
        assert torch.equal(default(feats, block_ids, anchors, embed), explicit(feats, block_ids, anchors, embed))
    cfg = explicit.arch.to_hf_config()
    assert (cfg["layer_types"], cfg["sliding_window"], cfg["use_sliding_window"]) == (["full_attention"] * 2, None,
                                                                                       False)
    assert DrafterArch.from_hf_config(cfg).layer_types is None


@pytest.mark.parametrize("layout", [dict(), dict(layer_types=SLIDING, sliding_window=3),
                                    dict(layer_types=["sliding_attention"] * 2, sliding_window=2, rope_scaling=YARN)])
def test_eval_session_computes_the_training_forward(layout):
    """speculative decoding's drafter (context K/V cached, one block at the cache's end) gives the hidden states
    the training forward gives for a block at that anchor: the same masks, the same RoPE."""
    drafter = drafter_of(**layout)
    embed, feats, _, _ = inputs(drafter.arch)
    a = drafter.arch
    target = SimpleNamespace(embed_tokens=embed, lm_head=torch.nn.Linear(a.hidden_size, a.vocab_size, bias=False))
    session = DrafterSession(drafter, target)
    anchor = 11
    session.append(feats[0, :6])
    session.append(feats[0, 6:anchor])
    block = torch.full((a.block_size,), a.mask_token_id)
    block[0] = 7
    with torch.no_grad():
        got = session.hidden(block)
        want = drafter(feats[:1], block[None, None], torch.tensor([[anchor]]), embed)[0, 0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ export
def exported(drafter: Drafter, tmp_path: Path) -> Path:
    drafter.save(tmp_path / "ckpt")
    return export(tmp_path / "ckpt", tmp_path / "out", "float32")


@pytest.mark.parametrize("layout", [dict(layer_types=SLIDING, sliding_window=3),
                                    dict(layer_types=["sliding_attention"] * 2, sliding_window=2, is_causal=False),
                                    dict(rope_scaling=YARN)])
def test_export_then_the_exported_modeling_file_gives_the_same_logits(tmp_path, layout):
    from transformers import AutoModel, DynamicCache

    drafter = drafter_of(**layout)
    out = exported(drafter, tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    a = drafter.arch
    assert cfg["layer_types"] == [a.layer_type(i) for i in range(2)]
    assert cfg["sliding_window"] == a.sliding_window and cfg["use_sliding_window"] == bool(a.sliding_window)
    assert cfg["max_window_layers"] == (0 if layout.get("layer_types") == ["sliding_attention"] * 2 else 2)
    assert cfg["rope_theta"] == a.rope_theta and cfg["rope_scaling"] == a.rope_scaling
    assert cfg["rope_parameters"] == {**(a.rope_scaling or {"rope_type": "default"}), "rope_theta": a.rope_theta}
    assert Drafter.load(out).arch == a

    model = AutoModel.from_pretrained(str(out), trust_remote_code=True).eval()
    embed, feats, _, _ = inputs(a, seq=24)
    head = torch.nn.Linear(a.hidden_size, a.vocab_size, bias=False)
    anchor, bs = 13, a.block_size
    block = torch.full((2, 1, bs), a.mask_token_id)
    block[:, 0, 0] = torch.tensor([17, 42])
    with torch.no_grad():
        want = head(drafter(feats, block, torch.tensor([[anchor], [anchor]]), embed)[:, 0])
        got = head(model(position_ids=torch.arange(anchor + bs)[None], noise_embedding=embed(block[:, 0]),
                         target_hidden=feats[:, :anchor]))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        cache, first = DynamicCache(), 5  # the decoding loop: context in two calls through the KV cache
        model(position_ids=torch.arange(first + bs)[None], noise_embedding=embed(block[:, 0]),
              target_hidden=feats[:, :first], past_key_values=cache, use_cache=True)
        cache.crop(-(cache.get_seq_length() - first))
        again = head(model(position_ids=torch.arange(first, anchor + bs)[None], noise_embedding=embed(block[:, 0]),
                           target_hidden=feats[:, first:anchor], past_key_values=cache, use_cache=True))
        torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ RoPE scaling
def test_yarn_rope_is_transformers_rope_and_is_not_dropped():
    """The drafter's yarn rotation is transformers' Qwen3RotaryEmbedding's on the same config, and changes the
    forward (the scaling is applied, not dropped)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    arch = tiny_arch(rope_scaling=YARN)
    config = Qwen3Config(hidden_size=32, num_attention_heads=4, head_dim=8, max_position_embeddings=128,
                         rope_parameters={**YARN, "rope_theta": 10000.0})
    positions = torch.arange(100)[None]
    cos_ref, sin_ref = Qwen3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = arch_rope_cos_sin(arch, positions, torch.float32)
    assert torch.equal(cos[:, 0], cos_ref) and torch.equal(sin[:, 0], sin_ref)
    plain, scaled = drafter_of(), drafter_of(rope_scaling=YARN)
    embed, feats, block_ids, anchors = inputs(plain.arch)
    with torch.no_grad():
        assert not torch.allclose(plain(feats, block_ids, anchors, embed), scaled(feats, block_ids, anchors, embed))


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is not implemented"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "rope_type 'longrope'"),
])
def test_a_dynamic_rope_is_refused_naming_the_key(rope, message):
    cfg = tiny_arch().to_hf_config()
    cfg["rope_scaling"] = rope
    cfg.pop("rope_parameters")
    with pytest.raises(ConfigError, match=message):
        DrafterArch.from_hf_config(cfg)


def test_both_rope_spellings_are_read_and_must_agree():
    cfg = tiny_arch().to_hf_config()
    cfg.pop("rope_scaling")
    cfg.pop("rope_theta")
    cfg["rope_parameters"] = {**YARN, "rope_theta": 5e5}
    arch = DrafterArch.from_hf_config(cfg)
    assert (arch.rope_theta, arch.rope_scaling) == (5e5, YARN)
    cfg["rope_scaling"] = {**YARN, "factor": 8.0}
    with pytest.raises(ConfigError, match="rope_parameters .* and rope_scaling .* disagree"):
        DrafterArch.from_hf_config(cfg)


def test_rope_parameters_beside_a_yarn_rope_scaling_rotates_as_transformers_reads_the_file(tmp_path, caplog):
    """transformers 5 reads `rope_scaling` in place of `rope_parameters` (its rope_theta then comes from the
    scaling or the top level, else 10000): the drafter's cos/sin equal those of transformers' own rotary embedding
    for that config.json, not a yarn with the other spelling's theta; a warning names the theta not used."""
    import logging

    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg = tiny_arch().to_hf_config()
    cfg.pop("rope_theta")
    cfg["rope_parameters"], cfg["rope_scaling"] = {"rope_type": "default", "rope_theta": 1e7}, dict(YARN)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING):
        arch = DrafterArch.from_hf_config(cfg)
    assert any("rope_parameters.rope_theta 10000000.0 is not used" in r.getMessage() for r in caplog.records)
    assert (arch.rope_theta, arch.rope_scaling) == (10000.0, YARN)
    theirs = AutoConfig.from_pretrained(str(tmp_path))
    positions = torch.arange(100)[None]
    cos_ref, sin_ref = Qwen3RotaryEmbedding(theirs)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = arch_rope_cos_sin(arch, positions, torch.float32)
    torch.testing.assert_close((cos[:, 0], sin[:, 0]), (cos_ref, sin_ref), rtol=0, atol=1e-6)
    other = dataclasses.replace(arch, rope_theta=1e7)  # the reading this replaced: yarn with the dropped theta
    assert (arch_rope_cos_sin(other, positions, torch.float32)[0][:, 0] - cos_ref).abs().max() > 0.5
    again = DrafterArch.from_hf_config(arch.to_hf_config())  # the export writes it one way
    assert (again.rope_theta, again.rope_scaling) == (arch.rope_theta, arch.rope_scaling)
    cfg["rope_theta"] = 5e5  # beside a rope_theta in the scaling read: transformers 5 and 4.x would differ
    cfg["rope_scaling"] = {**YARN, "rope_theta": 1e6}
    with pytest.raises(ConfigError, match=r"rope_theta 500000.0 and rope_scaling.rope_theta 1000000.0 disagree "
                                          r"\(transformers 5 reads 1000000.0, transformers 4.x and SGLang 500000.0\)"):
        DrafterArch.from_hf_config(cfg)


def test_a_target_with_both_rope_spellings_is_read_by_transformers_and_its_yarn_refused():
    """The target's config goes through transformers itself: the same two spellings are its yarn (theta 10000),
    which the drafter cannot copy from a target: refused naming it, never trained as plain RoPE with 1e7."""
    from dflash.errors import BadInput
    from dflash.models.target import target_config

    spec = {**TINY["target"]["random_init"], "rope_parameters": {"rope_type": "default", "rope_theta": 1e7},
            "rope_scaling": dict(YARN)}
    with pytest.raises(BadInput, match="rope_type 'yarn'"):
        target_config(None, spec)


# ------------------------------------------------------------------------------------------------ foreign keys
@pytest.mark.parametrize("change, message", [
    ({"attention_sink_bias": True}, "keys it does not implement: attention_sink_bias"),
    ({"dflash_config": {"use_swa": True}}, "dflash_config.use_swa"),
    ({"hidden_act": "gelu"}, "values it does not implement: hidden_act='gelu'"),
    ({"draft_vocab_size": 32000, "target_hidden_size": 64}, "draft_vocab_size, target_hidden_size"),
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 4, "use_sliding_window": False},
     "use_sliding_window is false"),
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": None}, "set .*sliding_window"),
    ({"layer_types": ["chunked_attention"] * 2}, "'chunked_attention' is not a drafter layer type"),
])
def test_a_config_json_with_keys_the_drafter_does_not_implement_exits_2(tmp_path, capsys, change, message):
    drafter = drafter_of()
    drafter.save(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    for key, value in change.items():
        if isinstance(value, dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash: error: ") and err.count("\n") == 1, err
    import re

    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_keys_that_cannot_change_the_math_pass():
    cfg = tiny_arch().to_hf_config()
    cfg.update({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "initializer_range": 0.02,
                "use_cache": True, "attention_dropout": 0.0, "transformers_version": "4.57.1",
                "eagle_aux_hidden_state_layer_ids": [2, 4]})
    cfg["dflash_config"]["mask_token"] = "<|MASK|>"
    arch = DrafterArch.from_hf_config(cfg)
    assert dataclasses.replace(arch, extra={}) == tiny_arch()
    again = arch.to_hf_config()  # and they are written back as they were (but the writer's version)
    assert {k: again[k] for k in cfg if k != "transformers_version"} == {
        k: v for k, v in cfg.items() if k != "transformers_version"}


# ------------------------------------------------------------------------------------------------ config keys
def tiny_run(output_dir: Path, **drafter) -> dict:
    d = copy.deepcopy(TINY)
    d["output_dir"] = str(output_dir)
    d["data"]["synthetic"]["num_samples"] = 200
    d["data"].pop("regenerate", None)
    d["optim"]["max_steps"] = 3
    d["checkpoint"]["interval"] = 3
    d["logging"]["interval"] = 1
    d["eval"]["speculative_prompts"] = 2
    d["eval"]["max_new_tokens"] = 12
    d["drafter"].update(drafter)
    return d


@pytest.mark.parametrize("drafter, message", [
    (dict(layer_types=["sliding_attention", "full_attention"]), "drafter.layer_types has sliding_attention layers: "
                                                                "set drafter.sliding_window"),
    (dict(sliding_window=16), "drafter.sliding_window is 16 but no layer slides"),
    (dict(layer_types=["sliding_attention"], sliding_window=8), "one of full_attention, sliding_attention per "
                                                                "drafter layer \\(2\\)"),
    (dict(layer_types=["sliding", "full_attention"], sliding_window=8), "'sliding' is not a drafter layer type"),
])
def test_a_bad_layout_in_the_run_config_is_one_config_error(tmp_path, drafter, message):
    with pytest.raises(ConfigError, match=message):
        validate(_build(RunConfig, tiny_run(tmp_path, **drafter), ""))


# A scaled-down copy of the fields of SpecForge's configs/qwen3.6-27b-dflash.json drafter (and z-lab's Qwen3.6
# releases): five layers, four sliding (window 2048 there) and one full, rope_theta 1e7, the Qwen3 bookkeeping
# keys. Sizes and the window shrink to the tiny CPU target (hidden 64, 6 layers, sequences up to 64 tokens).
QWEN36_LIKE = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 8, "bos_token_id": 1,
    "dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 3, 4]}, "dtype": "bfloat16", "eos_token_id": 2,
    "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "max_position_embeddings": 512,
    "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 5,
    "num_key_value_heads": 2, "num_target_layers": 6, "pad_token_id": 2, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000000, "sliding_window": 12, "tie_word_embeddings": False,
    "use_cache": True, "use_sliding_window": True, "vocab_size": 96,
}


def test_a_qwen36_like_drafter_loads_trains_and_exports_its_layout(tmp_path):
    """Item 1's acceptance and item 4: a released-layout drafter directory (config.json + safetensors) is
    taken by drafter.init_from, trains (window 12 < the sequences), and its export keeps the layout, the RoPE
    and the weights' names; the exported modeling file loads it."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel

    from dflash.training.trainer import Trainer

    release = tmp_path / "release"
    release.mkdir()
    arch = DrafterArch.from_hf_config(QWEN36_LIKE)
    assert (arch.layer_types, arch.sliding_window, arch.rope_theta) == (QWEN36_LIKE["layer_types"], 12, 1e7)
    torch.manual_seed(0)
    weights = {k: v.to(torch.bfloat16) for k, v in Drafter(arch).state_dict().items()}
    save_file(weights, str(release / "model.safetensors"), metadata={"format": "pt"})
    (release / "config.json").write_text(json.dumps(QWEN36_LIKE))

    run = tiny_run(tmp_path / "run", num_layers=5, mask_token_id=95)
    run["drafter"]["init_from"] = str(release)
    trainer = Trainer(_build(RunConfig, run, "")).setup()
    assert trainer.drafter.arch.layer_types == QWEN36_LIKE["layer_types"]
    trainer.run()
    trained = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]

    out = export(tmp_path / "run", tmp_path / "out", "bfloat16")
    cfg = json.loads((out / "config.json").read_text())
    for key, value in QWEN36_LIKE.items():  # the release's fields round-trip (auto_map: the shipped file's)
        if key == "dflash_config":
            assert cfg[key] == {**value, "block_size": 8}
        elif key != "auto_map":
            assert cfg[key] == value, key
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}
    assert load_file(str(out / "model.safetensors")).keys() == weights.keys()
    moved = load_file(str(trained / "model.safetensors"))
    assert any(not torch.equal(moved[k].to(torch.bfloat16), weights[k]) for k in weights)  # it trained
    model = AutoModel.from_pretrained(str(out), trust_remote_code=True)
    assert [layer.self_attn.sliding_window for layer in model.layers] == [12] * 4 + [None]
    assert [layer.self_attn.is_causal for layer in model.layers] == [True] * 4 + [False]


def test_the_trainer_builds_the_configs_layout(tmp_path):
    from dflash.training.trainer import Trainer

    trainer = Trainer(_build(RunConfig, tiny_run(tmp_path / "run", layer_types=SLIDING, sliding_window=6), "")).setup()
    assert [layer.self_attn.layer_mask for layer in trainer.drafter.layers] == [LayerMask(6, True), FULL]


def test_run_config_layout_reaches_the_trained_drafter_and_its_export(tmp_path):
    """drafter.layer_types / sliding_window build the drafter's layout: trained, checkpointed, exported."""
    import dflash.training.trainer as train_module

    trainer_config = tiny_run(tmp_path / "run", layer_types=SLIDING, sliding_window=6)
    trainer = train_module.Trainer(_build(RunConfig, trainer_config, "")).setup()
    assert [layer.self_attn.layer_mask for layer in trainer.drafter.layers] == [LayerMask(6, True), FULL]
    trainer.run()
    cfg = json.loads((export(tmp_path / "run", tmp_path / "out", "float32") / "config.json").read_text())
    assert (cfg["layer_types"], cfg["sliding_window"], cfg["use_sliding_window"]) == (SLIDING, 6, True)


# ------------------------------------------------------------------------------ drafter.init_from and the layout
def test_init_from_gives_the_layout_a_conflicting_config_is_refused_and_the_contract_records_the_trained_one(
        tmp_path, caplog):
    """The init's layout is what trains: a config that sets another one exits 2 naming both (before any model
    loads); unset, the init's layout trains and contract.json records it, so a resume that states it is accepted
    and one that states another is refused. A checkpoint whose contract.json recorded the config's layout instead
    (an earlier dflash) is compared with what its drafter config.json says it trained."""
    import logging

    from dflash.components.checkpoint import CONTRACT, MANIFEST, CheckpointManager
    from dflash.errors import BadInput
    from dflash.fileio import sha256_file
    from dflash.training.trainer import Trainer

    init = tmp_path / "init"
    arch = DrafterArch(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=96, block_size=8, target_layer_ids=[1, 3, 4],
                       mask_token_id=95, num_target_layers=6, layer_types=SLIDING, sliding_window=6)
    Drafter(arch).save(init)

    def config(run="run", init_from=True, **layout):
        d = tiny_run(tmp_path / run, mask_token_id=95, **layout)
        d["data"]["synthetic"]["num_samples"] = 64
        if init_from:
            d["drafter"]["init_from"] = str(init)
        return _build(RunConfig, d, "")

    for layout, shown in [(dict(layer_types=["full_attention", "sliding_attention"], sliding_window=6),
                           "layer_types [full_attention, sliding_attention] with sliding_window 6"),
                          (dict(layer_types=SLIDING, sliding_window=4),
                           "layer_types [sliding_attention, full_attention] with sliding_window 4"),
                          (dict(layer_types=["full_attention"] * 2), "all full_attention")]:
        with pytest.raises(BadInput) as err:
            Trainer(config(**layout)).setup()
        assert str(err.value) == (
            f"drafter.layer_types/sliding_window ({shown}) conflict with drafter.init_from '{init}' (layer_types "
            "[sliding_attention, full_attention] with sliding_window 6); remove drafter.layer_types and "
            "drafter.sliding_window from the config (the init's layout trains) or set them to the init's")
        assert not (tmp_path / "run" / "checkpoints").exists()

    trainer = Trainer(config()).setup()
    assert [layer.self_attn.layer_mask for layer in trainer.drafter.layers] == [LayerMask(6, True), FULL]
    trainer.train_step()
    saved = trainer.save_checkpoint()
    contract = json.loads((saved / CONTRACT).read_text())
    assert (contract["drafter.layer_types"], contract["drafter.sliding_window"]) == (SLIDING, 6)

    assert Trainer(config(layer_types=SLIDING, sliding_window=6)).setup().step == 1  # the true layout, stated
    assert Trainer(config(init_from=False, layer_types=SLIDING, sliding_window=6)).setup().step == 1
    with pytest.raises(BadInput, match=r"drafter.layer_types is unset but the checkpoint .* was trained with "
                                       r"\['sliding_attention', 'full_attention'\]"):
        Trainer(config(init_from=False)).setup()
    with pytest.raises(BadInput, match="drafter.sliding_window is 4 but .* trained with 6"):
        Trainer(config(init_from=False, layer_types=SLIDING, sliding_window=4)).setup()

    # what an earlier dflash wrote with the config's layout unset: no layout in contract.json
    for key in ("drafter.layer_types", "drafter.sliding_window"):
        contract.pop(key)
    (saved / CONTRACT).write_text(json.dumps(contract))
    manifest = json.loads((saved / MANIFEST).read_text())
    manifest["files"][CONTRACT] = sha256_file(saved / CONTRACT)
    (saved / MANIFEST).write_text(json.dumps(manifest))
    assert CheckpointManager.verify(saved) is None
    with caplog.at_level(logging.WARNING):
        assert Trainer(config()).setup().step == 1
    assert any("comparing with what it trained" in r.getMessage() for r in caplog.records)
    with pytest.raises(BadInput, match="drafter.layer_types is unset but"):
        Trainer(config(init_from=False)).setup()
