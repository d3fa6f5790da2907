"""Real greedy speculative decoding with a DFlash drafter (DESIGN §2b), and the target's own greedy decoding.

One round, at `start` = the position of the last committed token (committed, not yet seen by the target):

* the drafter gets the block `[token[start], MASK x (B-1)]` at positions start..start+B-1; its queries see the
  context features of every committed position before `start` (its cache, below) and the block itself, as in
  training (a block sees the context strictly before its anchor); it proposes B-1 tokens (argmax; a DFlash2
  drafter: its candidate selector's greedy path);
* the target runs once over the block; `posterior[i]` = argmax at position start+i;
* acceptance = the number of leading proposals equal to the target's own choice; the accepted tokens and the
  target's bonus token `posterior[acceptance]` are committed (acceptance length `acceptance + 1`, 1..B);
* the target's state is rolled back to `start + acceptance + 1` tokens; the tapped features of the committed
  block positions join the drafter's context.

Rolling back the target:
* attention layers: the KV cache is cropped;
* GatedDeltaNet (linear-attention) layers keep a recurrent state that cannot be cropped: their conv and
  recurrent states are snapshotted before the verify forward; after a rejection they are restored and the
  target re-reads the committed tokens (one extra forward of acceptance+1 tokens per rejected round). Serving
  engines keep per-token state buffers instead (SGLang `extra_buffer`); this is the simple exact choice.

The drafter's cache holds only context K/V: in DFlash every layer's context K/V is a function of the fused
context feature alone (not of the block), so committed positions are appended once and never cropped; the
block's own K/V are recomputed each round (B tokens).

Acceptance is counted in output tokens: a round that crosses EOS or `max_new_tokens` counts only the tokens kept,
so the rounds' acceptances sum to the output's length minus the prefill's token, and the mean acceptance length
is (new tokens - 1) / (target forwards - 1), the definition `prompt_lookup_generate` (transformers' prompt-lookup
decoding, the baseline of `dflash eval --suite`) is measured with.

Greedy speculative decoding is lossless: its output equals `greedy_generate` token for token (tested in
float32). In bfloat16 the verify forward over B tokens and the one-token forward of plain decoding round
differently, so where the target's top two logits are within rounding of each other (a numerical tie) the two
may pick different tokens; `dflash.evaluation.evaluate` tells such ties from real mismatches by the reference's margin.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dflash.models.attention import FULL, LayerMask, dense_mask
from dflash.models.drafter import Drafter, apply_rope, arch_rope_cos_sin
from dflash.models.target import Target


# ---------------------------------------------------------------------------------------------- target side
def _linear_layer_mixin():
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:  # pragma: no cover - older transformers
        return None
    return LinearAttentionCacheLayerMixin


class TargetSession:
    """The target with a cache for one sequence: prefill, verify a block, roll back to a length."""

    def __init__(self, target: Target, vocab_limit: int | None = None):
        self.target = target
        self.model = target.model
        self.device = target.embed_tokens.weight.device
        self.vocab_limit = vocab_limit  # argmax only over ids < vocab_limit (the tokenizer's ids)
        self.cache = None
        self.length = 0  # tokens the cache holds
        self._linear = _linear_layer_mixin()
        # transformers renamed `past_key_values` to `cache` (5.2x); an unknown name would be swallowed by **kwargs
        params = inspect.signature(type(self.model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _forward(self, ids: torch.Tensor, logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (L, V) and tapped features (L, n*H) of `ids` (1, L) appended at position `self.length`."""
        positions = torch.arange(self.length, self.length + ids.shape[1], device=self.device)[None]
        with self.target.capture_all():
            out = self.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=logits_to_keep,
                             **{self._cache_kwarg: self.cache})
            feats = self.target.captured_features()
        self.cache = out.cache if self._cache_kwarg == "cache" else out.past_key_values
        self.length += ids.shape[1]
        return out.logits[0], feats[0]

    def _limit(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
            return logits[..., : self.vocab_limit]
        return logits

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self._limit(logits).argmax(-1)

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> tuple[int, float, torch.Tensor]:
        """First generated token, its margin, and the features of the prompt positions."""
        logits, feats = self._forward(prompt[None].to(self.device))
        token, margin = self.choose(logits[-1])
        return token, margin, feats

    @torch.no_grad()
    def step(self, token: int) -> tuple[int, float]:
        """The next greedy token and its margin (top-1 minus top-2 logit, relative to the top-1's size)."""
        logits, _ = self._forward(torch.tensor([[token]], device=self.device), logits_to_keep=1)
        return self.choose(logits[-1])

    def choose(self, row: torch.Tensor) -> tuple[int, float]:
        row = self._limit(row)
        top = row.float().topk(2)
        margin = float(top.values[0] - top.values[1]) / max(1.0, abs(float(top.values[0])))
        return int(row.argmax()), margin  # argmax, as in `verify`: the same tie-breaking

    # -- verify and roll back
    def _linear_layers(self) -> list:
        if self.cache is None or self._linear is None:
            return []
        return [layer for layer in getattr(self.cache, "layers", []) if isinstance(layer, self._linear)]

    def _snapshot(self) -> list[tuple]:
        snap = []
        for layer in self._linear_layers():
            snap.append((layer, {k: None if v is None else v.clone() for k, v in layer.conv_states.items()},
                         {k: None if v is None else v.clone() for k, v in layer.recurrent_states.items()},
                         dict(layer.has_previous_state)))
        return snap

    def _crop_attention(self, keep: int) -> None:
        remove = self.length - keep
        if remove <= 0:
            return
        layers = getattr(self.cache, "layers", None)
        if layers is None:  # pragma: no cover - legacy cache object
            self.cache.crop(keep)
        else:
            for layer in layers:
                if self._linear is not None and isinstance(layer, self._linear):
                    if hasattr(layer, "keys"):  # a layer with both linear and full attention parts
                        from transformers.cache_utils import DynamicLayer

                        DynamicLayer.crop(layer, -remove)
                    continue
                layer.crop(-remove)
        self.length = keep

    @torch.no_grad()
    def verify(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Target argmax at every block position, the block's features, and a rollback snapshot."""
        snapshot = self._snapshot()
        logits, feats = self._forward(block[None].to(self.device))
        return self.argmax(logits), feats, snapshot

    @torch.no_grad()
    def rollback(self, keep: int, block: torch.Tensor, snapshot: list) -> None:
        """Keep `keep` tokens in the cache; the last `keep - (length - len(block))` of them are `block`'s head."""
        if keep == self.length:
            return
        start = self.length - block.shape[0]
        if not snapshot:
            self._crop_attention(keep)
            return
        for layer, conv, rec, prev in snapshot:  # recurrent state: back to `start`, then re-read the block head
            layer.conv_states.update(conv)
            layer.recurrent_states.update(rec)
            layer.has_previous_state.update(prev)
        self._crop_attention(start)
        self._forward(block[None, : keep - start].to(self.device), logits_to_keep=1)


# ---------------------------------------------------------------------------------------------- drafter side
class DrafterSession:
    """The drafter's context K/V for one sequence (per layer), appended as positions are committed."""

    def __init__(self, drafter: Drafter, target: Target):
        self.drafter = drafter
        self.arch = drafter.arch
        self.dtype = next(drafter.parameters()).dtype
        self.device = next(drafter.parameters()).device
        self.embed = target.embed_tokens
        self.head = target.lm_head.weight
        self.keys: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.values: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.length = 0

    @torch.no_grad()
    def append(self, features: torch.Tensor) -> None:
        """Context features (n, n_tapped*H) of the next n committed positions."""
        if features.shape[0] == 0:
            return
        a, d = self.arch, self.arch.head_dim
        ctx = self.drafter.hidden_norm(self.drafter.fc(features.to(self.device, self.dtype)[None]))
        n = ctx.shape[1]
        pos = torch.arange(self.length, self.length + n, device=self.device)[None]
        cos, sin = arch_rope_cos_sin(a, pos, self.dtype)
        for i, layer in enumerate(self.drafter.layers):
            att = layer.self_attn
            k = apply_rope(att.k_norm(att.k_proj(ctx).view(1, n, -1, d)).transpose(1, 2), cos, sin)
            v = att.v_proj(ctx).view(1, n, -1, d).transpose(1, 2)
            self.keys[i] = k if self.keys[i] is None else torch.cat([self.keys[i], k], dim=2)
            self.values[i] = v if self.values[i] is None else torch.cat([self.values[i], v], dim=2)
        self.length += n

    @torch.no_grad()
    def hidden(self, block: torch.Tensor) -> torch.Tensor:
        """Final hidden states (B, H) of the block anchored at position `self.length`."""
        a, d = self.arch, self.arch.head_dim
        bs = block.shape[0]
        x = self.embed(block.to(self.embed.weight.device)[None]).to(self.device, self.dtype)
        pos = torch.arange(self.length, self.length + bs, device=self.device)[None]
        cos, sin = arch_rope_cos_sin(a, pos, self.dtype)
        for i, layer in enumerate(self.drafter.layers):
            att = layer.self_attn

            def attention(h, i=i, att=att):
                q = apply_rope(att.q_norm(att.q_proj(h).view(1, bs, -1, d)).transpose(1, 2), cos, sin)
                k = apply_rope(att.k_norm(att.k_proj(h).view(1, bs, -1, d)).transpose(1, 2), cos, sin)
                v = att.v_proj(h).view(1, bs, -1, d).transpose(1, 2)
                if self.keys[i] is not None:
                    k, v = torch.cat([self.keys[i], k], dim=2), torch.cat([self.values[i], v], dim=2)
                mask = self.block_mask(att.layer_mask, bs)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
                return att.o_proj(out.transpose(1, 2).reshape(1, bs, -1))

            x = layer.mlp_part(layer.attention_part(x, attention))  # a DFlash2 layer's convolutions inside
        return self.drafter.norm(x)[0]

    def block_mask(self, layer: LayerMask, block_size: int) -> torch.Tensor | None:
        """The training mask of one block anchored at `self.length` over [cached context ; block]: the same
        predicate (a sliding layer's window, in-block causality) as in training; None for a full layer, which
        sees every key (the cache holds only positions before the anchor)."""
        if layer == FULL:
            return None
        anchors = torch.tensor([[self.length]], device=self.device)
        return dense_mask(anchors, self.length, block_size, layer)

    @torch.no_grad()
    def propose(self, first_token: int, vocab_limit: int | None) -> torch.Tensor:
        """The block [first_token, d_1 .. d_{B-1}]: the drafter's argmax at positions 1..B-1."""
        bs = self.arch.block_size
        block = torch.full((bs,), self.arch.mask_token_id, dtype=torch.long, device=self.device)
        block[0] = first_token
        hidden = self.hidden(block)[1:]
        logits = self.drafter.logits(hidden, self.head.to(self.device, self.dtype))
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits = logits[:, :vocab_limit]
        if self.arch.dflash2:  # the candidate selector's greedy path over the top-k (dflash.models.dflash2)
            block[1:] = self.drafter.candidate_selector.select(hidden, logits, block[0])
        else:
            block[1:] = logits.argmax(-1)
        return block


# ---------------------------------------------------------------------------------------------- the loops
@dataclass
class Generation:
    tokens: list[int]  # generated tokens (the prompt excluded), ending at EOS or max_new_tokens
    seconds: float
    acceptance: list[int] = field(default_factory=list)  # speculative: output tokens committed per round (1..B)
    margins: list[float] = field(default_factory=list)  # greedy: relative top-1/top-2 logit gap of each token
    forwards: int = 0  # prompt lookup: the target's forward calls (the prefill included)

    @property
    def mean_acceptance(self) -> float:
        """Output tokens per target forward after the prefill's first token: (new tokens - 1) / rounds."""
        if self.acceptance:
            return sum(self.acceptance) / len(self.acceptance)
        return (len(self.tokens) - 1) / (self.forwards - 1) if self.forwards > 1 else 0.0


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy_generate(target: Target, prompt: torch.Tensor, max_new_tokens: int, eos_ids: Sequence[int],
                    vocab_limit: int | None = None) -> Generation:
    """The target's own greedy decoding with its KV cache, one token per forward."""
    session = TargetSession(target, vocab_limit)
    eos = set(eos_ids)
    t0 = time.perf_counter()
    token, margin, _ = session.prefill(prompt)
    tokens, margins = [token], [margin]
    while len(tokens) < max_new_tokens and token not in eos:
        token, margin = session.step(token)
        tokens.append(token)
        margins.append(margin)
    _sync(session.device)
    return Generation(tokens, time.perf_counter() - t0, margins=margins)


@torch.no_grad()
def speculative_generate(target: Target, drafter: Drafter, prompt: torch.Tensor, max_new_tokens: int,
                         eos_ids: Sequence[int], vocab_limit: int | None = None) -> Generation:
    """Greedy DFlash speculative decoding of one prompt (the module docstring has the round)."""
    tsess = TargetSession(target, vocab_limit)
    dsess = DrafterSession(drafter, target)
    eos = set(eos_ids)
    t0 = time.perf_counter()
    token, _, feats = tsess.prefill(prompt)
    dsess.append(feats)
    tokens, acceptance = [token], []
    while len(tokens) < max_new_tokens and not (eos and eos.intersection(tokens[-(dsess.arch.block_size):])):
        start = tsess.length  # position of `token`, the last committed one
        block = dsess.propose(token, vocab_limit).to(tsess.device)
        posterior, bfeats, snapshot = tsess.verify(block)
        matches = (block[1:] == posterior[:-1]).int()
        accepted = int(matches.cumprod(0).sum())
        committed = block[1: accepted + 1].tolist() + [int(posterior[accepted])]
        tokens.extend(committed)
        acceptance.append(accepted + 1)
        tsess.rollback(start + accepted + 1, block, snapshot)
        dsess.append(bfeats[: accepted + 1])
        token = tokens[-1]
    _sync(tsess.device)
    kept = _until_eos(tokens, eos)[:max_new_tokens]
    if acceptance:  # the last round counts the tokens kept (>= 1: the round before it ended short of the cut)
        acceptance[-1] -= len(tokens) - len(kept)
    return Generation(kept, time.perf_counter() - t0, acceptance)


PROMPT_LOOKUP_NGRAM = 2  # transformers' default max_matching_ngram_size (PromptLookupCandidateGenerator)


@torch.no_grad()
def prompt_lookup_generate(target: Target, prompt: torch.Tensor, max_new_tokens: int, eos_ids: Sequence[int],
                           vocab_limit: int | None = None, num_tokens: int = 15,
                           max_ngram: int = PROMPT_LOOKUP_NGRAM) -> Generation:
    """Greedy prompt-lookup decoding of one prompt by transformers (`generate(do_sample=False,
    prompt_lookup_num_tokens=num_tokens, max_matching_ngram_size=max_ngram)`): candidates are copied from the
    sequence where its last n-gram occurred before, and the target verifies them in one forward. A forward hook
    counts the target's calls (`forwards`, the prefill included). Ids >= `vocab_limit` are suppressed, as the
    argmax of `greedy_generate` ignores them."""
    model = target.model
    device = target.embed_tokens.weight.device
    vocab = int(target.lm_head.weight.shape[0])
    calls = [0]

    def count(_module, _args):
        calls[0] += 1

    handle = model.register_forward_pre_hook(count)
    ids = prompt[None].to(device)
    eos = list(eos_ids)
    try:
        t0 = time.perf_counter()
        with target.capture_all():  # the whole forward runs (Target stops at its deepest tapped layer otherwise)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 prompt_lookup_num_tokens=num_tokens, max_matching_ngram_size=max_ngram,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                                 pad_token_id=eos[0] if eos else 0,
                                 suppress_tokens=list(range(vocab_limit, vocab))
                                 if vocab_limit is not None and vocab_limit < vocab else None)
        _sync(device)
        seconds = time.perf_counter() - t0
    finally:
        handle.remove()
    tokens = out[0, ids.shape[1]:].tolist()
    return Generation(_until_eos(tokens, set(eos))[:max_new_tokens], seconds, forwards=calls[0])


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First position where the two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
