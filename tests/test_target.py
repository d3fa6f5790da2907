"""Target feature extraction: hooks on tapped layers, backbone only, early stop."""

import pytest
import torch

from dflash.config import default_layer_ids
from dflash.models.target import Target, build_hf_model

QWEN3 = {"model_type": "qwen3", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
LLAMA = {"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_default_layer_ids_match_design():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_layer_ids(64, 5) == [1, 16, 31, 46, 61]


@pytest.mark.parametrize("spec", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_features_equal_hidden_states_of_tapped_layers(spec):
    model = build_hf_model(None, dict(spec), "float32", seed=0)
    ids = torch.randint(0, 50, (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    target = Target(model, [1, 3])
    feats = target.features(ids, mask)
    h = spec["hidden_size"]
    assert feats.shape == (2, 9, 2 * h)
    # hidden_states[i + 1] is the output of layer i
    assert torch.allclose(feats[..., :h], ref[2], atol=1e-5)
    assert torch.allclose(feats[..., h:], ref[4], atol=1e-5)


def test_forward_stops_after_deepest_tapped_layer_and_skips_lm_head():
    model = build_hf_model(None, dict(QWEN3), "float32")
    calls = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda *_a, i=i: calls.append(i))
    model.lm_head.register_forward_hook(lambda *_a: calls.append("lm_head"))
    model.model.norm.register_forward_hook(lambda *_a: calls.append("norm"))
    target = Target(model, [2, 1])
    target.features(torch.randint(0, 50, (1, 5)))
    assert calls == [0, 1, 2]
    assert target.layer_ids == [1, 2]
    assert not any(p.requires_grad for p in target.parameters())
    assert target.embed_tokens is model.model.embed_tokens and target.lm_head is model.lm_head


def test_one_depth_for_the_feature_forward_its_stages_and_its_float8_layers():
    """`feature_depth` is the one "target up to layer k": the layers `Target` runs, the last stage's end and the
    layers `target.float8` swaps all follow it (the taps unsorted: the deepest is not the last one given)."""
    from dflash.components.float8 import target_float8
    from dflash.models.target import feature_depth
    from dflash.runtime.stages import stage_bounds

    taps = [3, 1]
    assert feature_depth(taps) == 4 and feature_depth([0]) == 1
    model = build_hf_model(None, dict(QWEN3), "float32")
    entered = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *_a, i=i: entered.append(i))
    target = Target(model, taps)
    target.features(torch.randint(0, 50, (1, 5)))
    assert entered == list(range(feature_depth(taps))) == [0, 1, 2, 3]
    assert stage_bounds(taps, 1) == [(0, 4)] and stage_bounds(taps, 3)[-1][1] == 4
    swapped, kept = target_float8(target)
    assert (swapped, kept) == (4 * 7, 0)  # q, k, v, o, gate, up, down of layers 0-3, none of layers 4-5


def test_hybrid_target_reports_slow_path_without_kernels():
    from dflash.runtime.doctor import PROBE_HYBRID

    model = build_hf_model(None, dict(PROBE_HYBRID), "float32")
    target = Target(model, [1, 3])
    report = target.fast_path_report()
    assert report.hybrid and report.linear_layers == 3 and report.total_layers == 4
    feats = target.features(torch.randint(0, 256, (1, 7)))
    assert feats.shape == (1, 7, 512)
    import importlib.util

    if importlib.util.find_spec("fla") is None:
        assert not report.fast and "SLOW" in report.describe()


def _hybrid_spec():
    from dflash.runtime.doctor import PROBE_HYBRID

    return {**PROBE_HYBRID, "num_hidden_layers": 6, "layer_types": ["linear_attention"] * 3 + ["full_attention"]
            + ["linear_attention", "full_attention"]}


@pytest.mark.parametrize("spec,vocab", [(QWEN3, 50), (None, 256)], ids=["qwen3", "qwen3_next-hybrid"])
@pytest.mark.parametrize("stages", [2, 3])
def test_layer_split_stages_chain_to_the_unsplit_features(spec, vocab, stages):
    """Stages of a layer-split target, each holding only its layers, chained hidden state -> inputs_embeds,
    give the unsplit target's tapped features (padding included); later stages drop the embedding."""
    from dflash.runtime.stages import TargetStage, stage_bounds

    spec = dict(spec or _hybrid_spec())
    taps = [1, 2, 4]
    ids = torch.randint(0, vocab, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # a padded row
    want = Target(build_hf_model(None, dict(spec), "float32", seed=3), taps).features(ids, mask)
    bounds = stage_bounds(taps, stages)
    assert bounds[0][0] == 0 and bounds[-1][1] == max(taps) + 1
    assert all(a < b for a, b in bounds) and all(bounds[i][1] == bounds[i + 1][0] for i in range(stages - 1))
    hidden, collected = None, []
    for s, (start, stop) in enumerate(bounds):
        stage = TargetStage(build_hf_model(None, dict(spec), "float32", seed=3), taps, start, stop,
                            keep_embedding=s == 0, keep_head=s == 0)
        assert len(stage.backbone.layers) == stop - start
        if s > 0:
            with pytest.raises(RuntimeError, match="no embedding"):
                stage.embed_tokens  # noqa: B018
        hidden, got = stage(ids, mask, hidden)
        collected += got
    feats = torch.cat(collected, dim=-1)
    assert feats.shape == want.shape
    valid = mask.bool()
    assert torch.allclose(feats[valid], want[valid], atol=1e-5)


def test_stage_bounds_refuse_more_stages_than_layers():
    from dflash.errors import BadInput
    from dflash.runtime.stages import stage_bounds

    assert stage_bounds([1, 4], 2) == [(0, 2), (2, 5)]
    assert stage_bounds([1, 9, 17, 25, 33], 3) == [(0, 11), (11, 22), (22, 34)]
    with pytest.raises(BadInput, match="target_stages=6: the target runs 5 layers"):
        stage_bounds([4, 2], 6)


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_a_right_padded_batch_needs_no_attention_mask(hybrid):
    """The trainer's batches are right-padded; a causal target's states at the valid positions do not depend
    on later positions, so the trainer leaves the mask out (SDPA's causal fast path, not a masked kernel)."""
    from dflash.runtime.doctor import PROBE_HYBRID

    spec = dict(PROBE_HYBRID) if hybrid else dict(QWEN3)
    model = build_hf_model(None, spec, "float32", seed=0)
    target = Target(model, [1, 3])
    ids = torch.randint(0, spec["vocab_size"], (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 5:] = 0
    valid = mask.bool()
    with_mask, without = target.features(ids, mask), target.features(ids, None)
    assert torch.allclose(with_mask[valid], without[valid], atol=1e-5)
    assert not torch.allclose(with_mask, without, atol=1e-5)  # only the padded positions differ
