"""The frozen target: tapped-layer hidden states via forward hooks, backbone only, early stop."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash.errors import BadInput
from dflash.models.families import Family, family_of, kernels_importable, text_config_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StopForward(Exception):
    """Raised by the hook of the deepest tapped layer: nothing after it is needed."""


@dataclass
class FastPathReport:
    """Whether a hybrid target's fast-kernel mixers (GatedDeltaNet layers) run on the fast kernels."""

    hybrid: bool
    linear_layers: int = 0
    total_layers: int = 0
    packages: dict[str, bool] = field(default_factory=dict)  # kernels package -> importable
    install: list[str] = field(default_factory=list)  # how to install each of `packages`
    mixers: list[str] = field(default_factory=list)  # the mixers that need them (e.g. GatedDeltaNet)
    kernels_seen: list[str] = field(default_factory=list)  # CUDA kernel names observed in one forward
    checked_on_device: bool = False

    @property
    def fast(self) -> bool:
        if not self.hybrid:
            return True
        if not all(self.packages.values()):
            return False
        return not self.checked_on_device or bool(self.kernels_seen)

    def describe(self) -> str:
        if not self.hybrid:
            return "dense target: no linear-attention kernels needed"
        parts = [f"{self.linear_layers} of {self.total_layers} layers are {' / '.join(self.mixers) or 'fast-kernel mixers'}"]
        parts += [f"{name} {'importable' if ok else 'MISSING'}" for name, ok in self.packages.items()]
        if self.checked_on_device:
            parts.append("fast kernels ran: " + (", ".join(self.kernels_seen) or "none"))
        parts.append("FAST path" if self.fast else "SLOW reference PyTorch path")
        return "; ".join(parts)


def feature_depth(layer_ids: Iterable[int]) -> int:
    """How many decoder layers the feature forward runs: 0 .. the deepest tapped one, the one "target up to
    layer k" of dflash. `Target` stops its forward after them, a split target's stages share just them
    (`dflash.runtime.stages.stage_bounds`), `target.float8` swaps just their linear layers."""
    return max(layer_ids) + 1


def find_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(path, decoder layer list) of a causal LM, where its family keeps it (dflash.models.families)."""
    return family_of(model.config).decoder_layers(model)


class Target(nn.Module):
    """Wraps a Hugging Face causal LM; `features(input_ids, attention_mask)` returns the tapped states.

    Hooks sit on the tapped layers only; the hook of the deepest one stops the forward, so later layers,
    the final norm and the LM head never run.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        text_config = text_config_of(model.config)
        self.num_layers = int(text_config.num_hidden_layers)
        self.hidden_size = int(text_config.hidden_size)
        self.layer_ids = sorted(layer_ids)
        layers_name, self.layers = find_layers(model)
        self.eager_mixers = family_of(model.config).eager_modules  # kept eager when its layers compile
        owner_name = layers_name.rsplit(".", 1)[0] if "." in layers_name else ""
        self.backbone = model.get_submodule(owner_name) if owner_name else model
        self._captured: dict[int, torch.Tensor] = {}
        self._stop_early = True  # False inside `capture_all()`: the whole forward runs (decoding)
        self._handles = [self.layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def _hook(self, index: int):
        deepest = index == feature_depth(self.layer_ids) - 1

        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self._captured[index] = hidden
            if deepest and self._stop_early:
                raise StopForward

        return hook

    @contextlib.contextmanager
    def capture_all(self):
        """Within: a call of `self.model` runs to the logits and records the tapped states on the way
        (`captured_features()`): what speculative decoding needs from one verify forward."""
        self._captured.clear()
        self._stop_early = False
        try:
            yield self
        finally:
            self._stop_early = True
            self._captured.clear()

    def captured_features(self) -> torch.Tensor:
        out = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        self._captured.clear()
        return out

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.weight.shape[0])

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenated hidden states of the tapped layers: (batch, seq, n_tapped * hidden).

        The trainer's batches are right-padded and it passes no mask: in a causal model the states at the
        valid positions do not depend on the padding after them (tested), and without a mask SDPA takes its
        causal fast path (1.17x the masked kernels for the features of an 8B target on an H200)."""
        self._captured.clear()
        try:
            self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except StopForward:
            pass
        missing = [i for i in self.layer_ids if i not in self._captured]
        if missing:  # pragma: no cover - would mean the model skipped layers
            raise RuntimeError(f"target layers {missing} did not run")
        out = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        self._captured.clear()
        return out

    def linear_attention_layers(self) -> int:
        return linear_attention_layers(self.model)

    def fast_path_report(self, probe_on_device: bool = True) -> FastPathReport:
        def probe() -> None:
            self.features(torch.randint(0, self.vocab_size, (1, 64), device=self.embed_tokens.weight.device))

        return fast_path_report(self.model, self.num_layers, probe if probe_on_device else None)


def linear_attention_layers(model: nn.Module) -> int:
    """The mixers of `model` (a target, or a stage's part of one) whose fast path needs kernels packages."""
    return family_of(model.config).fast_path_modules(model)


def family_report(family: Family, **fields: Any) -> FastPathReport:
    """A report on `family`'s fast-path needs: its kernels packages (checked for import now) and mixers."""
    return FastPathReport(packages=kernels_importable(family.kernels),
                          install=[k.install_hint for k in family.kernels],
                          mixers=[m.module for m in family.fast_mixers if m.module], **fields)


def fast_path_report(model: nn.Module, total_layers: int, probe=None) -> FastPathReport:
    """Whether `model`'s fast-kernel mixers (all of a target's, or a stage's) run on the fast kernels;
    `probe()` runs one small forward of it, profiled on CUDA to see the kernels (None: import check only)."""
    family = family_of(model.config)
    linear = family.fast_path_modules(model)
    report = family_report(family, hybrid=linear > 0, linear_layers=linear, total_layers=total_layers)
    device = next(model.parameters()).device
    if report.hybrid and probe is not None and device.type == "cuda":
        report.kernels_seen = _probe_kernels(probe, device, family.kernel_names)
        report.checked_on_device = True
    return report


def _probe_kernels(probe, device: torch.device, wanted: tuple[str, ...]) -> list[str]:
    """Run `probe()` under the profiler and list the fast kernels (names containing one of `wanted`) that ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        probe()
        torch.cuda.synchronize(device)
    names = {evt.key for evt in prof.key_averages()}
    return sorted({n for n in names if any(w in n.lower() for w in wanted)})[:8]


def require_fast_path(report: FastPathReport, device: torch.device, allow_slow_path: bool) -> None:
    """A GPU run refuses a hybrid target (or stage) on the slow PyTorch path unless target.allow_slow_path."""
    if device.type == "cuda" and not report.fast and not allow_slow_path:
        raise BadInput(f"the hybrid target would run on the slow PyTorch path ({report.describe()}); install "
                       f"{' and '.join(report.packages)} (the `kernels` role, or {' + '.join(report.install)}) "
                       "or set target.allow_slow_path=true")


def _one_line(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


SUPPORTED_ROPE_TYPES = ("default",)


def rope_of(config: Any) -> Any:
    """The RoPE settings of a transformers config (`rope_parameters`, or the older `rope_scaling`)."""
    tc = text_config_of(config)
    return getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}


def check_rope(rope: Any) -> None:
    """The drafter rotates with plain RoPE (rope_theta): a scaled target RoPE is refused, not dropped."""
    kind = (rope.get("rope_type") or rope.get("type") or "default") if isinstance(rope, dict) else "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise BadInput(f"the target's rope_scaling/rope_parameters has rope_type '{kind}', but the drafter "
                       f"implements only {', '.join(SUPPORTED_ROPE_TYPES)} RoPE (rope_theta); remove rope_scaling "
                       "from target.random_init, or use a target whose config.json has no RoPE scaling")


def target_config(path: str | None, random_init: dict[str, Any] | None) -> Any:
    """The target's transformers config, without weights; errors are one-line BadInput naming the key."""
    from transformers import AutoConfig

    if random_init is not None:
        spec = dict(random_init)
        model_type = spec.pop("model_type")
        try:
            config = AutoConfig.for_model(model_type, **spec)
        except (KeyError, ValueError, TypeError) as exc:
            raise BadInput(f"target.random_init: transformers cannot build a '{model_type}' config: "
                           f"{_one_line(exc)}") from None
        check_family(config)
        return config
    p = Path(str(path))
    if not p.is_dir():
        raise BadInput(f"target.path '{path}' is not a directory; point it at a local Hugging Face model "
                       "directory (dflash never downloads weights)")
    if not (p / "config.json").is_file():
        raise BadInput(f"target.path '{path}' holds no config.json: it is not a Hugging Face model directory "
                       "(expected config.json, the weights (*.safetensors) and the tokenizer files)")
    try:
        config = AutoConfig.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"target.path '{path}': its config.json is not a transformers model config: "
                       f"{_one_line(exc)}") from None
    if "DFlashDraftModel" in (getattr(config, "architectures", None) or []):
        raise BadInput(f"target.path '{path}' is a DFlash drafter, not a target model; point target.path at the "
                       "target (e.g. a Qwen3-8B directory) and the drafter at drafter.init_from")
    check_family(config)
    return config


def check_family(config: Any) -> None:
    """A target config dflash can train for: a family of the table, its layers' mixer kinds declared there,
    plain RoPE."""
    family_of(config).layer_kinds(config)
    check_rope(rope_of(config))


# A random-init target up to this size is drawn on the CPU and then moved: the same config and seed give the
# same weights on every device (a GPU's generator draws other numbers than the CPU's), so a drafter trained on a
# GPU is evaluated against its own target on a CPU, and the demo recipe trains the same target everywhere.
# Larger ones (the benchmark shapes) are drawn on the run's device: a random 8B init on the CPU takes minutes.
RANDOM_INIT_CPU_MAX_PARAMS = 500_000_000


def build_hf_model(path: str | None, random_init: dict[str, Any] | None, dtype: str,
                   attn_implementation: str | None = None, seed: int = 0,
                   device: torch.device | str = "cpu") -> nn.Module:
    """A random init is drawn on the CPU up to RANDOM_INIT_CPU_MAX_PARAMS parameters (the same weights on every
    device), directly on `device` above it.

    A checkpoint is read with transformers' default loader, which memory-maps the safetensors files (the
    parameters stay file-backed pages, not copies in process memory), then moved to `device`. No
    `device_map`: transformers 5 requires `accelerate` for any device_map (a single device too), and dflash
    does not depend on it; the copy to the GPU reads those pages once.
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype]}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    config = target_config(path, random_init)
    if path is not None:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                               output_loading_info=True, **kwargs)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise BadInput(f"target.path '{path}' could not be loaded as a causal LM: {_one_line(exc)}") from None
        missing = sorted(info.get("missing_keys") or [])
        if missing:
            raise BadInput(f"target.path '{path}': its weights lack {len(missing)} tensors of "
                           f"{type(model).__name__} (e.g. {', '.join(missing[:3])}); point target.path at the "
                           "complete model directory")
        return model.to(device)
    with torch.device("meta"):  # the size, without memory
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config, **kwargs).parameters())
    draw_on = "cpu" if size <= RANDOM_INIT_CPU_MAX_PARAMS else device
    devices_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        with torch.device(draw_on):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    finally:
        torch.random.set_rng_state(devices_state)
    return model.to(device)


def num_layers_of(path: str | None, random_init: dict[str, Any] | None) -> int:
    """Depth of the target without loading weights (for config validation)."""
    return int(text_config_of(target_config(path, random_init)).num_hidden_layers)
