"""DFlash2 drafters (issue 48): a released config.json is accepted; the forward equals an independent
reimplementation from the engines' model files; a tiny DFlash2 trains on the CPU recipe, exports, reloads through
drafter.init_from and AutoModel (trust_remote_code) and decodes losslessly.

The reference below is written from public files, not from dflash's code:

* vLLM `vllm/model_executor/models/qwen3_dflash2.py` at commit 1b1712a0696365f1a2f728ccdf0db314d01e14ff
  (`_grouped_conv`: kernel = base_kernel + per-group delta, tap t masked where the token's offset in its
  block < t; `DFlash2Qwen3DecoderLayer.forward`: conv around attention and MLP; `_score_edges`: unary +
  <predecessor[prev] * hidden_projection(h), successor[candidate]>, prev = the anchor at the first position);
* vLLM `vllm/model_executor/models/qwen3_dflash.py` at commit 036a00d1f5d00d449d02dce9babdd15a5b4d06c9 (the
  attention: q/k per-head RMSNorm, neox RoPE, K/V over [context ; block]);
* z-lab `dflash/model.py` at commit 10129599dffb338ff38cfd235a53ca6d3667b4dd (`_attention_mask`: a non-causal
  sliding layer sees |q - k| < sliding_window; `compute_logits`: output_multiplier, then softcapping);
* SGLang `python/sglang/srt/models/dflash.py` (a sliding layer: causal attention with
  window_left = sliding_window - 1, i.e. key k visible from query q when 0 <= q - k <= window_left).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dflash.cli import main
from dflash.components.export import export
from dflash.config import RunConfig, _build, validate
from dflash.evaluation.speculative import greedy_generate, speculative_generate
from dflash.models.drafter import Drafter, DrafterArch
from dflash.models.target import Target, build_hf_model

ROOT = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "configs" / "tiny-cpu.yaml").read_text())

# z-lab's DFlash2 config.json as published (z-lab/dflash tests/fixtures/dflash2-config.json,
# commit 0a7587c04af47b56024ef80f44c0926e795a540b), every key and value kept
RELEASED = json.loads((Path(__file__).parent / "data" / "dflash2-released-config.json").read_text())
# shapes of the published weights (z-lab/dflash tests/fixtures/dflash2-safetensors-header.json, layer 0)
RELEASED_SHAPES = {
    "candidate_selector.hidden_projection.weight": (256, 6656),
    "candidate_selector.predecessor_codebook": (202048, 256),
    "candidate_selector.successor_codebook": (202048, 256),
    "fc.weight": (6656, 33280), "hidden_norm.weight": (6656,), "norm.weight": (6656,),
    "layers.0.attention_conv.base_kernel": (2, 2, 6656),
    "layers.0.attention_conv.kernel_projection.weight": (1664, 6656),
    "layers.0.mlp_conv.base_kernel": (2, 2, 6656),
    "layers.0.mlp_conv.kernel_projection.weight": (1664, 6656),
    "layers.0.self_attn.q_proj.weight": (4096, 6656), "layers.0.self_attn.k_proj.weight": (1024, 6656),
    "layers.0.self_attn.o_proj.weight": (6656, 4096), "layers.0.self_attn.k_norm.weight": (128,),
    "layers.0.mlp.gate_proj.weight": (19968, 6656), "layers.0.mlp.down_proj.weight": (6656, 19968),
}
DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 5,
           "output_multiplier": 0.5, "final_logit_softcapping": 3.0}


def tiny_arch(dflash2: bool = True, window: int = 5, block_size: int = 8, causal: bool | None = False,
              taps: int = 2) -> DrafterArch:
    extra = {**DFLASH2, "conv_kernel_size": taps} if dflash2 else {}
    return DrafterArch(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=60, block_size=block_size,
                       target_layer_ids=[1, 3], mask_token_id=59, rope_theta=10000.0, max_position_embeddings=128,
                       layer_types=["sliding_attention", "full_attention"], sliding_window=window,
                       is_causal=causal, **extra)


def randomized(arch: DrafterArch, seed: int = 0) -> Drafter:
    torch.manual_seed(seed)
    drafter = Drafter(arch).eval()
    with torch.no_grad():  # every weight away from its initial value (norms, base kernels included)
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return drafter


# ------------------------------------------------------------------------------------ the reference forward
def ref_rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_rope(x, pos, theta):
    """neox-style rotation (vLLM get_rope, is_neox_style=True) of x (heads, L, d) at positions pos (L,)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = ang.cos().float(), ang.sin().float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def ref_conv(h, delta, base, block_size, group_size):
    """vLLM `_grouped_conv`: h (L, H), delta (L, taps, G), base (taps, H)."""
    L, H = h.shape
    taps, G = base.shape[0], H // group_size
    blocks = h.unflatten(-1, (G, group_size))
    coef = base.view(1, taps, G, group_size) + delta.unsqueeze(-1)
    out = coef[:, 0] * blocks
    position = torch.arange(L) % block_size
    for tap in range(1, taps):
        shifted = torch.nn.functional.pad(blocks[:-tap], (0, 0, 0, 0, tap, 0))
        out = out + coef[:, tap] * shifted * (position >= tap).view(-1, 1, 1)
    return out.flatten(-2)


def ref_visible(q_pos: int, k_pos: int, window: int | None, causal: bool) -> bool:
    if causal and k_pos > q_pos:
        return False
    if window is None:
        return True
    if causal:  # SGLang: window_left = sliding_window - 1
        return q_pos - k_pos <= window - 1
    return abs(q_pos - k_pos) < window  # z-lab `_attention_mask`, non-causal


def reference_block(sd: dict, cfg: dict, ctx_feats: torch.Tensor, block_emb: torch.Tensor, anchor: int):
    """Final hidden states (B, H) of one block at `anchor` whose context is ctx_feats (anchor, n*H), from the
    state dict and config.json alone. The context K/V sit before the block in the engines' caches; every
    block query sees them (within its window) and its block (in-block causality as the layer says)."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    dc = cfg["dflash_config"]
    B = block_emb.shape[0]
    conv = "conv_kernel_size" in dc
    ctx = ref_rms(ctx_feats @ sd["fc.weight"].t(), sd["hidden_norm.weight"], eps)
    q_pos = torch.arange(anchor, anchor + B)
    k_pos = torch.arange(0, anchor + B)
    x = block_emb
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        sliding = cfg["layer_types"][i] == "sliding_attention"
        window = cfg["sliding_window"] if sliding else None
        causal = cfg["is_causal"] if cfg.get("is_causal") is not None else sliding
        mask = torch.tensor([[ref_visible(int(q), int(k), window, causal) for k in k_pos] for q in q_pos])

        def convs(name, h, p=p):
            taps = dc["conv_kernel_size"]
            G = h.shape[-1] // dc["conv_group_size"]
            coeff = (h @ sd[p + name + ".kernel_projection.weight"].t()).reshape(B, 2, taps, G)
            base = sd[p + name + ".base_kernel"]
            return (ref_conv(h, coeff[:, 0], base[0], B, dc["conv_group_size"]),
                    lambda y: ref_conv(y, coeff[:, 1], base[1], B, dc["conv_group_size"]))

        h = ref_rms(x, sd[p + "input_layernorm.weight"], eps)
        if conv:
            h, finish = convs("attention_conv", h)
        kv_in = torch.cat([ctx, h])
        q = ref_rms((h @ sd[p + "self_attn.q_proj.weight"].t()).view(B, heads, d), sd[p + "self_attn.q_norm.weight"],
                    eps).transpose(0, 1)
        k = ref_rms((kv_in @ sd[p + "self_attn.k_proj.weight"].t()).view(-1, kv, d),
                    sd[p + "self_attn.k_norm.weight"], eps).transpose(0, 1)
        v = (kv_in @ sd[p + "self_attn.v_proj.weight"].t()).view(-1, kv, d).transpose(0, 1)
        q, k = ref_rope(q, q_pos, theta), ref_rope(k, k_pos, theta)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        att = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
        o = att.transpose(0, 1).reshape(B, heads * d) @ sd[p + "self_attn.o_proj.weight"].t()
        x = x + (finish(o) if conv else o)
        h = ref_rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        if conv:
            h, finish = convs("mlp_conv", h)
        gate, up = h @ sd[p + "mlp.gate_proj.weight"].t(), h @ sd[p + "mlp.up_proj.weight"].t()
        m = (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].t()
        x = x + (finish(m) if conv else m)
    return ref_rms(x, sd["norm.weight"], eps)


def reference_picks(sd, cfg, hidden, head, anchor_token):
    """z-lab `compute_logits` (multiplier, then softcap) and vLLM `_score_edges` scored over the lattice, walked
    greedily: the first position's predecessor is the anchor token, each later one the previous pick."""
    dc = cfg["dflash_config"]
    logits = (hidden @ head.t()) * dc["output_multiplier"]
    cap = dc["final_logit_softcapping"]
    logits = torch.tanh(logits / cap) * cap
    unary, cand = torch.topk(logits, dc["selector_top_k"], dim=-1)
    hproj = hidden @ sd["candidate_selector.hidden_projection.weight"].t()
    K = dc["selector_top_k"]
    pred_ids = torch.cat([torch.full((1, K), anchor_token), cand[:-1]])
    edges = unary[:, None, :] + torch.einsum("lpr,lcr->lpc", sd["candidate_selector.predecessor_codebook"][pred_ids]
                                             * hproj[:, None], sd["candidate_selector.successor_codebook"][cand])
    picks, prev = [], 0
    for pos in range(hidden.shape[0]):
        c = int(edges[pos, prev].argmax())
        picks.append(int(cand[pos, c]))
        prev = c
    return picks, logits


# ------------------------------------------------------------------------------------------------ tests
def test_a_released_dflash2_config_is_accepted_with_the_published_weight_shapes():
    arch = DrafterArch.from_hf_config(copy.deepcopy(RELEASED), "released config.json")
    assert arch.dflash2 and (arch.conv_kernel_size, arch.conv_group_size, arch.selector_rank,
                             arch.selector_top_k) == (2, 16, 256, 16)
    assert arch.output_multiplier == RELEASED["dflash_config"]["output_multiplier"]
    assert arch.final_logit_softcapping == 20.0 and arch.is_causal is False
    assert arch.layer_types == ["sliding_attention"] * 5 and arch.sliding_window == 2048
    with torch.device("meta"):
        state = Drafter(arch).state_dict()
    for name, shape in RELEASED_SHAPES.items():
        assert tuple(state[name].shape) == shape, name
    assert not any("embed" in k or "lm_head" in k for k in state)
    written = arch.to_hf_config()
    assert written["architectures"] == ["DFlash2DraftModel"] and written["is_causal"] is False
    for key, value in RELEASED["dflash_config"].items():
        assert written["dflash_config"][key] == value, key


@pytest.mark.parametrize("taps,window,block", [(2, 5, 8), (3, 3, 4), (2, 64, 8)])
def test_dflash2_forward_equals_the_engines_reimplementation(taps, window, block):
    arch = tiny_arch(taps=taps, window=window, block_size=block)
    drafter = randomized(arch)
    cfg = arch.to_hf_config()
    sd = {k: v.detach() for k, v in drafter.state_dict().items()}
    torch.manual_seed(2)
    embed = torch.nn.Embedding(60, 32)
    feats = torch.randn(1, 24, 64)
    anchors = [6, 15]
    block_ids = torch.full((1, 2, block), 59)
    block_ids[0, :, 0] = torch.tensor([11, 23])
    head = torch.randn(60, 32)
    with torch.no_grad():
        got = drafter(feats, block_ids, torch.tensor([anchors]), embed)[0]
        for j, a in enumerate(anchors):
            want = reference_block(sd, cfg, feats[0, :a], embed(block_ids[0, j]), a)
            torch.testing.assert_close(got[j], want, atol=1e-5, rtol=1e-5)
            picks, logits = reference_picks(sd, cfg, want[1:], head, int(block_ids[0, j, 0]))
            torch.testing.assert_close(drafter.logits(got[j, 1:], head), logits, atol=1e-5, rtol=1e-5)
            ours = drafter.candidate_selector.select(got[j, 1:], drafter.logits(got[j, 1:], head), block_ids[0, j, 0])
            assert ours.tolist() == picks


@pytest.mark.parametrize("causal", [None, True, False])
def test_plain_dflash_with_sliding_layers_equals_the_engines_mask_semantics(causal):
    """Plain DFlash (no convolutions): a sliding layer as SGLang runs it (window_left = sliding_window - 1,
    causal by default) or non-causal as z-lab does, with a window smaller than the context."""
    arch = tiny_arch(dflash2=False, window=4, block_size=6, causal=causal)
    drafter = randomized(arch, seed=3)
    cfg = arch.to_hf_config()
    sd = {k: v.detach() for k, v in drafter.state_dict().items()}
    torch.manual_seed(4)
    embed = torch.nn.Embedding(60, 32)
    feats = torch.randn(1, 20, 64)
    anchors = [3, 12]
    block_ids = torch.full((1, 2, 6), 59)
    block_ids[0, :, 0] = torch.tensor([7, 40])
    with torch.no_grad():
        got = drafter(feats, block_ids, torch.tensor([anchors]), embed)[0]
        for j, a in enumerate(anchors):
            want = reference_block(sd, cfg, feats[0, :a], embed(block_ids[0, j]), a)
            torch.testing.assert_close(got[j], want, atol=1e-5, rtol=1e-5)


def tiny_dflash2_dict(output_dir: Path) -> dict:
    d = copy.deepcopy(TINY)
    d["output_dir"] = str(output_dir)
    d["data"]["synthetic"]["num_samples"] = 200
    d["data"].pop("regenerate", None)
    d["optim"]["max_steps"] = 4
    d["checkpoint"]["interval"] = 2
    d["logging"]["interval"] = 1
    d["logging"]["eval_interval"] = 0  # one eval at the end: real speculative decoding inside the trainer
    d["eval"]["speculative_prompts"] = 3
    d["drafter"].update(layer_types=["sliding_attention", "sliding_attention"], sliding_window=6,
                        dflash2={"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                                 "selector_top_k": 4, "output_multiplier": 0.5, "final_logit_softcapping": 20.0})
    return d


@pytest.fixture(scope="module")
def trained2(tmp_path_factory):
    from dflash.training.trainer import Trainer

    base = tmp_path_factory.mktemp("dflash2")
    d = tiny_dflash2_dict(base / "run")
    cfg = _build(RunConfig, copy.deepcopy(d), "")
    validate(cfg)
    Trainer(cfg).setup().run()
    return {"run": base / "run", "dict": d, "float32": export(base / "run", base / "export", "float32")}


def test_a_tiny_dflash2_trains_exports_and_loads_everywhere(trained2, tmp_path):
    from transformers import AutoModel

    from dflash.training.trainer import Trainer

    out = trained2["float32"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlash2DraftModel"}
    assert cfg["dflash_config"]["selector_top_k"] == 4 and cfg["is_causal"] is False
    exported = load_file(str(out / "model.safetensors"))
    assert "candidate_selector.successor_codebook" in exported and "layers.1.mlp_conv.base_kernel" in exported
    log = [json.loads(line) for line in (trained2["run"] / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert losses and all(math.isfinite(x) for x in losses)
    evals = [r for r in log if r.get("kind") == "eval"]
    assert evals and evals[-1]["lossless"] is True and evals[-1]["acceptance_length"] >= 1.0
    # AutoModel (trust_remote_code): the exported weights, bit for bit
    model = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype="auto").eval()
    assert type(model).__name__ == "DFlash2DraftModel"
    state = model.state_dict()
    assert state.keys() == exported.keys()
    assert all(torch.equal(state[k], v) for k, v in exported.items())
    # drafter.init_from: the same weights, and one more training step runs
    d = copy.deepcopy(trained2["dict"])
    d["output_dir"] = str(tmp_path / "fine-tune")
    d["drafter"]["init_from"] = str(out)
    cfg2 = _build(RunConfig, d, "")
    validate(cfg2)
    trainer = Trainer(cfg2).setup()
    assert trainer.drafter.arch.dflash2
    assert all(torch.equal(trainer.drafter.state_dict()[k], v) for k, v in exported.items())
    trainer.train_step()


def test_the_exported_dflash2_forward_and_decoding_are_the_drafters_and_lossless(trained2):
    from transformers import AutoModel

    out = trained2["float32"]
    drafter = Drafter.load(out).eval()
    model = AutoModel.from_pretrained(str(out), trust_remote_code=True).eval()
    a = drafter.arch
    torch.manual_seed(0)
    embed = torch.nn.Embedding(a.vocab_size, a.hidden_size)
    feats = torch.randn(1, 24, len(a.target_layer_ids) * a.hidden_size)
    anchor, bs = 11, a.block_size
    block = torch.full((1, 1, bs), a.mask_token_id)
    block[0, 0, 0] = 17
    with torch.no_grad():
        want = drafter(feats, block, torch.tensor([[anchor]]), embed)[:, 0]
        got = model(position_ids=torch.arange(anchor + bs)[None], noise_embedding=embed(block[:, 0]),
                    target_hidden=feats[:, :anchor])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    hf_target = build_hf_model(None, dict(TINY["target"]["random_init"]), "float32", seed=0).eval()
    target = Target(build_hf_model(None, dict(TINY["target"]["random_init"]), "float32", seed=0).eval(),
                    a.target_layer_ids)  # its own copy: Target's hooks stop a forward early
    for seed in range(2):
        ids = torch.randint(0, 96, (1, 6 + seed), generator=torch.Generator().manual_seed(seed))
        want_ids = hf_target.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
        got_ids, accepted = model.spec_generate(target=hf_target, input_ids=ids, max_new_tokens=20,
                                                return_acceptance=True)
        assert torch.equal(got_ids, want_ids)
        assert all(1 <= n <= bs for n in accepted)
        ref = greedy_generate(target, ids[0], 20, eos_ids=[])
        spec = speculative_generate(target, drafter, ids[0], 20, eos_ids=[])
        assert spec.tokens == ref.tokens == want_ids[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("dflash2,message", [
    ({"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6},
     "has selector_top_k 4 but drafter.dflash2.selector_top_k is 6"),
    (None, None),  # no drafter.dflash2: the init's DFlash2 trains
])
def test_init_from_a_dflash2_export_checks_drafter_dflash2_where_set(trained2, tmp_path, capsys, dflash2, message):
    d = copy.deepcopy(trained2["dict"])
    d["output_dir"] = str(tmp_path / "run")
    d["drafter"]["init_from"] = str(trained2["float32"])
    d["drafter"]["dflash2"] = dflash2 and {**dflash2, "output_multiplier": 0.5, "final_logit_softcapping": 20.0}
    d["optim"]["max_steps"] = 1
    d["eval"]["speculative_prompts"] = 0
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(d))
    if message is None:
        assert main(["train", str(path)]) == 0
        return
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("change,message", [
    ({"dflash2": {"selector_top_k": 0}}, "drafter.dflash2.selector_top_k must be a positive integer"),
    ({"dflash2": {"conv_taps": 2}}, "drafter.dflash2 has unknown keys conv_taps"),
    ({"dflash2": {"conv_group_size": 48}}, "conv_group_size 48 does not divide hidden_size 64"),
    ({"float8": True, "float8_head": True}, "drafter.float8_head is the fused DFlash loss's"),
], ids=["top_k", "unknown", "group", "float8_head"])
def test_a_dflash2_run_config_with_a_bad_field_exits_2_naming_it(tmp_path, capsys, change, message):
    d = tiny_dflash2_dict(tmp_path / "run")
    for key, value in change.items():
        if key == "dflash2":
            d["drafter"]["dflash2"].update(value)
        else:
            d["drafter"][key] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(d))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------ acceptance by position
def test_acceptance_is_bucketed_by_output_position():
    """Item 4 of issue 48: rounds are bucketed by the output position of their first committed token."""
    from dflash.evaluation.evaluate import EvalReport

    report = EvalReport(block_size=8, histogram=[0] * 8)
    # rounds start at output positions 1, 9, 17, ...: 8 tokens each up to 1025, then 1 token each
    report.add_rounds([8] * 128 + [1] * 30)
    buckets = {b["bucket"]: b for b in report.acceptance_by_position()}
    assert list(buckets) == ["0-512", "512-1k", "1k-2k"]
    assert buckets["0-512"]["rounds"] == 64 and buckets["0-512"]["acceptance_length"] == 8.0
    assert buckets["512-1k"]["rounds"] == 64 and buckets["512-1k"]["acceptance_length"] == 8.0
    assert buckets["1k-2k"]["rounds"] == 30 and buckets["1k-2k"]["acceptance_length"] == 1.0
    assert "acceptance by output position: 0-512: 8.000 (64 rounds)" in report.render()
    assert report.summary()["acceptance_by_position"] == report.acceptance_by_position()
    short = EvalReport(block_size=8, histogram=[0] * 8)
    short.add_rounds([3, 2, 5])
    assert [b["bucket"] for b in short.acceptance_by_position()] == ["0-512"]
    assert "acceptance by output position" not in short.render()  # one bucket: nothing to compare


def test_the_cached_decoding_path_computes_the_training_forward():
    """DrafterSession (real decoding: context K/V cached, appended in parts) gives the training forward's block
    hidden states for a DFlash2 drafter with sliding non-causal layers, and proposes the selector's picks."""
    from dflash.evaluation.speculative import DrafterSession

    hf = build_hf_model(None, {"model_type": "qwen3", "vocab_size": 60, "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "head_dim": 8}, "float32", seed=0).eval()
    target = Target(hf, [1, 3])
    drafter = randomized(tiny_arch(window=5, block_size=8))
    ids = torch.randint(2, 59, (1, 24), generator=torch.Generator().manual_seed(1))
    feats = target.features(ids)
    for anchor in (3, 14):
        block = torch.full((8,), 59)
        block[0] = ids[0, anchor]
        with torch.no_grad():
            want = drafter(feats, block[None, None], torch.tensor([[anchor]]), target.embed_tokens)[0, 0]
        session = DrafterSession(drafter, target)
        session.append(feats[0, : anchor // 2])
        session.append(feats[0, anchor // 2: anchor])
        torch.testing.assert_close(session.hidden(block), want, atol=1e-5, rtol=1e-5)
        proposed = session.propose(int(block[0]), None)
        head = target.lm_head.weight
        picks = drafter.candidate_selector.select(want[1:], drafter.logits(want[1:], head), block[0])
        assert proposed[1:].tolist() == picks.tolist()
