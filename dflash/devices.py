"""Which device this process computes on, and how host tensors reach it."""

from __future__ import annotations

import os

import torch

from dflash.errors import BadInput


def pick_device(requested: str, setting: str = "runtime.device") -> torch.device:
    """cpu, or this rank's GPU (LOCAL_RANK); `setting` names the option in the error."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from dflash import driver

            problem = (driver.userspace_mismatch(driver.kernel_module_version(), driver.userspace_version())
                       or driver.mismatch(driver.driver_cuda_version(), torch.version.cuda, f"torch {torch.__version__}"))
            if problem:
                raise BadInput(f"{setting} is 'cuda' but {problem}")
            raise BadInput(f"{setting} is 'cuda' but no CUDA GPU is visible; check CUDA_VISIBLE_DEVICES "
                           f"or set {setting} cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`. A host tensor goes to a GPU from pinned memory, asynchronously: a copy from pageable
    memory would first wait for all the work already queued on the GPU (the step's previous kernels)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
