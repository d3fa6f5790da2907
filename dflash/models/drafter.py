"""The DFlash drafter (arXiv 2602.06036): a few Qwen3-style layers with target-feature KV injection.

* fused context feature  c = RMSNorm(fc(concat(h_l1 .. h_ln)))        (shared by all layers)
* every layer: Q from the block only; K, V from [c ; block] with the layer's own projections
* block = [x_a, MASK, ..., MASK] at positions a .. a+B-1; position k predicts x_{a+k}
* embeddings and LM head are the target's, frozen, never stored in the drafter checkpoint
* each layer is `full_attention` or `sliding_attention` (`layer_types`, `sliding_window`: the masks in
  dflash.models.attention); RoPE is plain (`rope_theta`) or scaled as transformers scales it (`rope_scaling`)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.config import check_layout
from dflash.errors import BadInput, ConfigError
from dflash.fileio import file_mode
from dflash.logs import get_logger
from dflash.models.attention import AttentionBackend, LayerMask
from dflash.models.dflash2 import CandidateSelector, GroupedDynamicConv, draft_logits
from dflash.models.families import family_of, text_config_of
from dflash.models.target import check_rope, rope_of

log = get_logger(__name__)

# RoPE types whose frequencies transformers computes once (ROPE_INIT_FUNCTIONS); `dynamic` and `longrope`
# change them with the sequence length at run time, which the drafter does not reproduce: refused
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass
class DrafterArch:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    num_target_layers: int = 0
    layer_types: list[str] | None = None  # one per layer; None = all full_attention
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included (Hugging Face's count)
    is_causal: bool | None = None  # in-block causality for every layer; None = sliding layers causal, full not
    rope_scaling: dict[str, Any] | None = None  # transformers' rope_parameters without rope_theta; None = plain
    # DFlash2 (dflash.models.dflash2); conv_kernel_size 0 = plain DFlash
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # keys of a loaded config.json that cannot change the math, written back as they were (PRESERVED_KEYS;
    # "dflash_config": its preserved entries), so that a released drafter's export keeps its fields
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_layout(self.layer_types, self.sliding_window, self.num_hidden_layers, "layer_types", "sliding_window")
        check_rope_scaling(self.rope_scaling, "rope_scaling")
        parts = (self.conv_kernel_size, self.conv_group_size, self.selector_rank, self.selector_top_k)
        if any(parts) and not all(parts):
            raise ConfigError("dflash_config: a DFlash2 drafter needs conv_kernel_size, conv_group_size, selector_rank "
                              f"and selector_top_k all positive (got {parts}); give all four, or none (plain DFlash)")
        if not any(parts) and (self.output_multiplier != 1.0 or self.final_logit_softcapping):
            raise ConfigError("dflash_config: output_multiplier / final_logit_softcapping are implemented for "
                              "DFlash2 drafters only; remove them, or give the DFlash2 fields")
        if self.conv_group_size and self.hidden_size % self.conv_group_size:
            raise ConfigError(f"dflash_config.conv_group_size {self.conv_group_size} does not divide hidden_size "
                              f"{self.hidden_size}; use a divisor (e.g. 16)")

    @property
    def dflash2(self) -> bool:
        return self.conv_kernel_size > 0

    def dflash2_fields(self) -> dict[str, Any]:
        """The dflash_config entries of a DFlash2 drafter (z-lab's published spelling), {} for plain DFlash."""
        if not self.dflash2:
            return {}
        out = {"conv_kernel_size": self.conv_kernel_size, "conv_group_size": self.conv_group_size,
               "selector_rank": self.selector_rank, "selector_top_k": self.selector_top_k,
               "output_multiplier": self.output_multiplier}
        if self.final_logit_softcapping:
            out["final_logit_softcapping"] = self.final_logit_softcapping
        return out

    def layer_type(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else "full_attention"

    def layer_mask(self, index: int) -> LayerMask:
        """What layer `index`'s queries see (the semantics: dflash.models.attention)."""
        sliding = self.layer_type(index) == "sliding_attention"
        causal = sliding if self.is_causal is None else self.is_causal
        return LayerMask(self.sliding_window if sliding else None, causal)

    def layout_fields(self) -> dict[str, Any]:
        """The attention layout in transformers' Qwen3 names. `layer_types` is the authority (SGLang, vLLM,
        z-lab and transformers read it); `max_window_layers` (older readers: layers from this index on slide)
        is that index where the layout has the form full..., sliding..., else the layer count."""
        types = [self.layer_type(i) for i in range(self.num_hidden_layers)]
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        tail = sliding and sliding == list(range(sliding[0], self.num_hidden_layers))
        fields = {"layer_types": types, "use_sliding_window": bool(sliding),
                  "sliding_window": self.sliding_window if sliding else None,
                  "max_window_layers": sliding[0] if tail else self.num_hidden_layers}
        if self.is_causal is not None:
            fields["is_causal"] = self.is_causal
        return fields

    def rope_fields(self) -> dict[str, Any]:
        """Both spellings: `rope_theta`/`rope_scaling` (transformers 4.x, SGLang) and `rope_parameters` (5.x)."""
        scaling = dict(self.rope_scaling) if self.rope_scaling else None
        return {"rope_theta": self.rope_theta, "rope_scaling": scaling,
                "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": self.rope_theta}}

    def to_hf_config(self) -> dict[str, Any]:
        """config.json in the layout serving engines load."""
        extra = dict(self.extra)
        dflash_extra = extra.pop("dflash_config", {})
        return {
            "architectures": ["DFlash2DraftModel" if self.dflash2 else "DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            **self.rope_fields(),
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            **self.layout_fields(),
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
                "block_size": self.block_size,
                **self.dflash2_fields(),
                **dflash_extra,
            },
            **extra,
        }

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "drafter config.json") -> DrafterArch:
        check_known_keys(cfg, source)
        dcfg = cfg.get("dflash_config") or {}
        block_size = cfg.get("block_size", dcfg.get("block_size"))
        missing = [k for k, v in (("block_size", block_size), ("dflash_config.target_layer_ids",
                                  dcfg.get("target_layer_ids")), ("dflash_config.mask_token_id",
                                  dcfg.get("mask_token_id"))) if v is None]
        if missing:
            raise ValueError(f"drafter config.json lacks {', '.join(missing)}")
        rope_theta, rope_scaling = rope_of_hf_config(cfg, source)
        layer_types, sliding_window = layout_of_hf_config(cfg, source)
        heads = cfg["num_attention_heads"]
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            block_size=int(block_size),
            target_layer_ids=list(dcfg["target_layer_ids"]),
            mask_token_id=int(dcfg["mask_token_id"]),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 40960),
            num_target_layers=cfg.get("num_target_layers", 0),
            layer_types=layer_types,
            sliding_window=sliding_window,
            is_causal=causal_of_hf_config(cfg),
            rope_scaling=rope_scaling,
            extra=preserved_keys(cfg),
            **dflash2_of_hf_config(dcfg),
        )


def dflash2_of_hf_config(dcfg: dict[str, Any]) -> dict[str, Any]:
    """The DFlash2 fields of a config.json's dflash_config (z-lab's names), {} where there are none."""
    out: dict[str, Any] = {}
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if dcfg.get(key) is not None:
            out[key] = int(dcfg[key])
    if dcfg.get("output_multiplier") is not None:
        out["output_multiplier"] = float(dcfg["output_multiplier"])
    if dcfg.get("final_logit_softcapping"):
        out["final_logit_softcapping"] = float(dcfg["final_logit_softcapping"])
    return out


# hf_remote/modeling_dflash.py has a copy (DFlashRMSNorm: that file is self-contained for trust_remote_code);
# tests/test_loading.py checks that the exported drafter computes what this one does.
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions: (b, L) -> cos, sin: (b, 1, L, head_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


_SCALED_ROPE: dict[tuple, tuple[torch.Tensor, float]] = {}


def scaled_rope_frequencies(arch: DrafterArch, device=None) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling of a scaled RoPE, from transformers' own ROPE_INIT_FUNCTIONS on a
    Qwen3Config of the drafter's geometry: the numbers transformers' Qwen3RotaryEmbedding rotates with.
    Computed once per process and geometry (every forward asks)."""
    params = {**arch.rope_scaling, "rope_theta": arch.rope_theta}
    key = (json.dumps(params, sort_keys=True), arch.hidden_size, arch.num_attention_heads, arch.head_dim,
           arch.max_position_embeddings, str(device))
    if key not in _SCALED_ROPE:
        from transformers import Qwen3Config
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        config = Qwen3Config(hidden_size=arch.hidden_size, num_attention_heads=arch.num_attention_heads,
                             head_dim=arch.head_dim, max_position_embeddings=arch.max_position_embeddings,
                             rope_parameters=params)
        _SCALED_ROPE[key] = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, device)
    return _SCALED_ROPE[key]


def arch_rope_cos_sin(arch: DrafterArch, positions: torch.Tensor, dtype: torch.dtype):
    """The drafter's rotation at `positions` (b, L): cos, sin (b, 1, L, head_dim). Scaled as transformers'
    Qwen3RotaryEmbedding computes it (float32 frequencies, cos/sin times the attention scaling)."""
    if not arch.rope_scaling:
        return rope_cos_sin(positions, arch.head_dim, arch.rope_theta, dtype)
    inv_freq, scaling = scaled_rope_frequencies(arch, positions.device)
    freqs = positions.float()[..., None] * inv_freq.float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(dtype)[:, None], (emb.sin() * scaling).to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class DrafterAttention(nn.Module):
    def __init__(self, a: DrafterArch, layer_index: int = 0):
        super().__init__()
        self.a = a
        self.layer_index = layer_index
        self.layer_mask = a.layer_mask(layer_index)
        self.q_proj = nn.Linear(a.hidden_size, a.num_attention_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, a.num_key_value_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, a.num_key_value_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.num_attention_heads * a.head_dim, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_k, attend: AttentionBackend):
        b, lq, _ = x.shape
        d = self.a.head_dim
        q = self.q_norm(self.q_proj(x).view(b, lq, -1, d)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)  # KV injection: context features first, then the block
        lk = kv_in.shape[1]
        k = self.k_norm(self.k_proj(kv_in).view(b, lk, -1, d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, lk, -1, d).transpose(1, 2)
        q = apply_rope(q, *rope_q)
        k = apply_rope(k, *rope_k)
        out = attend(q, k, v, self.layer_index)
        return self.o_proj(out.transpose(1, 2).reshape(b, lq, -1))


class DrafterMLP(nn.Module):
    def __init__(self, a: DrafterArch):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, a: DrafterArch, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = DrafterAttention(a, index)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = DrafterMLP(a)
        self.block_size = a.block_size
        if a.dflash2:  # DFlash2: grouped dynamic convolutions around attention and MLP (dflash.models.dflash2)
            self.attention_conv = GroupedDynamicConv(a.hidden_size, a.conv_kernel_size, a.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(a.hidden_size, a.conv_kernel_size, a.conv_group_size)

    def attention_part(self, x, attention):
        """x + the attention branch; `attention` maps the branch's (normalized, convolved) input to its output."""
        h = self.input_layernorm(x)
        if not hasattr(self, "attention_conv"):
            return x + attention(h)
        h, post = self.attention_conv.prepare(h, self.block_size)
        return x + self.attention_conv.finish(attention(h), post, self.block_size)

    def mlp_part(self, x):
        h = self.post_attention_layernorm(x)
        if not hasattr(self, "mlp_conv"):
            return x + self.mlp(h)
        h, post = self.mlp_conv.prepare(h, self.block_size)
        return x + self.mlp_conv.finish(self.mlp(h), post, self.block_size)

    def forward(self, x, ctx, rope_q, rope_k, attend):
        x = self.attention_part(x, lambda h: self.self_attn(h, ctx, rope_q, rope_k, attend))
        return self.mlp_part(x)


class Drafter(nn.Module):
    """Trainable part only; `embed` and `lm_head` (the target's, frozen) are passed in at call time."""

    def __init__(self, arch: DrafterArch):
        super().__init__()
        self.arch = arch
        n = len(arch.target_layer_ids)
        self.fc = nn.Linear(n * arch.hidden_size, arch.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(arch, i) for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if arch.dflash2:
            self.candidate_selector = CandidateSelector(arch.hidden_size, arch.vocab_size, arch.selector_rank,
                                                        arch.selector_top_k)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)

    def logits(self, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """Draft logits of hidden states: the LM head's, scaled and soft-capped for a DFlash2 drafter."""
        a = self.arch
        return draft_logits(hidden, head_weight, a.output_multiplier, a.final_logit_softcapping)

    def forward(self, ctx_features, block_ids, anchors, embed: nn.Embedding, attention_kind: str = "sdpa",
                compiled_flex=None) -> torch.Tensor:
        """Hidden states of every block position, (b, m, B, H), before the LM head.

        ctx_features: (b, T, n*H) tapped target states; block_ids: (b, m, B); anchors: (b, m).
        """
        b, m, bs = block_ids.shape
        t = ctx_features.shape[1]
        a = self.arch
        ctx = self.hidden_norm(self.fc(ctx_features))
        x = embed(block_ids).reshape(b, m * bs, -1).to(ctx.dtype)
        ctx_pos = torch.arange(t, device=anchors.device).expand(b, t)
        block_pos = (anchors[:, :, None] + torch.arange(bs, device=anchors.device)).reshape(b, m * bs)
        rope_q = arch_rope_cos_sin(a, block_pos, x.dtype)
        rope_k = arch_rope_cos_sin(a, torch.cat([ctx_pos, block_pos], dim=1), x.dtype)
        layouts = tuple(layer.self_attn.layer_mask for layer in self.layers)
        attend = AttentionBackend(attention_kind, anchors, t, bs, compiled_flex, layouts)
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_k, attend)
        return self.norm(x).reshape(b, m, bs, -1)

    # ------------------------------------------------------------------------------------- save/load
    def save(self, directory: str | os.PathLike) -> None:
        """Write config.json + model.safetensors (caller handles atomicity)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(directory / "model.safetensors", file_mode())  # safetensors writes 0600
        cfg = self.arch.to_hf_config()
        cfg["torch_dtype"] = str(next(self.parameters()).dtype).removeprefix("torch.")
        (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike, device: str | torch.device = "cpu") -> Drafter:
        from safetensors.torch import load_file

        directory = Path(directory)
        cfg = json.loads((directory / "config.json").read_text())
        model = cls(DrafterArch.from_hf_config(cfg, f"drafter config {directory / 'config.json'}"))
        state = load_file(str(directory / "model.safetensors"), device=str(device))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"drafter weights in {directory} do not match its config: missing {missing}, "
                             f"unexpected {unexpected}")
        return model.to(device)


# --------------------------------------------------------------------------------- layout, RoPE, foreign keys
def check_rope_scaling(rope_scaling: dict[str, Any] | None, key: str) -> None:
    """A scaled RoPE is implemented for the types transformers computes once; the others are refused by name."""
    if not rope_scaling:
        return
    kind = rope_scaling.get("rope_type") or rope_scaling.get("type")
    if kind not in STATIC_ROPE_TYPES:
        raise ConfigError(f"{key}: rope_type {kind!r} is not implemented for the drafter (only "
                          f"{', '.join(STATIC_ROPE_TYPES)}; dynamic and longrope change with the sequence length); "
                          "use a drafter config with one of those, or none")


# transformers' rope_theta where a config.json gives none (RotaryEmbeddingConfigMixin.default_theta; 4.x's Qwen3Config
# default too): the theta a serving engine then rotates with
TRANSFORMERS_DEFAULT_THETA = 10_000.0


def rope_of_hf_config(cfg: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the scaling (transformers' rope_parameters minus rope_theta; None = plain RoPE) of a
    config.json, read as transformers reads it (5.x; 4.x and SGLang read the same where this accepts the file):

    * `rope_scaling`, where set, replaces `rope_parameters` whole (transformers 5's `convert_rope_params_to_dict`):
      a `rope_parameters: {rope_type: default, rope_theta: X}` beside a yarn `rope_scaling` is yarn with the
      scaling's own rope_theta, else the top-level `rope_theta`, else transformers' default 10000, never X (a
      warning names the value not used);
    * else `rope_parameters` with its rope_theta, else the top-level one, else 10000.

    Refused as ambiguous: two scaled spellings that disagree (the file means one of them), and a top-level
    `rope_theta` beside another one in the dictionary read (transformers 5 takes the dictionary's, 4.x and SGLang
    the top-level one)."""
    def plain(spelling: dict[str, Any]) -> dict[str, Any]:
        spelling = {k: v for k, v in spelling.items() if k != "rope_theta"}
        if "type" in spelling and "rope_type" not in spelling:  # the oldest spelling
            spelling["rope_type"] = spelling.pop("type")
        spelling.pop("type", None)
        return spelling

    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    top = cfg.get("rope_theta")
    in_params = plain(params)
    if scaling and (in_params.get("rope_type", "default") != "default" or len(in_params) > 1) and (
            in_params != plain(scaling)):
        raise ConfigError(f"{source}: rope_parameters {in_params} and rope_scaling {plain(scaling)} disagree; keep "
                          "one of them (or make them equal)")
    read, name = (scaling, "rope_scaling") if scaling else (params, "rope_parameters")
    own = read.get("rope_theta")
    if own is not None and top is not None and float(own) != float(top):
        raise ConfigError(f"{source}: rope_theta {top} and {name}.rope_theta {own} disagree (transformers 5 reads "
                          f"{own}, transformers 4.x and SGLang {top}); keep one of them (or make them equal)")
    theta = float(own if own is not None else top if top is not None else TRANSFORMERS_DEFAULT_THETA)
    dropped = params.get("rope_theta") if scaling and params else None
    if dropped is not None and float(dropped) != theta:
        log.warning(f"{source}: rope_parameters.rope_theta {dropped} is not used: rope_scaling replaces "
                    f"rope_parameters as transformers reads the file, which rotates with rope_theta {theta:g}; to "
                    f"rotate with {dropped}, give it in rope_scaling (or keep one spelling)")
    found = plain(read) or None
    if found is not None and found.get("rope_type", "default") == "default" and len(found) <= 1:
        found = None
    if found is not None:
        found.setdefault("rope_type", "default")
        check_rope_scaling(found, f"{source}: rope_scaling")
    return theta, found


def layout_of_hf_config(cfg: dict[str, Any], source: str) -> tuple[list[str] | None, int | None]:
    """layer_types and sliding_window of a released drafter's config.json, read as SGLang, vLLM and z-lab read
    them (an explicit `layer_types`). Where those readers would disagree, refuse: `use_sliding_window: false`
    beside sliding layers (transformers then drops the window that SGLang applies), or a window without
    `layer_types` (transformers derives sliding layers from max_window_layers; SGLang runs them all full)."""
    types, window = cfg.get("layer_types"), cfg.get("sliding_window")
    sliding = bool(types) and "sliding_attention" in types
    if sliding and cfg.get("use_sliding_window") is False:
        raise ConfigError(f"{source}: layer_types has sliding_attention layers but use_sliding_window is false "
                          "(serving engines disagree on such a drafter); set use_sliding_window to true")
    if not types and cfg.get("use_sliding_window") and window is not None:
        raise ConfigError(f"{source}: use_sliding_window is true but layer_types is missing (serving engines "
                          "disagree on which layers slide); write layer_types, one entry per layer")
    if not sliding:
        window = None  # Qwen3 configs carry a window (e.g. 4096) that no layer uses
    if types and all(t == "full_attention" for t in types):
        types = None
    if types is not None:
        check_layout(list(types), window, cfg.get("num_hidden_layers", len(types)), f"{source}: layer_types",
                     f"{source}: sliding_window")
    return (list(types) if types else None), window


def causal_of_hf_config(cfg: dict[str, Any]) -> bool | None:
    """In-block causality as vLLM resolves it: `is_causal`, else `dflash_config.causal`, else None (the layer
    type's default: sliding causal, full bidirectional)."""
    value = cfg.get("is_causal")
    if value is None:
        value = (cfg.get("dflash_config") or {}).get("causal")
    return None if value is None else bool(value)


# Top-level config.json keys the drafter implements (read by from_hf_config) or that cannot change its math
# (bookkeeping, the target's tokens, inference-only switches). Any other key may change the math: refused.
IMPLEMENTED_KEYS = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "block_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "max_position_embeddings", "num_target_layers", "layer_types", "sliding_window", "use_sliding_window",
    "max_window_layers", "is_causal", "dflash_config", "hidden_act", "attention_bias", "model_type",
}
HARMLESS_KEYS = {
    "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "bos_token_id",
    "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "tie_word_embeddings", "attention_dropout",
    "dflash_exported_from", "output_hidden_states", "return_dict", "output_attentions", "id2label", "label2id",
    "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "eagle_aux_hidden_state_layer_ids",
}
DFLASH_CONFIG_KEYS = {"target_layer_ids", "mask_token_id", "block_size", "causal", "num_target_layers",
                      "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "output_multiplier",
                      "final_logit_softcapping"}
HARMLESS_DFLASH_KEYS = {"mask_token"}  # the token's text; its id is mask_token_id
# keys that are harmless at one value only (the value the drafter computes with)
NEUTRAL_VALUES = {"hidden_act": "silu", "attention_bias": False, "model_type": "qwen3"}


# the harmless keys a loaded config.json's export writes back unchanged (the rest is rewritten by the export)
PRESERVED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
                  "attention_dropout", "eagle_aux_hidden_state_layer_ids")


def preserved_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    extra = {k: cfg[k] for k in PRESERVED_KEYS if k in cfg}
    dcfg = {k: v for k, v in (cfg.get("dflash_config") or {}).items() if k in HARMLESS_DFLASH_KEYS}
    return {**extra, "dflash_config": dcfg} if dcfg else extra


def check_known_keys(cfg: dict[str, Any], source: str) -> None:
    """A drafter config.json from outside (drafter.init_from, a released checkpoint) with keys the drafter does
    not implement is refused (exit 2) naming them: dropping one would train or decode another model."""
    unknown = sorted(k for k in cfg if k not in IMPLEMENTED_KEYS | HARMLESS_KEYS)
    dcfg = cfg.get("dflash_config") or {}
    unknown += sorted(f"dflash_config.{k}" for k in dcfg if k not in DFLASH_CONFIG_KEYS | HARMLESS_DFLASH_KEYS)
    wrong = [f"{k}={cfg[k]!r}" for k, want in NEUTRAL_VALUES.items() if k in cfg and cfg[k] != want]
    if unknown or wrong:
        parts = ([f"keys it does not implement: {', '.join(unknown)}"] if unknown else []) + (
            [f"values it does not implement: {', '.join(wrong)} (it computes with "
             f"{', '.join(f'{k}={v!r}' for k, v in NEUTRAL_VALUES.items())})"] if wrong else [])
        raise ConfigError(f"{source} has {'; '.join(parts)}; the drafter would compute something else than the "
                          "checkpoint was trained for: use a DFlash drafter of the Qwen3 layout, or remove them")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and list(aux) != [i + 1 for i in dcfg.get("target_layer_ids", [])]:
        raise ConfigError(f"{source}: eagle_aux_hidden_state_layer_ids {aux} is not dflash_config.target_layer_ids "
                          "+ 1 (vLLM's offset); make them agree or remove eagle_aux_hidden_state_layer_ids")
    if cfg.get("attention_dropout"):
        log.warning(f"{source}: attention_dropout {cfg['attention_dropout']} is not applied (the drafter trains "
                    "without dropout; inference never uses it)")


def arch_from_target(target_config: Any, *, num_layers: int, block_size: int, layer_ids: list[int],
                     mask_token_id: int, vocab_size: int, intermediate_size: int | None = None,
                     num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                     layer_types: list[str] | None = None, sliding_window: int | None = None,
                     dflash2: dict[str, Any] | None = None) -> DrafterArch:
    family, tc = family_of(target_config), text_config_of(target_config)
    heads = num_attention_heads or tc.num_attention_heads
    hidden = tc.hidden_size
    head_dim = getattr(tc, "head_dim", None) or hidden // tc.num_attention_heads
    if num_attention_heads is not None:
        head_dim = hidden // heads
    rope = rope_of(tc)
    check_rope(rope)
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta or family.default(tc, "rope_theta")
    return DrafterArch(
        hidden_size=hidden,
        intermediate_size=intermediate_size or tc.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=num_key_value_heads or getattr(tc, "num_key_value_heads", heads) or heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        block_size=block_size,
        target_layer_ids=list(layer_ids),
        mask_token_id=mask_token_id,
        rms_norm_eps=family.default(tc, "rms_norm_eps"),
        rope_theta=float(theta),
        max_position_embeddings=family.default(tc, "max_position_embeddings"),
        num_target_layers=tc.num_hidden_layers,
        layer_types=list(layer_types) if layer_types else None,
        sliding_window=sliding_window,
        # a DFlash2 drafter is non-causal in its block (z-lab's published `is_causal: false`)
        is_causal=False if dflash2 else None,
        **({k: v for k, v in dflash2.items() if v is not None} if dflash2 else {}),
    )


RESUME_KEYS = {"num_hidden_layers": "drafter.num_layers", "block_size": "drafter.block_size",
               "target_layer_ids": "target.layer_ids", "mask_token_id": "drafter.mask_token_id",
               "intermediate_size": "drafter.intermediate_size", "num_attention_heads": "drafter.num_attention_heads",
               "num_key_value_heads": "drafter.num_key_value_heads", "hidden_size": "the target's hidden_size",
               "head_dim": "the target's head_dim", "vocab_size": "the target's vocab_size",
               **{k: f"drafter.dflash2.{k}" for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                      "selector_top_k", "output_multiplier",
                                                      "final_logit_softcapping")}}


def check_resumable(saved: DrafterArch, current: DrafterArch, path: Any) -> None:
    """A checkpoint of a differently shaped drafter cannot be resumed: name the config key."""
    for field_name, key in RESUME_KEYS.items():
        old, new = getattr(saved, field_name), getattr(current, field_name)
        if (list(old) if isinstance(old, list | tuple) else old) != (
                list(new) if isinstance(new, list | tuple) else new):
            raise BadInput(f"{key} is {new} but the checkpoint {path} was trained with {old}; a changed "
                           f"drafter cannot resume: use a new output_dir (or set {key.split(' (')[0]} back)")
