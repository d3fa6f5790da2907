"""`dflash doctor`: torch/CUDA/GPU visibility, NCCL, and whether hybrid targets run on the fast kernels."""

from __future__ import annotations

from typing import Any

import torch

from dflash.models.families import all_kernels, family_named, kernels_importable
from dflash.models.target import FastPathReport, Target, family_report

# A tiny hybrid target (3 GatedDeltaNet : 1 attention) whose single forward shows which kernels run.
PROBE_FAMILY = family_named("qwen3_next")
PROBE_HYBRID = dict(PROBE_FAMILY.tiny)


def probe_fast_path(device: torch.device) -> FastPathReport:
    from dflash.models.target import build_hf_model

    try:
        model = build_hf_model(None, dict(PROBE_HYBRID), "bfloat16" if device.type == "cuda" else "float32",
                               device=device)
    except Exception as exc:  # transformers without qwen3_next
        return family_report(PROBE_FAMILY, hybrid=True, kernels_seen=[f"probe model unavailable: {exc}"])
    target = Target(model.to(device), [model.config.num_hidden_layers - 1])
    return target.fast_path_report(probe_on_device=True)


def collect() -> dict[str, Any]:
    from dflash.driver import driver_cuda_version, mismatch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                            "cuda_version": torch.version.cuda, "driver_cuda": driver_cuda_version()}
    info["driver_mismatch"] = mismatch(info["driver_cuda"], torch.version.cuda, f"torch {torch.__version__}")
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        info["transformers"] = None
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                         "capability": f"{p.major}.{p.minor}"})
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # pragma: no cover - builds without NCCL
            info["nccl"] = None
    info["gpus"] = gpus
    info["distributed_backends"] = {"gloo": torch.distributed.is_gloo_available(),
                                    "nccl": torch.distributed.is_nccl_available()}
    kernels = all_kernels()  # every package some family's fast path needs
    importable = kernels_importable(kernels)
    for package in kernels:
        info[package.key] = importable[package.name]
    info["kernels"] = importable
    have_all = all(importable.values())
    from dflash.compile import flash_version
    from dflash.models.attention import FLASH_HEAD_DIMS, flash_unusable

    info["flash_attn_4"] = flash_version()
    if torch.cuda.is_available():
        why = flash_unusable(torch.device("cuda", 0), FLASH_HEAD_DIMS[-1])
        info["flex_backend"] = "flash" if why is None else f"triton ({why})"
    else:
        info["flex_backend"] = "triton (no GPU)" if info["flash_attn_4"] is None else "triton (no GPU to run flash)"
    if torch.cuda.is_available():
        report = probe_fast_path(torch.device("cuda", 0))
        info["fast_path"] = report.fast
        info["fast_path_detail"] = report.describe()
    else:
        info["fast_path"] = have_all
        info["fast_path_detail"] = ("no GPU: kernels " + ("importable" if have_all else "missing")
                                    + "; the CUDA kernels cannot be exercised here")
    return info


def render(info: dict[str, Any]) -> str:
    lines = [f"torch {info['torch']} (CUDA {info['cuda_version']}), transformers {info['transformers']}"]
    lines.append(f"NVIDIA driver: {'supports CUDA ' + info['driver_cuda'] if info.get('driver_cuda') else 'none found'}")
    if info.get("driver_mismatch"):
        lines.append(f"DRIVER MISMATCH: {info['driver_mismatch']}")
    if info["gpus"]:
        for g in info["gpus"]:
            lines.append(f"GPU {g['index']}: {g['name']}, {g['memory_gib']} GiB, sm_{g['capability'].replace('.', '')}")
        lines.append(f"NCCL {info.get('nccl')}")
    else:
        lines.append("GPUs: none visible")
    lines.append(f"distributed backends: {info['distributed_backends']}")
    lines.append("; ".join(f"{name}: {'yes' if ok else 'no'}" for name, ok in info["kernels"].items()))
    lines.append(f"drafter attention kernels (compile.flex_backend=auto, head_dim 128): {info['flex_backend']}")
    lines.append(f"hybrid fast path: {'YES' if info['fast_path'] else 'NO'} ({info['fast_path_detail']})")
    return "\n".join(lines)
