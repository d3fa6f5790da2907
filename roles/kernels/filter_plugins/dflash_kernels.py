"""Filters of the kernels role: the causal-conv1d wheel cache key."""

from __future__ import annotations

import re


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
            "dflash_kernels_arch_list": cuda_arch_list,
            "dflash_kernels_sm_list": sm_list,
        }
