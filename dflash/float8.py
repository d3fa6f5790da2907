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

from dflash.errors import ConfigError
from dflash.logs import get_logger

log = get_logger(__name__)

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (L40S), Hopper (H100/H200), Blackwell
INSTALL_HINT = ("install torchao in the trainer's venv (pip install 'torchao>=0.17,<0.19'; with the venv role: "
                "dflash_venv_extra_packages: ['torchao==0.18.0'])")


def check_float8(device: torch.device) -> None:
    """Raise ConfigError naming the problem and the fix when float8 linears cannot run on `device`."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"drafter.float8 is set but torchao cannot be imported ({exc}): {INSTALL_HINT}, "
                          "or set drafter.float8: false") from None
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        capability = torch.cuda.get_device_capability(index)
        if tuple(capability) < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(index)
            raise ConfigError(f"drafter.float8 needs float8 tensor cores (compute capability 8.9 or newer: L40S, "
                              f"H100, H200, B200); cuda:{index} is {name}, {capability[0]}.{capability[1]}. "
                              "Set drafter.float8: false")
    elif device.type == "cpu":
        log.warning("drafter.float8 on the CPU runs torch's reference float8 matmul: correct, not faster "
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
