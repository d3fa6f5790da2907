"""Typed, nested run configuration: YAML file + `a.b=value` overrides, validated before any model loads."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dflash.errors import BadInput, ConfigError
from dflash.packaged import resolve_packaged_path


@dataclass
class TargetConfig:
    """The frozen target model."""

    path: str | None = None  # local Hugging Face model directory (never downloaded)
    random_init: dict[str, Any] | None = None  # a transformers config dict: build with random weights
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    layer_ids: list[int] | None = None  # tapped layers; default spread evenly (DESIGN §2)
    allow_slow_path: bool = False  # allow hybrid targets on CUDA without the fast kernels
    attn_implementation: str | None = None  # e.g. "sdpa", "flash_attention_2"; None = transformers' default
    float8: bool = False  # the feature forward's linear layers in float8 (rowwise); decoding keeps `dtype`


@dataclass
class TokenizerConfig:
    path: str | None = None  # defaults to target.path
    synthetic_vocab_size: int | None = None  # build the synthetic-language tokenizer (tests, demos)


@dataclass
class DrafterConfig:
    num_layers: int = 5
    block_size: int = 16
    gamma: float | None = None  # loss decay; default 7 for B=16 (paper), scaled with block size otherwise
    num_anchors: int = 512
    mask_token_id: int | None = None  # default: tokenizer's mask/pad token
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    loss_chunk_size: int = 4096  # rows of LM-head logits materialised at a time
    loss_impl: Literal["checkpoint", "fused"] = "fused"  # fused: row gradients in the forward, no recompute
    init_from: str | None = None  # a drafter directory (export layout) to start from
    float8: bool = False  # linear layers in float8 (torchao Float8Linear; GPUs of compute capability 8.9+)
    float8_head: bool = False  # with float8: the training loss's two LM-head matmuls in float8 too (rowwise scales)
    intermediate_size: int | None = None  # default: the target's
    num_attention_heads: int | None = None  # default: the target's
    num_key_value_heads: int | None = None  # default: the target's
    # per layer full_attention or sliding_attention (SGLang/vLLM semantics: dflash.models.attention); None = all full
    layer_types: list[str] | None = None
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included; required with one
    # a DFlash2 drafter (docs/method.md): {conv_kernel_size, conv_group_size, selector_rank, selector_top_k,
    # output_multiplier, final_logit_softcapping}; None = plain DFlash
    dflash2: dict[str, Any] | None = None


DFLASH2_KEYS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16,
                "output_multiplier": 1.0, "final_logit_softcapping": None}


def check_dflash2(spec: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    """drafter.dflash2 with its defaults filled in (z-lab's published values), or a ConfigError naming the field."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ConfigError(f"{key} must be a mapping of {', '.join(DFLASH2_KEYS)} (got {spec!r})")
    unknown = sorted(set(spec) - set(DFLASH2_KEYS))
    if unknown:
        raise ConfigError(f"{key} has unknown keys {', '.join(unknown)}; use only {', '.join(DFLASH2_KEYS)}")
    out = {**DFLASH2_KEYS, **spec}
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        v = out[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{key}.{name} must be a positive integer (got {v!r})")
    for name in ("output_multiplier", "final_logit_softcapping"):
        v = out[name]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v < 0):
            raise ConfigError(f"{key}.{name} must be a non-negative number or null (got {v!r})")
    return out


LAYER_TYPES = ("full_attention", "sliding_attention")  # a drafter layer's attention (dflash.models.attention)


def check_layout(layer_types: list[str] | None, sliding_window: int | None, num_layers: int, types_key: str,
                 window_key: str) -> None:
    """One readable ConfigError per impossible attention layout; the keys named as the caller spells them."""
    if layer_types is None:
        if sliding_window is not None:
            raise ConfigError(f"{window_key} is {sliding_window} but no layer slides; set {types_key} (e.g. "
                              f"['sliding_attention', ..., 'full_attention']) or remove {window_key}")
        return
    if isinstance(layer_types, str) or len(layer_types) != num_layers:
        raise ConfigError(f"{types_key} must list one of {', '.join(LAYER_TYPES)} per drafter layer "
                          f"({num_layers}); got {layer_types!r}")
    unknown = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        raise ConfigError(f"{types_key}: {', '.join(map(repr, unknown))} is not a drafter layer type; use "
                          f"{' or '.join(LAYER_TYPES)}")
    sliding = "sliding_attention" in layer_types
    if sliding and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1):
        raise ConfigError(f"{types_key} has sliding_attention layers: set {window_key} to their window in tokens "
                          f"(a positive integer, e.g. 2048; got {sliding_window!r})")
    if not sliding and sliding_window is not None:
        raise ConfigError(f"{window_key} is {sliding_window} but {types_key} has no sliding_attention layer; "
                          f"make some layers sliding_attention or remove {window_key}")


@dataclass
class SyntheticDataConfig:
    num_samples: int = 2000
    min_length: int = 16
    max_length: int = 48
    strides: list[int] = field(default_factory=lambda: [1, 2])
    seed: int = 1234


@dataclass
class RegenerateConfig:
    """Answers regenerated by the target inside the trainer, before tokenization (DESIGN §2b).

    Colocated runs only; for large datasets run `dflash regenerate` first (docs/regenerate.md)."""

    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy (the eval and greedy serving see exactly these answers)
    top_p: float = 1.0
    thinking: Literal["keep", "strip", "disable"] = "keep"
    batch_size: int = 64


@dataclass
class DataConfig:
    train_path: str | None = None  # JSONL chat data (`messages` or ShareGPT `conversations`)
    eval_path: str | None = None
    synthetic: SyntheticDataConfig | None = None  # generate a predictable language instead of reading files
    regenerate: RegenerateConfig | None = None  # replace assistant turns by the target's own answers
    eval_fraction: float = 0.05  # held-out share of synthetic data when eval_path is not set
    max_length: int = 3072
    min_loss_tokens: int = 8
    token_budget: int = 16384  # tokens (padded) per batch
    bucket_size: int = 256  # sequence lengths are rounded up to a multiple of this
    cache_dir: str | None = None  # tokenized cache; default OUTPUT_DIR/../.dflash-cache
    # the target's tapped features of every sample kept on disk (OUTPUT_DIR/feature-cache): epochs after the first
    # skip the target (dflash/data/feature_cache.py; colocated runs)
    feature_cache: bool = False
    feature_cache_dtype: Literal["bfloat16", "float32"] = "bfloat16"


@dataclass
class OptimConfig:
    lr: float = 6e-4
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_ratio: float = 0.04
    epochs: int = 6
    max_steps: int | None = None  # stop earlier than `epochs` (also sets the schedule length)
    grad_accum: int = 1  # micro-batches per rank per step; global batch = grad_accum x data-parallel ranks
    min_lr_ratio: float = 0.0


@dataclass
class CheckpointConfig:
    interval: int = 500  # steps
    keep_last: int = 3
    resume: bool = True
    # resume-contract keys (RESUME_CONTRACT_KEYS) whose change since the checkpoint is accepted knowingly
    allow_changed: list[str] = field(default_factory=list)


# The settings that change the loss or the drafter's layout: recorded in every checkpoint (contract.json) and
# compared on resume (docs/checkpoints.md, "Resume contract"). The drafter's attention layout counts where set.
RESUME_CONTRACT_KEYS = ("drafter.block_size", "drafter.gamma", "drafter.num_anchors", "drafter.loss_impl",
                        "drafter.num_layers", "target.layer_ids", "drafter.layer_types", "drafter.sliding_window")
# changes that no override can accept: the checkpoint's weights would not fit the config's drafter
RESUME_SHAPE_KEYS = {"drafter.num_layers": "the drafter's number of layers (its weights)"}


@dataclass
class MlflowConfig:
    tracking_uri: str | None = None  # null: MLFLOW_TRACKING_URI, else a local file store OUTPUT_DIR/mlruns
    experiment: str = "dflash"


@dataclass
class WandbConfig:
    project: str = "dflash"
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] | None = None  # null: WANDB_MODE, else online
    init_timeout: float = 60.0  # seconds wandb.init may take (an unreachable server: one warning after it)


@dataclass
class LoggingConfig:
    interval: int = 10  # steps
    tensorboard: bool = False
    eval_interval: int = 0  # steps; 0 = only at the end
    # experiment trackers (dflash/runtime/trackers.py); `tensorboard` here is the same as `tensorboard: true`
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = field(default_factory=list)
    run_name: str | None = None  # the trackers' run name; null: the output directory's name
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class EvalConfig:
    """Real speculative decoding at every eval (logging.eval_interval and the final one)."""

    speculative_prompts: int = 8  # held-out prompts decoded with the target + drafter; 0 = off
    # per prompt; None: the length of the run's regenerated answers (data.regenerate.max_new_tokens, or the
    # max_new_tokens of a `dflash regenerate` manifest beside the data), else 128 (dflash.evaluation.evaluate.eval_token_limit)
    max_new_tokens: int | None = None


@dataclass
class CompileConfig:
    """`torch.compile` of each piece; null = on when the run is on CUDA (tested equal to eager there), off on
    the CPU. A piece whose compilation fails runs eagerly, with one log line saying so."""

    target: bool | None = None  # each decoder layer of the frozen target (dense and hybrid)
    drafter: bool | None = None  # the drafter's whole forward (its BlockMask stays eager)
    flex: bool | None = None  # flex_attention (eager flex_attention is a slow reference path)
    loss: bool | None = None  # the fused loss's per-chunk softmax / CE / gradient
    target_mode: str = "default"  # torch.compile mode of the target's layers (max-autotune: no faster, 10x the compile time)
    drafter_mode: str = "default"  # torch.compile mode of the drafter forward and of flex_attention
    cache_dir: str | None = None  # inductor/Triton kernel cache; default OUTPUT_DIR/compile-cache (kept across restarts)
    flex_kernel_options: dict[str, Any] | None = None  # flex_attention tiles; null = dflash's measured choice for the GPU, {} = torch's
    # flex_attention's kernels: auto = FlashAttention-4's (flash-attn-4) where installed on a Hopper or newer GPU
    # and they pass a start-up check against the Triton kernels, else triton; flash = those or an error
    flex_backend: Literal["auto", "triton", "flash"] = "auto"
    # the drafter's whole step (forward, loss, backward, clip, AdamW) replayed from a CUDA graph per input shape;
    # null = on where the run allows it (CUDA, one rank, optim.grad_accum 1), false = never (dflash/training/step_graph.py)
    step_graph: bool | None = None
    step_graph_shapes: int = 2  # input shapes captured at most (each holds one step's activations between steps)


@dataclass
class TopologyConfig:
    mode: Literal["colocated", "disaggregated"] = "colocated"
    nproc: int = 1  # ranks on this node (colocated)
    target_gpus: list[int] | None = None  # disaggregated: GPUs of the target ranks
    drafter_gpus: list[int] | None = None  # disaggregated: GPUs of the drafter ranks
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29512
    timeout_s: int = 600  # collectives and transfers
    max_inflight: int = 2  # disaggregated backpressure: batches in flight per drafter rank
    target_stages: int = 1  # disaggregated: target ranks that share one target by layers (a layer split)


@dataclass
class RuntimeConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int | None = None  # torch CPU threads
    peak_tflops: float | None = None  # for MFU; default: known GPUs (H100/H200: 790 measured bf16)
    step_pause_s: float = 0.0  # sleep after each step: leaves the CPU to others on a shared small machine


@dataclass
class RunConfig:
    output_dir: str = "runs/default"
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------- loading


# Keys of earlier versions that now live elsewhere: the error names the new home.
MOVED_KEYS = {
    "drafter.compile": "set compile.drafter (true, false, or null = on CUDA); the compile section also holds "
                       "compile.target, compile.flex and compile.loss",
}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"list of {_type_name(inner)}"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, converting only where lossless (int -> float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: must be one of {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")  # pragma: no cover - programming error


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if full in MOVED_KEYS:
            raise ConfigError(f"config key '{full}' has moved: {MOVED_KEYS[full]}")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{(prefix + '.') if prefix else ''}{close[0]}'?" if close else ""
            raise ConfigError(
                f"unknown config key '{full}'{hint} (valid keys here: {', '.join(names)})"
            )
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form key.path=value (e.g. optim.lr=3e-4)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = _parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML, apply overrides, build the typed config and check every value that needs no model."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist; pass the path of a YAML run config")
        try:
            loaded = yaml.safe_load(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file '{p}' is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                              f"{exc.start})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file '{p}' is not valid YAML: {_yaml_error_line(exc)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping at the top level")
        data = loaded or {}
        # Relative paths inside a config file are relative to that file.
        data.setdefault("_base_dir", str(p.resolve().parent))
    base_dir = data.pop("_base_dir", None)
    data = apply_overrides(data, overrides or [])
    config = _build(RunConfig, data, "")
    try:  # `packaged:NAME`: a target converted from an installed package (dflash/packaged.py)
        config.target.path = resolve_packaged_path(config.target.path)
        config.tokenizer.path = resolve_packaged_path(config.tokenizer.path, "tokenizer.path")
    except BadInput as exc:
        raise ConfigError(str(exc)) from None
    if base_dir:
        _resolve_paths(config, Path(base_dir))
    validate(config)
    return config


def _yaml_error_line(exc: yaml.YAMLError) -> str:
    """One line: 'line L, column C: problem' (PyYAML's own text spans several lines)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{' '.join(str(problem).split())}"


def _resolve_paths(config: RunConfig, base: Path) -> None:
    def fix(value: str | None) -> str | None:
        if value is None or os.path.isabs(value):
            return value
        candidate = base / value
        return str(candidate) if candidate.exists() else value

    config.target.path = fix(config.target.path)
    config.tokenizer.path = fix(config.tokenizer.path)
    config.data.train_path = fix(config.data.train_path)
    config.data.eval_path = fix(config.data.eval_path)
    config.drafter.init_from = fix(config.drafter.init_from)


# torch's flex_attention kernel_options that set tiles and pipelining (each may carry a fwd_ or bwd_ prefix)
FLEX_OPTION_NAMES = {"BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps",
                     "num_stages", "USE_TMA"}
FLEX_MASK_TILE = 128  # the drafter's BlockMask tile (dflash.models.attention): every kernel tile divides it


def check_flex_options(options: dict, key: str = "compile.flex_kernel_options") -> dict[str, int | bool]:
    """`options` as flex_attention's `kernel_options`, or a ConfigError naming the entry and what it may be."""
    checked: dict[str, int | bool] = {}
    for name, value in options.items():
        base = str(name).removeprefix("fwd_").removeprefix("bwd_")
        if base not in FLEX_OPTION_NAMES:
            raise ConfigError(f"{key}.{name}: not a flex_attention tile option; use one of "
                              f"{', '.join(sorted(FLEX_OPTION_NAMES))}, optionally prefixed fwd_ or bwd_")
        if base == "USE_TMA":
            if not isinstance(value, bool):
                raise ConfigError(f"{key}.{name}: expected true or false, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}.{name}: expected a positive integer, got {value!r}")
        elif base.startswith("BLOCK_") and (value & (value - 1) or FLEX_MASK_TILE % value or value < 16):
            raise ConfigError(f"{key}.{name}: {value} must be a power of two dividing the BlockMask tile "
                              f"({FLEX_MASK_TILE}): 16, 32, 64 or 128")
        checked[str(name)] = value
    return checked


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(config: RunConfig) -> None:
    """Checks that need no model. Model-dependent checks run in `validate_against_target`."""
    t, d, data, o = config.target, config.drafter, config.data, config.optim
    _check_finite(config, "")
    _require(
        (t.path is None) != (t.random_init is None),
        "target: set exactly one of target.path (a local model directory) or target.random_init "
        "(a transformers config dict for random weights)",
    )
    if t.path is not None:
        _require(Path(t.path).is_dir(), f"target.path '{t.path}' is not a directory; point it at a local "
                 "Hugging Face model directory (dflash never downloads weights)")
    if t.random_init is not None:
        _require("model_type" in t.random_init, "target.random_init needs a 'model_type' (e.g. qwen3)")
    _require(d.block_size >= 2, f"drafter.block_size must be >= 2 (got {d.block_size}): position 0 "
             "holds the anchor token and predicts nothing")
    _require(d.num_layers >= 1, f"drafter.num_layers must be >= 1 (got {d.num_layers})")
    _require(d.num_anchors >= 1, f"drafter.num_anchors must be >= 1 (got {d.num_anchors})")
    _require(d.gamma is None or d.gamma > 0, f"drafter.gamma must be > 0 (got {d.gamma})")
    _require(d.loss_chunk_size >= 1, "drafter.loss_chunk_size must be >= 1")
    _require(not d.float8_head or d.float8, "drafter.float8_head puts the loss's LM head in float8 beside the "
             "drafter's float8 linear layers; set drafter.float8: true too, or drafter.float8_head: false")
    _require(not d.float8_head or d.loss_impl == "fused", "drafter.float8_head runs in the fused loss; set "
             "drafter.loss_impl: fused, or drafter.float8_head: false")
    check_layout(d.layer_types, d.sliding_window, d.num_layers, "drafter.layer_types", "drafter.sliding_window")
    dflash2 = check_dflash2(d.dflash2, "drafter.dflash2")
    hidden = (t.random_init or {}).get("hidden_size")  # a target.path's width is checked when the drafter is built
    _require(not dflash2 or not isinstance(hidden, int) or hidden % dflash2["conv_group_size"] == 0,
             f"drafter.dflash2.conv_group_size {(dflash2 or {}).get('conv_group_size')} does not divide hidden_size "
             f"{hidden} (the target's); use a divisor (e.g. 16)")
    _require(d.dflash2 is None or not d.float8_head, "drafter.float8_head is the fused DFlash loss's; a DFlash2 "
             "drafter's loss (scaled, soft-capped logits and the selector) runs unfused: set drafter.float8_head: false")
    _require(data.synthetic is not None or data.train_path is not None,
             "data: set data.train_path (a JSONL file) or data.synthetic (generated data)")
    if data.train_path is not None and data.synthetic is None:
        _require(Path(data.train_path).is_file(), f"data.train_path '{data.train_path}' does not exist; "
                 "point it at a JSONL file of chat samples")
    if data.eval_path is not None:
        _require(Path(data.eval_path).is_file(), f"data.eval_path '{data.eval_path}' does not exist")
    _require(data.max_length >= d.block_size + 1,
             f"data.max_length ({data.max_length}) must exceed drafter.block_size ({d.block_size})")
    _require(data.bucket_size >= 1, "data.bucket_size must be >= 1")
    _require(data.min_loss_tokens >= 1, f"data.min_loss_tokens must be >= 1 (got {data.min_loss_tokens}): a sample "
             "with no assistant token to predict trains nothing")
    _require(data.token_budget >= data.max_length,
             f"data.token_budget ({data.token_budget}) is smaller than one sequence of data.max_length "
             f"({data.max_length}); raise data.token_budget to at least {data.max_length} or lower "
             "data.max_length")
    _require(0.0 <= data.eval_fraction < 1.0, "data.eval_fraction must be in [0, 1)")
    if data.synthetic is not None:
        s = data.synthetic
        _require(1 <= s.min_length <= s.max_length, "data.synthetic: need 1 <= min_length <= max_length")
        _require(s.num_samples >= 1, "data.synthetic.num_samples must be >= 1")
        _require(all(x >= 1 for x in s.strides) and s.strides, "data.synthetic.strides: positive integers")
    if data.regenerate is not None:
        r = data.regenerate
        _require(r.max_new_tokens >= 1, "data.regenerate.max_new_tokens must be >= 1")
        _require(r.temperature >= 0, "data.regenerate.temperature must be >= 0 (0 = greedy)")
        _require(0 < r.top_p <= 1, "data.regenerate.top_p must be in (0, 1]")
        _require(r.batch_size >= 1, "data.regenerate.batch_size must be >= 1")
    _require(config.eval.speculative_prompts >= 0, "eval.speculative_prompts must be >= 0 (0 = off)")
    _require(config.eval.max_new_tokens is None or config.eval.max_new_tokens >= 1,
             "eval.max_new_tokens must be >= 1 (or unset: the length of the run's regenerated answers)")
    _require(o.lr > 0, f"optim.lr must be > 0 (got {o.lr})")
    _require(o.eps >= 0, f"optim.eps must be >= 0 (got {o.eps})")
    _require(o.weight_decay >= 0, f"optim.weight_decay must be >= 0 (got {o.weight_decay})")
    _require(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1] (got {o.min_lr_ratio})")
    _require(config.runtime.num_threads is None or config.runtime.num_threads >= 1,
             f"runtime.num_threads must be >= 1 or null (got {config.runtime.num_threads})")
    _require(0 <= config.runtime.step_pause_s <= 60,
             f"runtime.step_pause_s must be in [0, 60] seconds (got {config.runtime.step_pause_s})")
    _require(config.runtime.peak_tflops is None or config.runtime.peak_tflops > 0,
             f"runtime.peak_tflops must be > 0 or null (got {config.runtime.peak_tflops})")
    _require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas: two numbers in [0, 1)")
    _require(0 <= o.warmup_ratio < 1, "optim.warmup_ratio must be in [0, 1)")
    _require(o.grad_clip > 0, "optim.grad_clip must be > 0")
    _require(o.epochs >= 1, "optim.epochs must be >= 1")
    _require(o.max_steps is None or o.max_steps >= 1, "optim.max_steps must be >= 1 or null")
    _require(o.grad_accum >= 1, f"optim.grad_accum must be >= 1 (got {o.grad_accum})")
    _require(config.checkpoint.interval >= 1, "checkpoint.interval must be >= 1")
    _require(config.checkpoint.keep_last >= 1, "checkpoint.keep_last must be >= 1")
    validate_allow_changed(config.checkpoint.allow_changed)
    _require(config.logging.interval >= 1, "logging.interval must be >= 1")
    _require(config.logging.eval_interval >= 0, f"logging.eval_interval must be >= 0 steps, 0 = only at the end "
             f"(got {config.logging.eval_interval})")
    if config.compile.flex_backend == "flash":  # what rules FlashAttention-4 out whatever the machine
        off = [why for cond, why in ((config.runtime.device == "cpu", "runtime.device is cpu"),
                                     (config.drafter.attention == "sdpa", "drafter.attention is sdpa"),
                                     (config.compile.flex is False, "compile.flex is false")) if cond]
        _require(not off, f"compile.flex_backend=flash but {' and '.join(off)} (FlashAttention-4 runs the compiled "
                 "flex_attention of a CUDA run); set compile.flex_backend=auto")
    if config.compile.flex_kernel_options is not None:
        check_flex_options(config.compile.flex_kernel_options)
        _require(not (config.compile.flex_backend == "flash" and config.compile.flex_kernel_options),
                 "compile.flex_kernel_options sets Triton tiles but compile.flex_backend is flash (FlashAttention-4 "
                 "picks its own tiles); remove the tiles or set compile.flex_backend=triton")
    _require(config.compile.step_graph_shapes >= 1, f"compile.step_graph_shapes must be >= 1 (got "
             f"{config.compile.step_graph_shapes}); set compile.step_graph=false to capture none")
    validate_topology(config.topology)
    _require(data.regenerate is None or config.topology.mode == "colocated",
             "data.regenerate runs inside colocated trainers only; for a disaggregated run regenerate the data "
             "first with `dflash regenerate` and set data.train_path to its output")
    _require(not data.feature_cache or config.topology.mode == "colocated",
             "data.feature_cache keeps the features of a colocated trainer's own target; a disaggregated run's "
             "drafter ranks hold no target: set data.feature_cache=false")


def validate_allow_changed(keys: list[str]) -> None:
    """checkpoint.allow_changed names resume-contract keys whose change a resume can take."""
    for key in keys:
        _require(key not in RESUME_SHAPE_KEYS,
                 f"checkpoint.allow_changed: {key} cannot be accepted on resume: it changes "
                 f"{RESUME_SHAPE_KEYS.get(key)}, which the checkpoint's weights do not fit; start a new output_dir")
        _require(key in RESUME_CONTRACT_KEYS,
                 f"checkpoint.allow_changed: {key!r} is not a resume-contract key; use any of "
                 f"{', '.join(k for k in RESUME_CONTRACT_KEYS if k not in RESUME_SHAPE_KEYS)}")


def _check_finite(node: Any, prefix: str) -> None:
    """Every number of the config is finite: inf and NaN pass comparisons like `lr > 0` (NaN fails them all)."""
    for f in dataclasses.fields(node):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _check_finite(value, key)
            continue
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, v in items:
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{key}{'' if i is None else f'[{i}]'} must be a finite number (got {v})")


def validate_topology(top: TopologyConfig) -> None:
    _require(top.nnodes >= 1, f"topology.nnodes must be >= 1 (got {top.nnodes})")
    _require(0 <= top.node_rank < top.nnodes,
             f"topology.node_rank {top.node_rank} is outside 0..{top.nnodes - 1} (topology.nnodes={top.nnodes})")
    _require(1 <= top.master_port <= 65535, f"topology.master_port {top.master_port} is not a TCP port")
    _require(top.timeout_s >= 1, f"topology.timeout_s must be >= 1 second (got {top.timeout_s})")
    _require(top.max_inflight >= 1, f"topology.max_inflight must be >= 1 (got {top.max_inflight})")
    _require(top.target_stages >= 1, f"topology.target_stages must be >= 1 (got {top.target_stages})")
    if top.mode == "colocated":
        _require(top.nproc >= 1, "topology.nproc must be >= 1")
        _require(top.target_stages == 1, "topology.target_stages splits the target over target ranks: it needs "
                 "topology.mode=disaggregated")
        return
    tg, dg = top.target_gpus or [], top.drafter_gpus or []
    _require(bool(tg), "topology.target_gpus: list the GPU ids of the target ranks (disaggregated mode)")
    _require(bool(dg), "topology.drafter_gpus: list the GPU ids of the drafter ranks (disaggregated mode)")
    for name, ids in (("target_gpus", tg), ("drafter_gpus", dg)):
        _require(len(set(ids)) == len(ids), f"topology.{name} {ids} lists a GPU twice")
        _require(all(i >= 0 for i in ids), f"topology.{name} {ids}: GPU ids are >= 0")
    _require(len(tg) % top.target_stages == 0,
             f"topology.target_gpus {tg}: {len(tg)} target ranks cannot form replicas of "
             f"topology.target_stages={top.target_stages} stages; list a multiple of {top.target_stages} GPUs")
    overlap = sorted(set(tg) & set(dg))
    _require(not overlap, f"topology: GPUs {overlap} are in both target_gpus and drafter_gpus; "
             "give each GPU one role")


def default_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """DESIGN §2: round(1 + i*(L-4)/(n-1)) with Python's round() (halves to even, as the public reference and
    SGLang): Qwen3-8B (L=36), n=5 -> [1, 9, 17, 25, 33]; L=94 -> [1, 24, 46, 68, 91]."""
    if n == 1:
        return [num_target_layers // 2]
    span = max(num_target_layers - 4, 0)
    ids = [round(1 + i * span / (n - 1)) for i in range(n)]  # Python's round(), as the reference and SGLang
    return [min(i, num_target_layers - 1) for i in ids]


def default_gamma(block_size: int) -> float:
    """Paper: gamma=7 for B=16, 5 for B=10, 4 for B=8; elsewhere scaled linearly (at least 1)."""
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    return table.get(block_size, max(1.0, round(7.0 * block_size / 16.0, 2)))


def resolved_layer_ids(config: RunConfig, num_target_layers: int) -> list[int]:
    ids = config.target.layer_ids
    if ids is None:
        ids = default_layer_ids(num_target_layers, config.drafter.num_layers)
    _require(bool(ids), "target.layer_ids: list at least one layer")
    bad = [i for i in ids if i < 0 or i >= num_target_layers]
    _require(not bad, f"target.layer_ids {ids}: layer ids {bad} are beyond the target's depth "
             f"({num_target_layers} layers, ids 0..{num_target_layers - 1}); fix target.layer_ids")
    _require(len(set(ids)) == len(ids), f"target.layer_ids {ids} repeats a layer; set distinct ids "
             "explicitly (small targets cannot use the default spread)")
    return sorted(ids)
