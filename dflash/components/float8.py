"""The drafter's linear layers in float8 (`drafter.float8`), through torchao's `Float8Linear`.

Each `nn.Linear` of the drafter (attention and MLP projections, the feature fusion `fc`) becomes a
`Float8Linear` with dynamic tensorwise scaling: its input, weight and output gradient are cast to float8 for
the three matmuls of forward and backward; the master weights, the optimizer, the norms, attention, the
frozen LM head and the loss stay as they were. Parameters and `state_dict` keys do not change, so
checkpoints, resume (in either direction) and the exported drafter are the same as without it.

Measured on one H200 at the 8B shape (docs/PERFORMANCE.md): the step is faster; the numerics differ from
bf16 (the gradient at the same weights by about 18% in relative norm), so it is off by default.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.compile import forwards_installed
from dflash.errors import ConfigError
from dflash.logs import get_logger
from dflash.models.target import feature_depth

log = get_logger(__name__)

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (L40S), Hopper (H100/H200), Blackwell
INSTALL_HINT = ("install torchao in the trainer's venv (pip install 'torchao>=0.17,<0.19'; with the venv role: "
                "dflash_venv_extra_packages: ['torchao==0.18.0'])")


def check_float8(device: torch.device, key: str = "drafter.float8", torchao: bool = True) -> None:
    """Raise ConfigError naming the problem and the fix when float8 matmuls cannot run on `device` for the
    setting `key` (torchao needed where `torchao`: the drafter's Float8Linear)."""
    if torchao:
        try:
            import torchao.float8  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"{key} is set but torchao cannot be imported ({exc}): {INSTALL_HINT}, "
                              f"or set {key}: false") from None
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        capability = torch.cuda.get_device_capability(index)
        if tuple(capability) < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(index)
            raise ConfigError(f"{key} needs float8 tensor cores (compute capability 8.9 or newer: L40S, "
                              f"H100, H200, B200); cuda:{index} is {name}, {capability[0]}.{capability[1]}. "
                              f"Set {key}: false")
    elif device.type == "cpu":
        log.warning(f"{key} on the CPU runs torch's reference float8 matmul: correct, not faster "
                    "(meant for tests; the speed-up needs float8 tensor cores)")


def convert_linears(model: nn.Module, recipe: str = "tensorwise", skip: tuple[str, ...] = ()) -> list[str]:
    """Swap `model`'s eligible `nn.Linear` layers for `Float8Linear` in place (dynamic scaling by `recipe`,
    torchao's name: "tensorwise", what `drafter.float8` runs, or "rowwise"); returns the names of the layers
    left in their own precision: dimensions not divisible by 16, or a name ending with one of `skip`."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def convertible(module: nn.Module, fqn: str) -> bool:  # float8 matmuls need dimensions divisible by 16
        return (isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
                and not (skip and fqn.endswith(skip)))

    kept = sorted(name for name, m in model.named_modules() if isinstance(m, nn.Linear) and not convertible(m, name))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=convertible)
    return kept


def float8_linears(model: nn.Module) -> list[str]:
    """Names of `model`'s layers that run in float8."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


# ------------------------------------------------------------------------------- the LM head of the loss
E4M3 = torch.float8_e4m3fn  # activations and weights: more mantissa
E5M2 = torch.float8_e5m2  # gradients: more range (the softmax's small probabilities)


def rowwise(t: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` (n, k) in float8 with one fp32 scale per row, its largest magnitude at the format's largest value:
    (t8, scale) with t ~= t8 * scale."""
    scale = t.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=1e-30) / torch.finfo(dtype).max
    return (t.float() / scale).to(dtype), scale


class Float8Head:
    """The frozen LM head (vocab, hidden) for the fused loss's two matmuls in float8 (`drafter.float8_head`): the
    logits rows @ W^T and the rows' gradient G @ W. W is cast once (row scales for the first, column scales for
    the second); the rows are cast per chunk (e4m3, row scales) and G arrives in e5m2 with its row scales
    (dflash.components.loss.ce_rows_float8). Products accumulate in fp32 and come out in `out_dtype`."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.version = weight, weight._version  # the cache below is keyed by both
        self.w8, self.w_scale = rowwise(weight)  # (V, H), (V, 1)
        self.wt8, self.wt_scale = rowwise(weight.t().contiguous())  # (H, V), (H, 1)

    def logits(self, rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        r8, r_scale = rowwise(rows)
        return torch._scaled_mm(r8, self.w8.t(), scale_a=r_scale, scale_b=self.w_scale.t(), out_dtype=out_dtype)

    def rows_grad(self, grad8: torch.Tensor, grad_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return torch._scaled_mm(grad8, self.wt8.t(), scale_a=grad_scale, scale_b=self.wt_scale.t(),
                                out_dtype=out_dtype)


def check_float8_head(vocab_size: int, hidden_size: int) -> None:
    """Raise ConfigError when float8 matmuls cannot take the LM head's shape (both dimensions divisible by 16)."""
    if vocab_size % 16 or hidden_size % 16:
        raise ConfigError(f"drafter.float8_head: the LM head is {vocab_size} x {hidden_size}, and float8 matmuls "
                          "need both dimensions divisible by 16; set drafter.float8_head: false")


_HEAD: list[Float8Head] = []


def float8_head(weight: torch.Tensor) -> Float8Head:
    """`weight`'s float8 copies, cast at the first call and reused while the same frozen tensor comes back (one
    cast per run, not per step; a CUDA graph replays with the cached copies)."""
    if _HEAD:
        head = _HEAD[0]
        w = head.weight
        if (w.data_ptr() == weight.data_ptr() and w.shape == weight.shape and w.dtype == weight.dtype
                and head.version == weight._version):
            return head
    _HEAD[:] = [Float8Head(weight)]
    return _HEAD[0]


# ------------------------------------------------------------------------------- the target's feature forward
def frozen_float8_forward(linear: nn.Linear):
    """A forward for the frozen `linear` in float8: its weight cast once (e4m3, one scale per output row), the
    input cast per call (e4m3, one scale per row), one `torch._scaled_mm` accumulating in fp32; the output in
    bf16 (what rowwise float8 matmuls give), then in the input's dtype."""
    w8, w_scale = rowwise(linear.weight.detach())
    scale_b = w_scale.t()  # (1, out)
    bias = linear.bias.detach() if linear.bias is not None else None

    def forward(x: torch.Tensor) -> torch.Tensor:
        x8, x_scale = rowwise(x.reshape(-1, x.shape[-1]))
        y = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=scale_b, out_dtype=torch.bfloat16)
        y = y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
        return y if bias is None else y + bias

    return forward


def target_float8(target: nn.Module) -> tuple[int, int]:
    """`target.features` (a `Target`, or a stage of one) with the decoder layers' linear layers in float8
    (`target.float8`): during that call only, each eligible `nn.Linear` of the layers the feature forward runs
    (up to the deepest tapped one) takes a `frozen_float8_forward`, removed after it; the eval's decoding and
    regeneration call the model itself and keep its own precision. Returns (layers in float8, layers kept:
    a dimension not divisible by 16). Install before `dflash.compile.compile_target_layers`, or after: the
    compiled layers trace whichever forward is installed when they run, and it is the same one every step."""
    layers = list(target.layers)
    tapped = getattr(target, "layer_ids", None)  # a stage holds only the layers it runs
    if tapped:
        layers = layers[: feature_depth(tapped)]
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)]
    swaps = [(m, frozen_float8_forward(m)) for m in linears if m.in_features % 16 == 0 and m.out_features % 16 == 0]
    eager_features = target.features

    def features(*args, **kwargs):
        with forwards_installed(swaps):
            return eager_features(*args, **kwargs)

    target.features = features
    kept = len(linears) - len(swaps)
    log.info(f"target: the feature forward's {len(swaps)} linear layers in float8 (rowwise)"
             + (f"; {kept} kept in their dtype (a dimension not divisible by 16)" if kept else ""))
    return len(swaps), kept
