"""Filters of the kernels role: the kernels packages a target needs (the family table), the causal-conv1d wheel
cache key."""

from __future__ import annotations

import re
import sys
from pathlib import Path

# The repository root: dflash/models/families.py is read from the trainer's own code (plain Python, no torch).
_ROOT = str(Path(__file__).resolve().parents[3])

FAST_PATH_MODES = ("auto", "all", "none")


def _families():
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    from dflash.models import families

    return families


def kernels_for_target(model_type: str, mode: str = "auto") -> list[str]:
    """The kernels packages (PyPI names) the role installs for a target of `model_type`.

    `mode` is dflash_kernels_fast_path: ``auto`` follows the family table (a dense family: none, so no
    causal-conv1d build and no nvcc; a hybrid one: its fast path's packages), ``all`` every package some family
    needs, ``none`` nothing (the trainer then refuses a hybrid GPU run unless target.allow_slow_path).
    """
    families = _families()
    if mode not in FAST_PATH_MODES:
        raise ValueError(f"dflash_kernels_fast_path={mode!r}: use one of {', '.join(FAST_PATH_MODES)}")
    if mode == "none":
        return []
    if mode == "all":
        return [k.name for k in families.all_kernels()]
    for family in families.FAMILIES:
        if model_type in family.model_types:
            return [k.name for k in family.kernels]
    raise ValueError(f"the target's model_type {model_type!r} is not in the family table (dflash/models/families.py; "
                     f"supported: {', '.join(families.supported_model_types())}): fix target.path, or set "
                     "dflash_kernels_fast_path to all (hybrid) or none (dense)")


def cuda_arch_list(capabilities: list) -> str:
    """[[9, 0], [8, 0], [9, 0]] -> '8.0;9.0' (TORCH_CUDA_ARCH_LIST, sorted, unique)."""
    archs = sorted({(int(major), int(minor)) for major, minor in capabilities})
    return ";".join(f"{major}.{minor}" for major, minor in archs)


def sm_list(capabilities: list) -> str:
    """[[9, 0], [8, 0]] -> '80,90' (the sm_NN numbers of the architectures present)."""
    return ",".join(arch.replace(".", "") for arch in cuda_arch_list(capabilities).split(";"))


def causal_conv1d_cache_key(probe: dict, version: str) -> str:
    """The directory name a built causal-conv1d wheel is cached under.

    Every input that changes the binary is in it: the extension's version, the torch
    build (ABI), the CUDA version and the GPU architectures compiled for.
    `probe` is {"torch": "2.11.0+cu130", "cuda": "13.0", "capabilities": [[9, 0]]}.
    """
    if not probe.get("cuda"):
        raise ValueError(f"torch {probe.get('torch')} is not a CUDA build: install a CUDA torch in the venv")
    if not probe.get("capabilities"):
        raise ValueError("no CUDA device is visible in the container: check the GPU passthrough")
    archs = "-".join(f"sm{sm}" for sm in sm_list(probe["capabilities"]).split(","))
    torch_version = re.sub(r"[^A-Za-z0-9.+]", "_", str(probe["torch"]))
    return f"causal_conv1d-{version}_torch-{torch_version}_cuda-{probe['cuda']}_{archs}"


class FilterModule:
    def filters(self):
        return {
            "dflash_kernels_cache_key": causal_conv1d_cache_key,
            "dflash_kernels_for_target": kernels_for_target,
            "dflash_kernels_arch_list": cuda_arch_list,
            "dflash_kernels_sm_list": sm_list,
        }
