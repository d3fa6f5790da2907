"""The DFlash drafter (arXiv 2602.06036): a few Qwen3-style layers with target-feature KV injection.

* fused context feature  c = RMSNorm(fc(concat(h_l1 .. h_ln)))        (shared by all layers)
* every layer: Q from the block only; K, V from [c ; block] with the layer's own projections
* block = [x_a, MASK, ..., MASK] at positions a .. a+B-1; position k predicts x_{a+k}
* embeddings and LM head are the target's, frozen, never stored in the drafter checkpoint
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

from dflash.errors import BadInput
from dflash.models.attention import AttentionBackend
from dflash.models.target import check_rope, rope_of


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
    extra: dict[str, Any] = field(default_factory=dict)

    def to_hf_config(self) -> dict[str, Any]:
        """config.json in the layout serving engines load."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
                "block_size": self.block_size,
            },
            **self.extra,
        }

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> DrafterArch:
        dcfg = cfg.get("dflash_config") or {}
        block_size = cfg.get("block_size", dcfg.get("block_size"))
        missing = [k for k, v in (("block_size", block_size), ("dflash_config.target_layer_ids",
                                  dcfg.get("target_layer_ids")), ("dflash_config.mask_token_id",
                                  dcfg.get("mask_token_id"))) if v is None]
        if missing:
            raise ValueError(f"drafter config.json lacks {', '.join(missing)}")
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e6)
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
        )


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class DrafterAttention(nn.Module):
    def __init__(self, a: DrafterArch):
        super().__init__()
        self.a = a
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
        out = attend(q, k, v)
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
    def __init__(self, a: DrafterArch):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = DrafterAttention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = DrafterMLP(a)

    def forward(self, x, ctx, rope_q, rope_k, attend):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    """Trainable part only; `embed` and `lm_head` (the target's, frozen) are passed in at call time."""

    def __init__(self, arch: DrafterArch):
        super().__init__()
        self.arch = arch
        n = len(arch.target_layer_ids)
        self.fc = nn.Linear(n * arch.hidden_size, arch.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)

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
        rope_q = rope_cos_sin(block_pos, a.head_dim, a.rope_theta, x.dtype)
        rope_k = rope_cos_sin(torch.cat([ctx_pos, block_pos], dim=1), a.head_dim, a.rope_theta, x.dtype)
        attend = AttentionBackend(attention_kind, anchors, t, bs, compiled_flex)
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
        cfg = self.arch.to_hf_config()
        cfg["torch_dtype"] = str(next(self.parameters()).dtype).removeprefix("torch.")
        (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike, device: str | torch.device = "cpu") -> Drafter:
        from safetensors.torch import load_file

        directory = Path(directory)
        cfg = json.loads((directory / "config.json").read_text())
        model = cls(DrafterArch.from_hf_config(cfg))
        state = load_file(str(directory / "model.safetensors"), device=str(device))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"drafter weights in {directory} do not match its config: missing {missing}, "
                             f"unexpected {unexpected}")
        return model.to(device)


def arch_from_target(target_config: Any, *, num_layers: int, block_size: int, layer_ids: list[int],
                     mask_token_id: int, vocab_size: int, intermediate_size: int | None = None,
                     num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                     ) -> DrafterArch:
    tc = getattr(target_config, "text_config", None) or target_config
    heads = num_attention_heads or tc.num_attention_heads
    hidden = tc.hidden_size
    head_dim = getattr(tc, "head_dim", None) or hidden // tc.num_attention_heads
    if num_attention_heads is not None:
        head_dim = hidden // heads
    rope = rope_of(tc)
    check_rope(rope)
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta or getattr(tc, "rope_theta", None) or 1_000_000.0
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
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 40960),
        num_target_layers=tc.num_hidden_layers,
    )


RESUME_KEYS = {"num_hidden_layers": "drafter.num_layers", "block_size": "drafter.block_size",
               "target_layer_ids": "target.layer_ids", "mask_token_id": "drafter.mask_token_id",
               "intermediate_size": "drafter.intermediate_size", "num_attention_heads": "drafter.num_attention_heads",
               "num_key_value_heads": "drafter.num_key_value_heads", "hidden_size": "the target's hidden_size",
               "head_dim": "the target's head_dim", "vocab_size": "the target's vocab_size"}


def check_resumable(saved: DrafterArch, current: DrafterArch, path: Any) -> None:
    """A checkpoint of a differently shaped drafter cannot be resumed: name the config key."""
    for field_name, key in RESUME_KEYS.items():
        old, new = getattr(saved, field_name), getattr(current, field_name)
        if (list(old) if isinstance(old, list | tuple) else old) != (
                list(new) if isinstance(new, list | tuple) else new):
            raise BadInput(f"{key} is {new} but the checkpoint {path} was trained with {old}; a changed "
                           f"drafter cannot resume: use a new output_dir (or set {key.split(' (')[0]} back)")
