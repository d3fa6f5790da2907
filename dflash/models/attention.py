"""DFlash training attention: each block sees the context strictly before its anchor and itself, nothing else.

Keys are laid out as [context (T positions) ; blocks (m*B positions)], queries as [blocks (m*B)].
Two equivalent implementations: a dense boolean mask for SDPA (CPU, reference) and a flex_attention
BlockMask (CUDA). Both read the same predicate, `visible`.

A drafter layer is `full_attention` (the paper's layer: the whole context before the anchor, its block
bidirectionally) or `sliding_attention` (a `LayerMask` with a window, causal inside the block), with the
semantics serving engines apply to DFlash drafters, followed here exactly:
* sglang `python/sglang/srt/models/dflash.py` (`_get_dflash_layer_attention_params`): a sliding layer is a
  causal (DECODER) attention with window_left = sliding_window - 1 (`dflash_utils.py`: "HF sliding windows
  include the current token"); a full layer is bidirectional (ENCODER_ONLY);
* z-lab `dflash/model.py` (`Qwen3DFlashAttention`, `_attention_mask`): `is_causal` unset means causal for
  sliding layers, bidirectional for full ones; a key is inside the window when
  `query_position - key_position < sliding_window` (and, for a non-causal window, also
  `key_position - query_position < sliding_window`), positions being absolute token positions;
* SpecForge `specforge/modeling/draft/dflash_mask.py` (`create_dflash_sdpa_mask`), the same in training: the
  window is measured from the query's own position anchor + offset, not from the anchor ("the current draft
  token occupies one slot in the window").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.config import FLEX_MASK_TILE, check_flex_options


@dataclass(frozen=True)
class LayerMask:
    """What one drafter layer's queries see: `window` None = the whole context before the anchor, else the
    keys less than `window` positions before the query (the query itself counted, as in Hugging Face);
    `causal`: inside the block, only the block's earlier positions and the query's own."""

    window: int | None = None
    causal: bool = False


FULL = LayerMask()


# Defaults are None, not FULL: torch 2.11's dynamo cannot wrap a LayerMask held in a default argument (a graph
# break inside a compiled drafter forward); a global FULL it reads by name.
def visible(q_idx, kv_idx, anchors_b, ctx_len: int, block_size: int, layer: LayerMask | None = None):
    """True where query `q_idx` (a block token) may attend key `kv_idx`. `anchors_b`: (m,) of one sequence."""
    layer = FULL if layer is None else layer
    block = q_idx // block_size
    in_ctx = kv_idx < ctx_len
    ctx_ok = kv_idx < anchors_b[block]  # strictly before the anchor
    own_block = (kv_idx - ctx_len) // block_size == block
    if layer.window is None and not layer.causal:  # the paper's layer, computed exactly as before layouts existed
        return torch.where(in_ctx, ctx_ok, own_block)
    offset, kv_offset = q_idx % block_size, (kv_idx - ctx_len) % block_size
    if layer.window is not None:  # measured from the query's own position, anchor + offset
        ctx_ok = ctx_ok & (anchors_b[block] + offset - kv_idx < layer.window)
        own_block = own_block & (offset - kv_offset < layer.window)
        if not layer.causal:
            own_block = own_block & (kv_offset - offset < layer.window)
    if layer.causal:
        own_block = own_block & (kv_offset <= offset)
    return torch.where(in_ctx, ctx_ok, own_block)


def dense_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, layer: LayerMask | None = None) -> torch.Tensor:
    """(b, 1, m*B, T+m*B) boolean mask for SDPA."""
    b, m = anchors.shape
    q_idx = torch.arange(m * block_size, device=anchors.device)[:, None]
    kv_idx = torch.arange(ctx_len + m * block_size, device=anchors.device)[None, :]
    masks = [visible(q_idx, kv_idx, anchors[i], ctx_len, block_size, layer) for i in range(b)]
    return torch.stack(masks)[:, None]


def row_key_intervals(anchors: torch.Tensor, rows: torch.Tensor, ctx_len: int, block_size: int,
                      layer: LayerMask) -> tuple[torch.Tensor, ...]:
    """The two key intervals query row `rows` sees, [ctx_lo, ctx_hi) and [own_lo, own_hi): (b, rows, 1) and
    (rows, 1) tensors. Rows past the last block are clamped to it (their keys are discarded by the caller)."""
    m = anchors.shape[1]
    blk = (rows // block_size).clamp(max=m - 1)
    offset = rows - blk * block_size
    anchor = anchors[:, blk]
    ctx_hi = anchor.clamp(max=ctx_len)[..., None]
    ctx_lo = torch.zeros_like(ctx_hi)
    start = (ctx_len + blk * block_size)[:, None]
    lo_off, hi_off = torch.zeros_like(offset), torch.full_like(offset, block_size)
    if layer.window is not None:
        ctx_lo = (anchor + offset - layer.window + 1).clamp(min=0)[..., None]
        lo_off = (offset - layer.window + 1).clamp(min=0)
        if not layer.causal:
            hi_off = (offset + layer.window).clamp(max=block_size)
    if layer.causal:
        hi_off = torch.minimum(hi_off, offset + 1)
    return ctx_lo, ctx_hi, start + lo_off[:, None], start + hi_off[:, None]


@torch.compiler.disable  # eager even inside a compiled drafter forward: see the docstring
def flex_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, tile: int = FLEX_MASK_TILE,
                    layer: LayerMask | None = None):
    """BlockMask of `visible`, built from its structure instead of evaluating the predicate everywhere.

    Row r (block r // B, anchor a) sees the context [0, a) and its own block's keys (a sliding layer: the
    parts of both inside its window; a causal one: the block up to the row), so the number of keys
    it sees in a kv tile is the overlap of two intervals with the tile. A tile is *full* when every row of
    the q tile sees all of it, *partial* (mask_mod applied) when some row sees some of it. Tiles that cross
    the end of Q or KV are never full, as in `create_block_mask`, which pads the dense mask with False.
    `create_block_mask` itself either materialises the (b, m*B, T+m*B) predicate (eager) or compiles it
    (`_compile=True`: 3 minutes of kernel compilation on an H200 at training shapes, measured); this costs
    a few small tensor ops (about 6 ms a batch on an H200) and gives the same BlockMask
    (tests/test_attention_and_drafter.py). It stays out of `torch.compile` graphs: a trainer whose compiled
    drafter forward contained it was still compiling Triton kernels after 2 minutes (docs/PERFORMANCE.md),
    and eagerly it costs little."""
    from torch.nn.attention.flex_attention import BlockMask

    layer = FULL if layer is None else layer
    b, m = anchors.shape
    q_len, kv_len = m * block_size, ctx_len + m * block_size
    nq, nkv = -(-q_len // tile), -(-kv_len // tile)
    dev = anchors.device
    rows = torch.arange(nq * tile, device=dev)
    lo = torch.arange(nkv, device=dev) * tile  # kv tile starts
    hi = (lo + tile).clamp(max=kv_len)  # ends, clipped to the real keys
    ctx_lo, ctx_hi, own_lo, own_hi = row_key_intervals(anchors, rows, ctx_len, block_size, layer)
    seen = (torch.minimum(hi, ctx_hi) - torch.maximum(lo, ctx_lo)).clamp(min=0)
    seen = seen + (torch.minimum(hi, own_hi) - torch.maximum(lo, own_lo)).clamp(min=0)
    seen = (seen * (rows < q_len)[:, None]).view(b, nq, tile, nkv)  # padded rows see nothing
    full = (seen == tile).all(2)
    partial = (seen > 0).any(2) & ~full

    def blocks_of(sel: torch.Tensor):
        count = sel.sum(-1, dtype=torch.int32)[:, None]
        order = torch.argsort(sel.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return count, order[:, None]

    def mask_mod(bi, _h, q_idx, kv_idx):
        return visible(q_idx, kv_idx, anchors[bi], ctx_len, block_size, layer)

    return BlockMask.from_kv_blocks(*blocks_of(partial), *blocks_of(full), BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(q_len, kv_len))


@torch.compiler.disable  # eager, like flex_block_mask: the one graph break of a compiled drafter forward
def flex_block_masks(anchors: torch.Tensor, ctx_len: int, block_size: int, specs: tuple[tuple, ...]) -> tuple:
    """One BlockMask per layer (`specs`: (window, causal) per layer; equal layouts share one mask). Layouts
    cross the graph break as plain tuples: torch 2.11's dynamo could not rebuild LayerMask objects there."""
    built: dict[tuple, object] = {}
    for spec in specs:
        if spec not in built:
            built[spec] = flex_block_mask(anchors, ctx_len, block_size, layer=LayerMask(*spec))
    return tuple(built[spec] for spec in specs)


class AttentionBackend:
    """Builds the masks once per batch (one per distinct layer layout) and runs every layer's attention."""

    def __init__(self, kind: str, anchors: torch.Tensor, ctx_len: int, block_size: int, compiled=None,
                 layers: tuple[LayerMask, ...] | None = None):
        self.kind = kind
        layers = (FULL,) if layers is None else layers
        specs = tuple((layer.window, layer.causal) for layer in layers)
        if kind == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            self.masks = flex_block_masks(anchors, ctx_len, block_size, specs)
            self._flex = compiled if compiled is not None else flex_attention  # `or` breaks dynamo graphs
        else:
            built = {}
            for spec, layer in zip(specs, layers, strict=True):
                if spec not in built:
                    built[spec] = dense_mask(anchors, ctx_len, block_size, layer)
            self.masks = tuple(built[spec] for spec in specs)

    @property
    def mask(self):
        """The first layer's mask (the only one of a drafter without sliding layers)."""
        return self.masks[0]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int = 0) -> torch.Tensor:
        """q: (b, hq, Lq, d); k, v: (b, hkv, Lk, d); the mask of layer `layer_index`."""
        gqa = q.shape[1] != k.shape[1]
        if self.kind == "flex":
            return self._flex(q, k, v, block_mask=self.masks[layer_index], enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.masks[layer_index], enable_gqa=gqa)


# flex_attention's kernel tiles chosen by measurement at the drafter's training shape (bench/flex_tiles.py,
# docs/PERFORMANCE.md), by (compute capability, head_dim) in bf16. Shapes not listed keep torch's own choice.
# Hopper, head_dim 128: backward 64x64 tiles, 2 stages, 4 warps: 2.61 ms against torch's 64/128, 3 stages,
# 8 warps (2.82 ms) per layer at Qwen3-8B width. (A TMA forward measured 0.1 ms faster but is left out: it
# needs sequence lengths that are multiples of 128.)
TUNED_FLEX_OPTIONS: dict[tuple[tuple[int, int], int], dict[str, int | bool]] = {
    ((9, 0), 128): {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                    "bwd_num_stages": 2, "bwd_num_warps": 4},
}


def flex_options_for(setting: dict | None, device: torch.device, head_dim: int) -> dict[str, int | bool]:
    """The kernel_options flex_attention runs with: the config's (`{}` = torch's choice) or, unset, the tuned
    entry for this GPU and head_dim (none: torch's choice)."""
    if setting is not None:
        return check_flex_options(setting)
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return dict(TUNED_FLEX_OPTIONS.get((torch.cuda.get_device_capability(index), head_dim), {}))


# flex_attention's kernels: torch's Triton templates, or FlashAttention-4's CuTe DSL kernels (torch's BACKEND="FLASH",
# the flash-attn-4 package) on Hopper and Blackwell: the attention kernels of the drafter's step 12.1 ms against
# 18.5 with Triton at the Qwen3-8B drafter's training shape on an H200 (docs/PERFORMANCE.md). FA4 builds each
# kernel for a head_dim; auto uses it for the one measured in training (forward and backward): 128, every
# published drafter's.
FLEX_BACKENDS = ("auto", "triton", "flash")
FLASH_HEAD_DIMS = (128,)
FLASH_MIN_CAPABILITY = 9
FLASH_INSTALL = "pip install --pre 'dflash-trainer[flash]' (flash-attn-4 and NVIDIA's CuTe DSL)"


def flash_unusable(device: torch.device, head_dim: int) -> str | None:
    """Why the FLASH backend cannot run the drafter's attention here (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the run is on {device.type}, FlashAttention-4 needs a CUDA GPU"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if major < FLASH_MIN_CAPABILITY:
        return f"the GPU is sm_{major}{minor}; FlashAttention-4 needs Hopper (sm_90) or newer"
    if head_dim not in FLASH_HEAD_DIMS:
        return f"the drafter's head_dim is {head_dim}; FlashAttention-4 runs here for {FLASH_HEAD_DIMS}"
    from dflash.compile import flash_version

    if flash_version() is None:
        return f"flash-attn-4 is not installed ({FLASH_INSTALL})"
    return None


def resolve_flex_backend(requested: str, device: torch.device, head_dim: int) -> tuple[str, str | None]:
    """(backend, why not flash): `auto` is flash where it can run, else triton; `flash` where it cannot is an
    error (BadInput) naming the reason and the fix."""
    from dflash.errors import BadInput

    if requested not in FLEX_BACKENDS:
        raise BadInput(f"compile.flex_backend: {requested!r}; expected one of {', '.join(FLEX_BACKENDS)}")
    if requested == "triton":
        return "triton", "compile.flex_backend=triton"
    why = flash_unusable(device, head_dim)
    if requested == "flash" and why is not None:
        raise BadInput(f"compile.flex_backend=flash but {why}; install it or set compile.flex_backend=auto")
    return ("triton", why) if why is not None else ("flash", None)


FLASH_OPTIONS = {"BACKEND": "FLASH"}


def probe_flash(mode: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                device: torch.device, layers: tuple[LayerMask, ...] = (FULL,),
                tolerance: float = 2e-2) -> str | None:
    """Runs the FLASH backend once, forward and backward, on a small batch of each of the drafter's layer masks
    (`layers`: one per distinct layout) at its head layout, against the Triton kernels: None when they agree,
    else why not (a compile error, a kernel of a flash-attn-4 that does not match this torch, a wrong result).
    The kernels it builds are the ones the training shapes reuse (FA4 compiles per head layout and mask, not per
    length)."""
    from dflash.compile import is_compile_error, one_line

    ctx, m = 256, 8
    gen = torch.Generator(device=device).manual_seed(0)
    anchors = torch.linspace(16, ctx - 16, m, device=device).long()[None]
    lq, lk = m * block_size, ctx + m * block_size
    q, k, v, grad = (torch.randn(1, h, n, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
                     for h, n in ((num_heads, lq), (num_kv_heads, lk), (num_kv_heads, lk), (num_heads, lq)))
    for layer in dict.fromkeys(layers):
        mask = flex_block_mask(anchors, ctx, block_size, layer=layer)
        results = []
        for options in (FLASH_OPTIONS, None):
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
            fn = _compiled_flex_unguarded(mode, options)
            try:
                out = fn(qq, kk, vv, block_mask=mask, enable_gqa=num_heads != num_kv_heads)
                out.backward(grad)
                torch.cuda.synchronize(device)
            except Exception as exc:  # noqa: BLE001 - any failure of the optional kernels means: do not use them
                if options is None and not is_compile_error(exc):
                    raise
                return one_line(exc)
            results.append([out.detach().float(), qq.grad.float(), kk.grad.float(), vv.grad.float()])
        worst = max(float((a - b).norm() / b.norm().clamp(min=1e-30)) for a, b in zip(*results, strict=True))
        if not worst < tolerance:
            where = "" if layer == FULL else f" (layer layout {layer})"
            return (f"its result differs from the Triton kernels' by {worst:.2e} (relative), above "
                    f"{tolerance:.0e}{where}")
    return None


def _compiled_flex_unguarded(mode: str, kernel_options: dict | None):
    """flex_attention compiled with `kernel_options`, without a fallback (the probe wants the error)."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash.compile import torch_mode

    fn = functools.partial(flex_attention, kernel_options=dict(kernel_options)) if kernel_options else flex_attention
    return torch.compile(fn, dynamic=False, mode=torch_mode(mode))


_COMPILED_FLEX: dict[tuple, object] = {}


def compiled_flex_attention(mode: str = "default", kernel_options: dict | None = None):
    """flex_attention compiled once per process, mode and kernel options (one process per GPU: no cross-thread
    FX tracing), guarded by a fallback: with kernel options, to torch's own tiles (compiled); without, to eager
    flex_attention (the slow reference path). Each fallback logs one line."""
    key = (mode, tuple(sorted((kernel_options or {}).items())))
    if key not in _COMPILED_FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        from dflash.compile import EagerFallback, torch_mode

        if kernel_options:
            fn = functools.partial(flex_attention, kernel_options=dict(kernel_options))
            compiled = torch.compile(fn, dynamic=False, mode=torch_mode(mode))
            then = ("it runs with torch's Triton kernels. Set compile.flex_backend=triton to skip the attempt"
                    if kernel_options.get("BACKEND") == "FLASH" else
                    "it runs with torch's own tiles. Set compile.flex_kernel_options={} to skip the attempt")
            _COMPILED_FLEX[key] = EagerFallback(
                f"flex with kernel options {dict(kernel_options)}", compiled, compiled_flex_attention(mode),
                then=then)
        else:
            compiled = torch.compile(flex_attention, dynamic=False, mode=torch_mode(mode))
            _COMPILED_FLEX[key] = EagerFallback("flex", compiled, flex_attention)
    return _COMPILED_FLEX[key]


def resolve_kind(requested: str, device: torch.device) -> str:
    if requested == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return requested
