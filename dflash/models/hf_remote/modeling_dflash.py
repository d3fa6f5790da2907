"""DFlash drafter for Hugging Face transformers (`trust_remote_code`), shipped by `dflash export`.

Self-contained on purpose: it imports only torch and transformers, so an exported directory loads with

    AutoModel.from_pretrained(EXPORT_DIR, trust_remote_code=True)

like the public DFlash checkpoints (config.json `auto_map: {"AutoModel": "modeling_dflash.DFlashDraftModel"}`).
The parameter names equal those of `dflash.models.drafter.Drafter` (fc, hidden_norm, layers.N.self_attn.*,
layers.N.mlp.*, layers.N.*_layernorm, norm), and `forward` computes what `Drafter.forward` computes for one
block at one anchor (tests/test_loading.py checks both).

The drafter (arXiv 2602.06036): the tapped target hidden states are fused, `c = RMSNorm(fc(concat(h_l)))`;
every layer takes Q from the block only and K, V from [c ; block] with its own projections; RoPE at absolute
positions; the block attends to all of it (no causal mask). Embeddings and LM head are the target's.

`forward` follows the signature of z-lab's public `DFlashDraftModel.forward`: `position_ids` covers the new
context positions followed by the block positions; with a KV cache (`past_key_values`) the context of earlier
calls is already in the cache, so callers pass only the new context features, and crop the cache back to the
context after each call (the block's keys must not stay). `spec_generate` is a greedy speculative decoding
loop for dense (attention-only) targets.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


def _dflash_value(config, name: str, default=None):
    """A DFlash field from `dflash_config`, else from the top level of the config."""
    nested = getattr(config, "dflash_config", None) or {}
    if name in nested and nested[name] is not None:
        return nested[name]
    return getattr(config, name, default)


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type not in (None, "default"):
        raise ValueError(f"DFlash drafter: rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(config, "rope_theta", None) or 1_000_000.0)


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class DFlashRotary(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """position_ids (b, L) -> cos, sin of shape (b, 1, L, head_dim), in `dtype`."""
        d = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, device=position_ids.device).float() / d))
        freqs = position_ids.float()[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, hidden_states, target_hidden, cos, sin, attention_mask=None, past_key_values=None):
        b, q_len, _ = hidden_states.shape
        d = self.head_dim
        q = self.q_norm(self.q_proj(hidden_states).view(b, q_len, -1, d)).transpose(1, 2)
        kv_in = torch.cat([target_hidden, hidden_states], dim=1)  # KV injection: context first, then the block
        kv_len = kv_in.shape[1]
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_len, -1, d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, kv_len, -1, d).transpose(1, 2)
        q = q * cos[..., -q_len:, :] + _rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + _rotate_half(k) * sin
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if self.num_kv_heads != self.num_heads:
            groups = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, hidden_states, target_hidden, cos, sin, attention_mask=None, past_key_values=None):
        x = hidden_states
        x = x + self.self_attn(self.input_layernorm(x), target_hidden, cos, sin, attention_mask, past_key_values)
        return x + self.mlp(self.post_attention_layernorm(x))


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers cache (negative `crop` = tokens to remove)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _new_cache(config=None):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config) if config is not None else DynamicCache()
    except TypeError:  # transformers without DynamicCache(config=)
        return DynamicCache()


def _cache_kwarg(model: nn.Module) -> str:
    """transformers >= 5.2x names the cache argument `cache` (`past_key_values` is deprecated there)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]
    supports_gradient_checkpointing = False

    def __init__(self, config):
        super().__init__(config)
        ids = _dflash_value(config, "target_layer_ids")
        if not ids:
            raise ValueError("DFlash drafter config lacks dflash_config.target_layer_ids")
        self.target_layer_ids = [int(i) for i in ids]
        self.block_size = int(_dflash_value(config, "block_size", 16))
        mask = _dflash_value(config, "mask_token_id")
        self.mask_token_id = None if mask is None else int(mask)
        h = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(h, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        self.rotary_emb = DFlashRotary(head_dim, _rope_theta(config))
        self.post_init()

    def _init_weights(self, module):
        std = getattr(self.config, "initializer_range", None) or 0.02
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)

    def forward(self, position_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                noise_embedding: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, **kwargs) -> torch.Tensor:
        """Hidden states (b, q_len, H) of the block, after the final norm (the target's LM head gives logits).

        noise_embedding: (b, q_len, H) the target's embeddings of [anchor token, MASK, ...];
        target_hidden: (b, ctx_len, n*H) concatenated outputs of the tapped target layers for the new context;
        position_ids: (b, ctx_len + q_len) absolute positions of that context, then of the block;
        attention_mask: optional, boolean (True = attend) or additive, broadcastable to
        (b, heads, q_len, cached + ctx_len + q_len); None lets the block see every key (DFlash's inference
        mask). Other keyword arguments (e.g. `is_causal`) are accepted and ignored.
        """
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlashDraftModel.forward needs noise_embedding and target_hidden")
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        position_ids = position_ids.expand(noise_embedding.shape[0], -1)
        x = noise_embedding
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        x = x.to(ctx.dtype)
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        cache = past_key_values if (use_cache or past_key_values is not None) else None
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, attention_mask, cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        return output_head(hidden.to(output_head.weight.dtype))

    def context_features(self, hidden_states) -> torch.Tensor:
        """Concatenated tapped states from a target's `output_hidden_states` (entry i+1 = output of layer i;
        transformers applies the final norm to the last entry, so do not tap the target's last layer)."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    @torch.inference_mode()
    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None = None, temperature: float = 0.0,
                      mask_token_id: int | None = None, return_acceptance: bool = False):
        """Greedy speculative decoding of one prompt (batch 1) with a dense target; output = the target's
        own greedy continuation. Returns the ids (prompt included), and the per-round acceptance lengths
        (1..block_size) with `return_acceptance=True`."""
        if temperature and temperature > 0:
            raise NotImplementedError("this DFlash drafter's spec_generate is greedy only (temperature=0)")
        if input_ids.shape[0] != 1:
            raise ValueError("spec_generate decodes one prompt at a time (batch size 1)")
        mask_id = self.mask_token_id if mask_token_id is None else int(mask_token_id)
        if mask_id is None:
            raise ValueError("no mask_token_id in the drafter config; pass mask_token_id=")
        self.eval()
        bs = self.block_size
        device = input_ids.device
        n_in = input_ids.shape[1]
        max_len = n_in + max_new_tokens
        out = torch.full((1, max_len + bs), mask_id, dtype=torch.long, device=device)
        positions = torch.arange(out.shape[1], device=device)[None]
        target_cache, draft_cache = _new_cache(target.config), _new_cache()
        cache_kw = _cache_kwarg(target)
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        stops = set(stop_token_ids or [])

        o = target(input_ids, position_ids=positions[:, :n_in], use_cache=True, output_hidden_states=True,
                   **{cache_kw: target_cache})
        out[:, :n_in] = input_ids
        out[:, n_in] = o.logits[:, -1].argmax(-1)
        ctx = self.context_features(o.hidden_states)
        start, accepted = n_in, []
        while start < max_len and int(out[0, start]) not in stops:
            block = out[:, start:start + bs].clone()
            hidden = self(position_ids=positions[:, start - ctx.shape[1]:start + bs], noise_embedding=embed(block),
                          target_hidden=ctx, past_key_values=draft_cache, use_cache=True)
            _crop(draft_cache, start)
            block[:, 1:] = self.compute_logits(hidden[:, 1:], head).argmax(-1)
            o = target(block, position_ids=positions[:, start:start + bs], use_cache=True,
                       output_hidden_states=True, **{cache_kw: target_cache})
            posterior = o.logits.argmax(-1)
            n = int((block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum())
            out[:, start:start + n + 1] = block[:, :n + 1]
            out[:, start + n + 1] = posterior[:, n]
            committed = out[0, start + 1:start + n + 2].tolist()
            start += n + 1
            _crop(target_cache, start)
            ctx = self.context_features(o.hidden_states)[:, :n + 1]
            accepted.append(n + 1)
            if stops.intersection(committed):
                break
        ids = out[:, :min(start + 1, max_len)]
        if stops:
            hits = [i for i in range(n_in, ids.shape[1]) if int(ids[0, i]) in stops]
            if hits:
                ids = ids[:, :hits[0] + 1]
        return (ids, accepted) if return_acceptance else ids
