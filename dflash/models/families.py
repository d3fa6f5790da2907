"""The target families dflash trains drafters for: one table, read by every module that needs to know a family.

A family entry says, for the Hugging Face causal LMs of one or more `model_type`s:

* its text config: where the decoder's config sits inside the model's config (a vision-language checkpoint
  nests it), and the fallback values a drafter copies from it where the config has no such field;
* its layer access: where the decoder layer list sits in the causal LM (the target taps and stops there);
* its mixer kinds: the token mixer of each decoder layer (`layer_types`), and for each kind the module
  that implements it, the kernels packages its fast path needs, the CUDA kernel names that show the fast
  path ran, and whether a compiled layer keeps it eager;
* a tiny random-init config of the family (its test, and `dflash doctor`'s probe of the fast kernels).

The embedding table and the LM head are reached through transformers' own `get_input_embeddings()` /
`get_output_embeddings()`, which every family implements. A target whose `model_type` has no entry is
refused before any weights load, with the supported model types named. Adding a family is one entry in
`FAMILIES` (and the family tests pick it up from its tiny config).

Plain Python at import: torch is imported only where a model's modules are walked.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dflash.errors import BadInput


@dataclass(frozen=True)
class KernelPackage:
    """A Python package of fast kernels: the name it is installed by and the module it is imported as."""

    name: str  # pip / PyPI name, as in messages ("flash-linear-attention")
    module: str  # import name ("fla")
    install: str = ""  # how to install it besides the `kernels` role; "" = `pip install NAME`

    @property
    def install_hint(self) -> str:
        return self.install or f"`pip install {self.name}`"

    @property
    def key(self) -> str:
        """Its key in `dflash doctor --json` ("flash_linear_attention")."""
        return self.name.replace("-", "_")

    def importable(self) -> bool:
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            return False


@dataclass(frozen=True)
class Mixer:
    """One kind of token mixer a family's decoder layers use, named as in the config's `layer_types`."""

    kind: str  # "full_attention", "linear_attention", ...
    module: str | None = None  # a class-name part of the module that implements it (None: plain attention)
    kernels: tuple[KernelPackage, ...] = ()  # packages its fast path needs (none: transformers' own code is fast)
    kernel_names: tuple[str, ...] = ()  # parts of the CUDA kernel names that run on its fast path
    eager_in_compile: bool = False  # kept eager inside a compiled decoder layer (graph break around it)


FLASH_LINEAR_ATTENTION = KernelPackage("flash-linear-attention", "fla", "`pip install dflash-trainer[gpu]`")
CAUSAL_CONV1D = KernelPackage("causal-conv1d", "causal_conv1d", "a causal-conv1d build")  # PyPI: sdist only

FULL_ATTENTION = Mixer("full_attention")
SLIDING_ATTENTION = Mixer("sliding_attention")
# Transformers' GatedDeltaNet: flash-linear-attention's chunked delta rule and causal-conv1d's CUDA op; without
# them it falls back to a reference PyTorch path (DESIGN §2: 48 of 64 layers of a Qwen3.6-27B on it). Traced
# by torch.compile, the fast kernels made the forward 0.76x its eager fast path (docs/PERFORMANCE.md).
GATED_DELTA_NET = Mixer(
    "linear_attention", module="GatedDeltaNet", kernels=(FLASH_LINEAR_ATTENTION, CAUSAL_CONV1D),
    kernel_names=("chunk_gated_delta", "causal_conv1d", "fused_recurrent", "chunk_fwd", "conv1d_fwd"),
    eager_in_compile=True)

# What the drafter copies from a target config that lacks the field (the Qwen3 values).
DRAFTER_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "max_position_embeddings": 40960}


@dataclass(frozen=True)
class Family:
    """One target family: see the module docstring for what each field is read for."""

    name: str
    model_types: tuple[str, ...]  # the `model_type`s of its configs (an outer one and its text config's)
    tiny: Mapping[str, Any]  # a tiny `target.random_init` of the family (its test; the doctor's probe)
    mixers: tuple[Mixer, ...] = (FULL_ATTENTION,)  # the mixer kinds its layers may use; the first is the kind
    # of every layer of a config without `layer_types`
    layers: tuple[str, ...] = ("model.layers",)  # candidate paths of the decoder layer list in the causal LM
    text_config_key: str | None = None  # the attribute of the model config holding the decoder's config; None:
    # transformers' `get_text_config(decoder=True)`
    defaults: Mapping[str, Any] = field(default_factory=dict)  # text-config fields the drafter falls back to,
    # over DRAFTER_DEFAULTS

    # ---------------------------------------------------------------------------------------- text config
    def text_config(self, config: Any) -> Any:
        """The decoder's config inside `config` (`config` itself for a text-only model)."""
        if self.text_config_key is not None:
            return getattr(config, self.text_config_key, None) or config
        get = getattr(config, "get_text_config", None)
        return get(decoder=True) if callable(get) else (getattr(config, "text_config", None) or config)

    def default(self, text_config: Any, key: str) -> Any:
        """`text_config.key`, or the family's default where the config has no value."""
        value = getattr(text_config, key, None)
        return {**DRAFTER_DEFAULTS, **self.defaults}.get(key) if value is None else value

    # ----------------------------------------------------------------------------------------- mixer kinds
    def layer_kinds(self, config: Any) -> list[str]:
        """The mixer kind of each decoder layer; a kind the family does not declare is refused."""
        tc = self.text_config(config)
        n = int(tc.num_hidden_layers)
        types = getattr(tc, "layer_types", None)
        kinds = list(types) if isinstance(types, list | tuple) else [self.mixers[0].kind] * n
        known = {m.kind for m in self.mixers}
        unknown = sorted({k for k in kinds if k not in known})
        if unknown:
            raise BadInput(f"the target's layer_types name {', '.join(map(repr, unknown))}, which the "
                           f"{self.name} family does not declare (its mixer kinds: {', '.join(sorted(known))}); "
                           "dflash/models/families.py lists the mixers of each family")
        return kinds

    @property
    def fast_mixers(self) -> tuple[Mixer, ...]:
        """The mixers that need kernels packages for their fast path (a family with any is a hybrid one)."""
        return tuple(m for m in self.mixers if m.kernels)

    @property
    def kernels(self) -> tuple[KernelPackage, ...]:
        """The kernels packages the family's fast path needs, each once."""
        return tuple(dict.fromkeys(k for m in self.fast_mixers for k in m.kernels))

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n for m in self.fast_mixers for n in m.kernel_names))

    @property
    def eager_modules(self) -> tuple[str, ...]:
        """Class-name parts of the mixer modules a compiled decoder layer keeps eager."""
        return tuple(m.module for m in self.mixers if m.eager_in_compile and m.module)

    def fast_path_modules(self, model: Any) -> int:
        """How many modules of `model` (a target, or a stage of one) are mixers that need fast kernels."""
        parts = [m.module for m in self.fast_mixers if m.module]
        return sum(1 for mod in model.modules() if any(p in type(mod).__name__ for p in parts))

    # ---------------------------------------------------------------------------------------- layer access
    def decoder_layers(self, model: Any) -> tuple[str, Any]:
        """(path, the decoder layer list) of the causal LM `model`: the first of `layers` that holds a
        ModuleList of the config's `num_hidden_layers`."""
        from torch import nn

        n = int(self.text_config(model.config).num_hidden_layers)
        for path in self.layers:
            try:
                found = model.get_submodule(path)
            except AttributeError:
                continue
            if isinstance(found, nn.ModuleList) and len(found) == n:
                return path, found
        raise BadInput(f"cannot find the decoder layer list ({n} layers) of {type(model).__name__}: the "
                       f"{self.name} family keeps it at {' or '.join(self.layers)}")


# ------------------------------------------------------------------------------------------------ the table
_DENSE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
_HYBRID = {**_DENSE, "head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
           "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), tiny={"model_type": "llama", **_DENSE}),
    Family("qwen2", ("qwen2",), tiny={"model_type": "qwen2", **_DENSE},
           mixers=(FULL_ATTENTION, SLIDING_ATTENTION)),
    Family("qwen3", ("qwen3",), tiny={"model_type": "qwen3", **_DENSE, "head_dim": 8},
           mixers=(FULL_ATTENTION, SLIDING_ATTENTION)),
    Family("qwen3_moe", ("qwen3_moe",), tiny={"model_type": "qwen3_moe", **_DENSE, "head_dim": 8, **_MOE},
           mixers=(FULL_ATTENTION, SLIDING_ATTENTION)),
    # Qwen3-Next: 3 GatedDeltaNet layers per attention layer. Its tiny config is the doctor's probe: wide enough
    # (256) for the fast kernels' tiles; no experts (a dense MLP).
    Family("qwen3_next", ("qwen3_next",),
           tiny={"model_type": "qwen3_next", "vocab_size": 256, "hidden_size": 256, "intermediate_size": 512,
                 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                 "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
                 "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 0,
                 "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]},
           mixers=(FULL_ATTENTION, GATED_DELTA_NET)),
    # Qwen3.5 / Qwen3.6 (e.g. Qwen3.6-27B): a vision-language checkpoint (`qwen3_5`) whose text decoder
    # (`qwen3_5_text`) transformers loads as the causal LM.
    Family("qwen3_5", ("qwen3_5", "qwen3_5_text"), tiny={"model_type": "qwen3_5_text", **_HYBRID},
           mixers=(FULL_ATTENTION, GATED_DELTA_NET), layers=("model.layers", "model.language_model.layers")),
    Family("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"),
           tiny={"model_type": "qwen3_5_moe_text", **_HYBRID, **_MOE, "shared_expert_intermediate_size": 16},
           mixers=(FULL_ATTENTION, GATED_DELTA_NET), layers=("model.layers", "model.language_model.layers")),
)


def supported_model_types() -> list[str]:
    return [t for f in FAMILIES for t in f.model_types]


def family_named(name: str) -> Family:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"no target family '{name}' (families: {', '.join(f.name for f in FAMILIES)})")


def family_of(config: Any) -> Family:
    """The family of a transformers model config (or of its text config); an unknown one is a BadInput."""
    model_type = getattr(config, "model_type", None)
    for f in FAMILIES:
        if model_type in f.model_types:
            return f
    raise BadInput(f"the target's model_type '{model_type}' ({type(config).__name__}) is not a supported target "
                   f"family; supported model types: {', '.join(supported_model_types())}")


def text_config_of(config: Any) -> Any:
    """The decoder's config of a target's model config (the config itself for a text-only model)."""
    return family_of(config).text_config(config)


def kernels_importable(packages: tuple[KernelPackage, ...]) -> dict[str, bool]:
    """{package name: importable} for `packages`."""
    return {p.name: p.importable() for p in packages}


def all_kernels() -> tuple[KernelPackage, ...]:
    """Every kernels package some family's fast path needs, each once, in table order."""
    return tuple(dict.fromkeys(k for f in FAMILIES for k in f.kernels))
