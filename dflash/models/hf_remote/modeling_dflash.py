"""DFlash drafter for Hugging Face transformers (`trust_remote_code`), shipped by `dflash export`.

Self-contained on purpose: it imports only torch and transformers, so an exported directory loads with

    AutoModel.from_pretrained(EXPORT_DIR, trust_remote_code=True)

like the public DFlash checkpoints (config.json `auto_map: {"AutoModel": "modeling_dflash.DFlashDraftModel"}`, or
`modeling_dflash.DFlash2DraftModel` for a DFlash2 drafter).
The parameter names equal those of `dflash.models.drafter.Drafter` (fc, hidden_norm, layers.N.self_attn.*,
layers.N.mlp.*, layers.N.*_layernorm, norm), and `forward` computes what `Drafter.forward` computes for one
block at one anchor (tests/test_loading.py checks both).

The drafter (arXiv 2602.06036): the tapped target hidden states are fused, `c = RMSNorm(fc(concat(h_l)))`;
every layer takes Q from the block only and K, V from [c ; block] with its own projections; RoPE at absolute
positions; the block attends to all of it (no causal mask). Embeddings and LM head are the target's.

Layers are `full_attention` (as above) or `sliding_attention` (`layer_types`, `sliding_window`): as SGLang
(`srt/models/dflash.py`: a causal attention with window_left = sliding_window - 1) and z-lab (`dflash/model.py`,
`_attention_mask`) run them, a sliding layer's query at position p sees keys at positions k with
p - k < sliding_window and, inside the block, only k <= p (`is_causal` overrides the causality for every layer).
A scaled RoPE (`rope_parameters`/`rope_scaling`, e.g. yarn) rotates with transformers' own frequencies.

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


STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")  # frequencies fixed once (as the trainer's)


def _rope_params(config) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(params) if isinstance(params, dict) else {}


def _rope_type(config) -> str:
    params = _rope_params(config)
    return params.get("rope_type") or params.get("type") or "default"


def _rope_theta(config) -> float:
    theta = _rope_params(config).get("rope_theta")
    return float(theta or getattr(config, "rope_theta", None) or 1_000_000.0)


def _layer_attention(config, layer_idx: int) -> tuple[int | None, bool]:
    """(sliding window or None, in-block causal) of one layer: `is_causal`, else `dflash_config.causal`, else
    causal exactly for sliding layers (vLLM's and z-lab's resolution)."""
    types = getattr(config, "layer_types", None)
    sliding = bool(types) and types[layer_idx] == "sliding_attention"
    window = getattr(config, "sliding_window", None) if sliding else None
    if sliding and window is None:
        raise ValueError("DFlash drafter: sliding_attention layers need config.sliding_window (and "
                         "use_sliding_window: true, or transformers drops the window)")
    causal = getattr(config, "is_causal", None)
    if causal is None:
        causal = (getattr(config, "dflash_config", None) or {}).get("causal")
    return window, sliding if causal is None else bool(causal)


def _layout_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, causal: bool) -> torch.Tensor:
    """(b, 1, q_len, k_len) boolean, True = attend; positions are absolute token positions."""
    q, k = q_pos[:, None, :, None], k_pos[:, None, None, :]
    visible = torch.ones(q.shape[0], 1, q.shape[2], k.shape[3], dtype=torch.bool, device=q.device)
    if causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible


# A copy on purpose of dflash.models.drafter.RMSNorm (this file imports only torch and transformers, for
# trust_remote_code): tests/test_loading.py checks the imports and that both drafters compute the same.
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
    def __init__(self, head_dim: int, theta: float, config=None):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.config = config
        self.rope_type = _rope_type(config) if config is not None else "default"
        if self.rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"DFlash drafter: rope_type {self.rope_type!r} is not supported (only "
                             f"{', '.join(STATIC_ROPE_TYPES)})")
        self._scaled = {}  # device -> (inv_freq, attention_scaling), computed at the first call (not on meta)

    def scaled(self, device):
        """inv_freq and attention scaling of a scaled RoPE, from transformers' own ROPE_INIT_FUNCTIONS."""
        if device not in self._scaled:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            self._scaled[device] = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, device)
        return self._scaled[device]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """position_ids (b, L) -> cos, sin of shape (b, 1, L, head_dim), in `dtype`."""
        d = self.head_dim
        if self.rope_type != "default":
            inv_freq, scaling = self.scaled(position_ids.device)
            freqs = position_ids.float()[..., None] * inv_freq.float()
            emb = torch.cat([freqs, freqs], dim=-1)
            return (emb.cos() * scaling).to(dtype)[:, None], (emb.sin() * scaling).to(dtype)[:, None]
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
        self.sliding_window, self.is_causal = _layer_attention(config, layer_idx)

    def _mask(self, attention_mask, position_ids, q_len: int, k_len: int):
        """The caller's mask combined with this layer's own (window, causality). Cached keys (k_len beyond the
        new positions) are taken to hold positions 0.. in order, as the decoding loop keeps them."""
        if self.sliding_window is None and not self.is_causal:
            return attention_mask
        cached = k_len - position_ids.shape[1]
        k_pos = torch.cat([torch.arange(cached, device=position_ids.device).expand(position_ids.shape[0], -1),
                           position_ids], dim=1)
        own = _layout_mask(position_ids[:, -q_len:], k_pos, self.sliding_window, self.is_causal)
        if attention_mask is None:
            return own
        if attention_mask.dtype == torch.bool:
            return attention_mask & own
        return torch.where(own, attention_mask, torch.finfo(attention_mask.dtype).min)

    def forward(self, hidden_states, target_hidden, cos, sin, attention_mask=None, past_key_values=None,
                position_ids=None):
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
        if position_ids is not None:
            attention_mask = self._mask(attention_mask, position_ids, q_len, k.shape[2])
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


def _grouped_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """DFlash2's grouped dynamic causal convolution over one block x (b, q_len, H): token p gets
    sum over taps t <= p of (base[t] + dynamic[p, t, group]) * x[p - t]; dynamic (b, q_len, taps, G)."""
    b, length, hidden = x.shape
    taps, groups = base.shape[0], hidden // group_size
    xs = x.view(b, length, groups, group_size)
    coef = base.to(x.dtype).view(1, 1, taps, groups, group_size) + dynamic.to(x.dtype)[..., None]
    out = coef[:, :, 0] * xs
    for t in range(1, min(taps, length)):
        out = out + coef[:, :, t] * F.pad(xs[:, :-t], (0, 0, 0, 0, t, 0))
    return out.reshape(b, length, hidden)


class DFlashGroupedConv(nn.Module):
    """`attention_conv` / `mlp_conv` of a DFlash2 layer: `base_kernel` (2, taps, H) and `kernel_projection`
    (H -> 2 * taps * H / group_size); side 0 before the wrapped module, side 1 after it."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size, self.groups = taps, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def prepare(self, x: torch.Tensor):
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)
        return _grouped_conv(x, dyn[:, :, 0], self.base_kernel[0], self.group_size), dyn[:, :, 1]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return _grouped_conv(x, dynamic, self.base_kernel[1], self.group_size)


class DFlashCandidateSelector(nn.Module):
    """DFlash2's candidate selector: among the top `selector_top_k` draft tokens of each position, the greedy
    left-to-right pick of `unary + <predecessor_codebook[prev] * hidden_projection(h), successor_codebook[c]>`."""

    def __init__(self, config):
        super().__init__()
        rank = int(_dflash_value(config, "selector_rank"))
        self.top_k = int(_dflash_value(config, "selector_top_k"))
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, first_token: torch.Tensor) -> torch.Tensor:
        """hidden (b, n, H), logits (b, n, V), first_token (b,) -> the picks (b, n)."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        h = self.hidden_projection(hidden)
        prev, picks = first_token, []
        for i in range(hidden.shape[1]):
            pred = self.predecessor_codebook[prev].to(h.dtype) * h[:, i]
            succ = self.successor_codebook[candidates[:, i]].to(h.dtype)
            scores = unary[:, i] + torch.einsum("br,bkr->bk", pred, succ)
            prev = candidates[:, i].gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
            picks.append(prev)
        return torch.stack(picks, dim=1)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)
        taps = _dflash_value(config, "conv_kernel_size")
        self.convolved = bool(taps)
        if self.convolved:  # DFlash2
            group = int(_dflash_value(config, "conv_group_size"))
            self.attention_conv = DFlashGroupedConv(config.hidden_size, int(taps), group)
            self.mlp_conv = DFlashGroupedConv(config.hidden_size, int(taps), group)

    def forward(self, hidden_states, target_hidden, cos, sin, attention_mask=None, past_key_values=None,
                position_ids=None):
        x = hidden_states
        h = self.input_layernorm(x)
        if self.convolved:
            h, post = self.attention_conv.prepare(h)
        h = self.self_attn(h, target_hidden, cos, sin, attention_mask, past_key_values, position_ids)
        x = x + (self.attention_conv.finish(h, post) if self.convolved else h)
        h = self.post_attention_layernorm(x)
        if self.convolved:
            h, post = self.mlp_conv.prepare(h)
        h = self.mlp(h)
        return x + (self.mlp_conv.finish(h, post) if self.convolved else h)


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
        self.rotary_emb = DFlashRotary(head_dim, _rope_theta(config), config)
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
            x = layer(x, ctx, cos, sin, attention_mask, cache, position_ids)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        return output_head(hidden.to(output_head.weight.dtype))

    def propose(self, hidden: torch.Tensor, first_token: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        """The drafted tokens (b, n) of the block positions' hidden states (b, n, H)."""
        return self.compute_logits(hidden, output_head).argmax(-1)

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
            block[:, 1:] = self.propose(hidden[:, 1:], block[:, 0], head)
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


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 (z-lab's released layout, `architectures: ["DFlash2DraftModel"]`): DFlash with grouped dynamic
    convolutions around every layer's attention and MLP (`layers.N.{attention,mlp}_conv.*`), draft logits
    `output_multiplier * head(h)` soft-capped at `final_logit_softcapping`, and a candidate selector
    (`candidate_selector.*`) that picks each drafted token among the top `selector_top_k`."""

    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        self.candidate_selector = DFlashCandidateSelector(config)
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DFlashGroupedConv):
            with torch.no_grad():
                module.base_kernel.zero_()
                module.base_kernel[:, 0] = 1.0

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        logits = output_head(hidden.to(output_head.weight.dtype))
        logits = logits * float(_dflash_value(self.config, "output_multiplier", 1.0) or 1.0)
        cap = _dflash_value(self.config, "final_logit_softcapping")
        if cap:
            logits = torch.tanh(logits / float(cap)) * float(cap)
        return logits

    def propose(self, hidden: torch.Tensor, first_token: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        logits = self.compute_logits(hidden, output_head)
        return self.candidate_selector.select(hidden.to(logits.dtype), logits, first_token)
