"""Which device this process computes on."""

from __future__ import annotations

import os

import torch

from dflash.errors import BadInput


def pick_device(requested: str, setting: str = "runtime.device") -> torch.device:
    """cpu, or this rank's GPU (LOCAL_RANK); `setting` names the option in the error."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise BadInput(f"{setting} is 'cuda' but no CUDA GPU is visible; check CUDA_VISIBLE_DEVICES "
                           f"or set {setting} cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
