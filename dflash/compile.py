"""`torch.compile` applied from the outside, as the `compile:` config section says, with an eager fallback.

One plan per process (`configure`, from the run config at start-up): the target's decoder layers, the
drafter's forward, flex_attention and the loss's per-chunk softmax each compiled or not. A piece whose
compilation fails runs eagerly from then on, with one log line naming it and the error: a run is never lost
to a compiler problem, and its numbers say which path ran.

The inductor/Triton kernel cache lives in the job's run directory (`use_kernel_cache`), in a folder keyed by
torch, Triton and the GPU, so a restart or an upgrade of dflash reuses the kernels a previous start compiled,
and a torch, Triton or GPU change starts a clean folder (the stale ones are removed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompilePlan:
    """What runs compiled in this process (resolved: no 'auto' left)."""

    target: bool = False
    drafter: bool = False
    flex: bool = False
    loss: bool = False
    target_mode: str = "default"
    drafter_mode: str = "default"


def resolve(section: Any, device: torch.device) -> CompilePlan:
    """The plan for `section` (a `CompileConfig`) on `device`: unset pieces are on exactly on CUDA."""
    on_cuda = torch.device(device).type == "cuda"

    def pick(value: bool | None) -> bool:
        return on_cuda if value is None else bool(value)

    return CompilePlan(target=pick(section.target), drafter=pick(section.drafter), flex=pick(section.flex),
                       loss=pick(section.loss), target_mode=section.target_mode, drafter_mode=section.drafter_mode)


_PLAN: CompilePlan | None = None


def configure(plan: CompilePlan) -> CompilePlan:
    """Make `plan` the process's plan (the trainer does this once, from its config)."""
    global _PLAN
    _PLAN = plan
    return plan


def active(device: torch.device | str | None = None) -> CompilePlan:
    """The process's plan; before `configure`, the default plan for `device` (compiled on CUDA)."""
    if _PLAN is not None:
        return _PLAN
    on_cuda = device is not None and torch.device(device).type == "cuda"
    return CompilePlan(target=on_cuda, drafter=on_cuda, flex=on_cuda, loss=on_cuda)


# --------------------------------------------------------------------------------------------- fallback
def is_compile_error(exc: BaseException) -> bool:
    """An error of the compiler stack (dynamo, inductor, Triton), not of the computation itself."""
    from torch._dynamo.exc import TorchDynamoException

    if isinstance(exc, TorchDynamoException):
        return True
    module = type(exc).__module__ or ""
    return module.startswith(("torch._inductor", "triton"))


class EagerFallback:
    """Calls `compiled`; the first compiler error logs one line, runs `undo` and retries eagerly for good.

    An error that is not the compiler's propagates unchanged (it would happen eagerly too)."""

    def __init__(self, name: str, compiled: Callable, eager: Callable, undo: Callable[[], None] | None = None,
                 then: str | None = None):
        self.name, self.compiled, self.eager, self.undo = name, compiled, eager, undo
        # what the log line says happens instead, and how to skip the attempt
        self.then = then or (f"it runs eagerly (slower). Set compile.{name.split()[0]}=false to skip the attempt")
        self.failed: str | None = None

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # traced inside an outer compiled graph: that graph's guard decides
            return self.compiled(*args, **kwargs)
        if self.failed is not None:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as exc:
            if not is_compile_error(exc):
                raise
            self.failed = one_line(exc)
            log.warning("compile: %s could not be compiled (%s); %s", self.name, self.failed, self.then)
            if self.undo is not None:
                self.undo()
            return self.eager(*args, **kwargs)


def one_line(exc: BaseException, limit: int = 300) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = " ".join(lines[:2] if lines and lines[0].endswith(":") else lines[:1])  # "backend raised:" + cause
    text = f"{type(exc).__name__}: {' '.join(first.split())}"
    return text if len(text) <= limit else text[:limit] + " ..."


def torch_mode(mode: str) -> str | None:
    """The config's mode name as `torch.compile` takes it ("default" is its None)."""
    return None if mode == "default" else mode


def _compile_forward(module: nn.Module, mode: str, backend: str | Callable) -> Callable:
    """`module.forward` replaced by a compiled one (hooks stay eager, outside the graph); returns the undo."""
    own = module.__dict__.get("forward")  # an instance-level forward set earlier, restored by the undo
    eager = module.forward
    module.forward = torch.compile(eager, mode=torch_mode(mode), backend=backend)

    def undo() -> None:
        if own is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = own
    return undo


def _quiet_autotune_candidates(mode: str) -> None:
    """max-autotune logs every candidate GEMM tile that does not fit the GPU (an ERROR line each, dozens per
    shape) and then picks among the ones that do: expected, not a problem of the run."""
    if "max-autotune" in mode:
        logging.getLogger("torch._inductor.select_algorithm").setLevel(logging.CRITICAL)


def _allow_recompiles(n: int) -> None:
    """The layers of one model share one code object; a layer whose guards differ (say a per-layer int)
    compiles its own graph. Allow one per layer, so none falls back to eager silently at dynamo's limit."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(int(getattr(dynamo_config, name)), n + 8))


def keep_mixers_eager(layers: list[nn.Module], mixers: tuple[str, ...]) -> None:
    """Wrap the forward of the modules whose class name contains one of `mixers` in `torch.compiler.disable`
    (a graph break around each, no change eagerly); a module already wrapped is left as it is."""
    if not mixers:
        return
    for layer in layers:
        for module in layer.modules():
            if any(part in type(module).__name__ for part in mixers) and not getattr(
                    module, "_dflash_kept_eager", False):
                module.forward = torch.compiler.disable(module.forward)
                module._dflash_kept_eager = True


@contextlib.contextmanager
def forwards_installed(pairs: list[tuple[nn.Module, Callable]]):
    """Within: each module of `pairs` runs its paired forward (set as an instance attribute); after, each module
    has its own forward back (an instance-level one it had before, else its class's). How a target's `features`
    runs its compiled layers, or its linear layers in float8 (dflash.components.float8.target_float8), and nothing else."""
    own = [module.__dict__.get("forward") for module, _ in pairs]
    for module, forward in pairs:
        module.forward = forward
    try:
        yield
    finally:
        for (module, _), before in zip(pairs, own, strict=True):
            if before is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = before


def compile_target_layers(target: Any, mode: str, backend: str | Callable = "inductor") -> EagerFallback:
    """Each decoder layer of a `Target` (or a stage of one) compiled for its `features` calls (the forward hooks
    stay eager, and so do the token mixers its family keeps eager: traced, the hybrid target's GatedDeltaNet
    made the whole Qwen3.6-27B-shaped forward 0.76x its eager fast path, docs/PERFORMANCE.md; the norms, the
    MLP and the attention layers around them still compile); other uses of the model (the eval's decoding,
    regeneration) keep the eager layers.

    Returns the guard now installed as `target.features`: on a compiler error every layer goes back to
    eager and the same call is answered eagerly."""
    layers = list(target.layers)
    keep_mixers_eager(layers, getattr(target, "eager_mixers", ()))  # its family's (dflash.models.families)
    _allow_recompiles(len(layers))
    _quiet_autotune_candidates(mode)
    compiled = list(zip(layers, [torch.compile(layer.forward, mode=torch_mode(mode), backend=backend)
                                 for layer in layers], strict=True))
    eager_features = target.features

    def compiled_features(*args, **kwargs):
        with forwards_installed(compiled):
            return eager_features(*args, **kwargs)

    guard = EagerFallback("target (its decoder layers)", compiled_features, eager_features)
    target.features = guard
    return guard


def compile_drafter(drafter: nn.Module, mode: str, backend: str | Callable = "inductor") -> EagerFallback:
    """The drafter's whole forward compiled (measured faster than per layer), guarded as above."""
    eager = drafter.forward
    _quiet_autotune_candidates(mode)
    undo = _compile_forward(drafter, mode, backend)
    guard = EagerFallback("drafter", drafter.forward, eager, undo)
    drafter.forward = guard
    return guard


# ----------------------------------------------------------------------------------------- kernel cache
def flash_version() -> str | None:
    """flash-attn-4's version where its CuTe DSL kernels (flex_attention's FLASH backend) are importable, else
    None."""
    import importlib.metadata
    import importlib.util

    try:
        if importlib.util.find_spec("flash_attn.cute") is None:
            return None
        return importlib.metadata.version("flash-attn-4")
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return None


def cache_key(device: torch.device) -> str:
    """torch, Triton and GPU: kernels compiled under one key are valid for exactly that key."""
    parts = [f"torch-{torch.__version__}"]
    try:
        import triton

        parts.append(f"triton-{triton.__version__}")
    except ImportError:
        parts.append("triton-none")
    if (flash := flash_version()) is not None:  # its kernels are in the generated code inductor caches
        parts.append(f"fa4-{flash}")
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        parts.append(f"{torch.cuda.get_device_name(index)}-sm{major}{minor}")
        parts.append(f"cuda-{torch.version.cuda}")
    else:
        parts.append("cpu")
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", "-".join(parts))


STALE_AFTER_S = 24 * 3600  # another key's folder unused this long goes (a node of a multi-node job with
# another GPU or torch shares the run directory: its folder is in use, and stays)


def _last_used(folder: Path) -> float:
    """When kernels were last added under `folder` (the newest mtime of it and its two cache folders)."""
    times = [folder.stat().st_mtime]
    for sub in ("inductor", "triton"):
        with contextlib.suppress(OSError):
            times.append((folder / sub).stat().st_mtime)
    return max(times)


def use_kernel_cache(cache_root: str | os.PathLike, device: torch.device) -> Path:
    """Point inductor and Triton at `cache_root/<cache_key>` (made if missing, its mtime renewed); other keys'
    folders go once they have gone unused for a day.

    An inductor cache directory set in the environment by the operator wins (and is returned)."""
    from torch._inductor.runtime.runtime_utils import default_cache_dir

    preset = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if preset and os.path.abspath(preset) != os.path.abspath(default_cache_dir()) and not os.environ.get(
            "DFLASH_KERNEL_CACHE"):
        return Path(preset)
    root = Path(cache_root)
    key = cache_key(device)
    here = root / key
    (here / "inductor").mkdir(parents=True, exist_ok=True)
    (here / "triton").mkdir(parents=True, exist_ok=True)
    os.utime(here)  # in use: a node with another key sharing this directory keeps it
    now = time.time()
    for stale in root.iterdir():
        if stale.is_dir() and stale.name.startswith("torch-") and stale.name != key and (
                now - _last_used(stale) > STALE_AFTER_S):
            shutil.rmtree(stale, ignore_errors=True)  # a torch/Triton/GPU change: those kernels never load again
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(here / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(here / "triton")
    os.environ["DFLASH_KERNEL_CACHE"] = str(here)  # ours (child processes inherit it): not the operator's
    return here


def configure_for_run(section: Any, output_dir: str | os.PathLike, device: torch.device) -> tuple[CompilePlan, str]:
    """Start-up of a training process: the plan from the config, the kernel cache when anything compiles,
    and one line that says both (for the run's log)."""
    plan = configure(resolve(section, device))
    pieces = [name for name in ("target", "drafter", "flex", "loss") if getattr(plan, name)]
    if not pieces:
        return plan, "compile: nothing compiled (eager)"
    where = use_kernel_cache(section.cache_dir or Path(output_dir) / "compile-cache", device)
    return plan, f"compile: {', '.join(pieces)} compiled; kernel cache {where}"
