"""DFlash2: the DFlash drafter plus grouped dynamic convolutions, a candidate selector and logit scaling.

Learned from the public implementations (docs/method.md, "DFlash2"): z-lab `dflash/model.py`
(`GroupedDynamicCausalConv`, `CandidateSelector`, `DFlashDraftModel.compute_logits`) and vLLM
`vllm/model_executor/models/qwen3_dflash2.py` (`_grouped_conv`, `_score_edges`). What they compute:

* every decoder layer wraps its attention and its MLP in a grouped dynamic causal convolution: a linear
  `kernel_projection` (H -> 2 * taps * G, G = H / conv_group_size groups) of the layer's normalized input gives,
  per token, a kernel offset per tap and group for the input side (before attention / MLP) and for the output
  side (after it); the kernel of channel c at tap t is `base_kernel[side, t, c] + dynamic[side, t, group(c)]`,
  and tap t multiplies the value t tokens earlier in the same block (none before the block's first token);
* draft logits are `output_multiplier * (h @ lm_head^T)`, then soft-capped `c * tanh(x / c)`
  (`final_logit_softcapping` c, none when 0/absent) — z-lab's order;
* the candidate selector takes the top `selector_top_k` tokens of each position's draft logits and picks one by
  `unary + <predecessor_codebook[prev] * hidden_projection(h), successor_codebook[candidate]>`, left to right,
  `prev` being the block's first token at position 1 and the previous pick after.

The training objective of the selector is not public: see `selector_loss`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def grouped_dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int,
                         block_size: int) -> torch.Tensor:
    """x (b, L, H) made of consecutive blocks of `block_size` tokens; dynamic (b, L, taps, G); base (taps, H).
    Output token p: sum over taps t <= (p mod block_size) of (base[t] + dynamic[p, t, group]) * x[p - t]."""
    b, length, hidden = x.shape
    taps = base.shape[0]
    groups = hidden // group_size
    xs = x.view(b, length, groups, group_size)
    coef = base.to(x.dtype).view(1, 1, taps, groups, group_size) + dynamic.to(x.dtype)[..., None]
    out = coef[:, :, 0] * xs
    offset = torch.arange(length, device=x.device) % block_size
    for t in range(1, min(taps, block_size)):
        earlier = F.pad(xs[:, :-t], (0, 0, 0, 0, t, 0))
        out = out + coef[:, :, t] * earlier * (offset >= t).to(x.dtype).view(1, length, 1, 1)
    return out.reshape(b, length, hidden)


class GroupedDynamicConv(nn.Module):
    """`attention_conv` / `mlp_conv` of a DFlash2 layer (weights `base_kernel` (2, taps, H),
    `kernel_projection.weight` (2 * taps * G, H), the published names and shapes)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} does not divide hidden_size {hidden_size}")
        self.taps, self.group_size, self.groups = taps, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0  # identity at initialization
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def prepare(self, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The input side applied to x, and the output side's dynamic kernels (from the same x)."""
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)
        return (grouped_dynamic_conv(x, dyn[:, :, 0], self.base_kernel[0], self.group_size, block_size),
                dyn[:, :, 1])

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor, block_size: int) -> torch.Tensor:
        return grouped_dynamic_conv(x, dynamic, self.base_kernel[1], self.group_size, block_size)


def draft_logits(hidden: torch.Tensor, head_weight: torch.Tensor, output_multiplier: float = 1.0,
                 softcap: float | None = None) -> torch.Tensor:
    logits = hidden @ head_weight.to(hidden.dtype).t()
    if output_multiplier != 1.0:
        logits = logits * output_multiplier
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


class CandidateSelector(nn.Module):
    """`candidate_selector.{predecessor_codebook, successor_codebook}` (V, r) and `hidden_projection.weight`
    (r, H): the published names (the codebooks are plain tensors, no `.weight`)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
               predecessors: torch.Tensor) -> torch.Tensor:
        """hidden (..., H), unary and candidates (..., K), predecessors (...): the score of every candidate."""
        h = self.hidden_projection(hidden)
        pred = self.predecessor_codebook[predecessors].to(h.dtype)
        succ = self.successor_codebook[candidates].to(h.dtype)
        return unary + torch.einsum("...r,...kr->...k", pred * h, succ)

    @torch.no_grad()
    def select(self, hidden: torch.Tensor, logits: torch.Tensor, first_token: torch.Tensor) -> torch.Tensor:
        """Greedy left-to-right picks. hidden (n, H), logits (n, V), first_token () -> (n,) token ids."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        prev = first_token.reshape(())
        picks = []
        for i in range(hidden.shape[0]):
            s = self.scores(hidden[i], unary[i], candidates[i], prev)
            prev = candidates[i, torch.argmax(s)]
            picks.append(prev)
        return torch.stack(picks)


def selector_loss(selector: CandidateSelector, rows: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                  predecessors: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The selector's training term (not public; the choice documented in docs/method.md): teacher-forced, the
    predecessor is the true previous token; the candidates are the top-K of the (detached) draft logits with the
    label put in place of the last one when absent; cross-entropy of the scores over the K candidates toward the
    label, weighted by the position's decay `w`. Returns (weighted sum, hit (N,) bool: the label was among the
    plain top-K and the selector picked it)."""
    unary, candidates = torch.topk(logits, selector.top_k, dim=-1)
    present = candidates == labels[:, None]
    inside = present.any(-1)
    forced = candidates.clone()
    forced[:, -1] = torch.where(inside, candidates[:, -1], labels)
    forced_unary = logits.gather(-1, forced)
    scores = selector.scores(rows, forced_unary, forced, predecessors).float()
    target = (forced == labels[:, None]).float().argmax(-1)
    ce = F.cross_entropy(scores, target, reduction="none")
    with torch.no_grad():
        plain = selector.scores(rows, unary, candidates, predecessors)
        hit = inside & (candidates.gather(-1, plain.argmax(-1, keepdim=True))[:, 0] == labels)
    return (ce * w).sum(), hit
