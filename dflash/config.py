"""Typed, nested run configuration: YAML file + `a.b=value` overrides, validated before any model loads."""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dflash.errors import ConfigError


@dataclass
class TargetConfig:
    """The frozen target model."""

    path: str | None = None  # local Hugging Face model directory (never downloaded)
    random_init: dict[str, Any] | None = None  # a transformers config dict: build with random weights
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    layer_ids: list[int] | None = None  # tapped layers; default spread evenly (DESIGN §2)
    allow_slow_path: bool = False  # allow hybrid targets on CUDA without the fast kernels
    attn_implementation: str | None = None  # e.g. "sdpa", "flash_attention_2"; None = transformers' default


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
    compile: bool = False
    loss_chunk_size: int = 4096  # rows of LM-head logits materialised at a time
    loss_impl: Literal["checkpoint", "fused"] = "fused"  # fused: row gradients in the forward, no recompute
    init_from: str | None = None  # a drafter directory (export layout) to start from
    intermediate_size: int | None = None  # default: the target's
    num_attention_heads: int | None = None  # default: the target's
    num_key_value_heads: int | None = None  # default: the target's


@dataclass
class SyntheticDataConfig:
    num_samples: int = 2000
    min_length: int = 16
    max_length: int = 48
    strides: list[int] = field(default_factory=lambda: [1, 2])
    seed: int = 1234


@dataclass
class DataConfig:
    train_path: str | None = None  # JSONL chat data (`messages` or ShareGPT `conversations`)
    eval_path: str | None = None
    synthetic: SyntheticDataConfig | None = None  # generate a predictable language instead of reading files
    eval_fraction: float = 0.05  # held-out share of synthetic data when eval_path is not set
    max_length: int = 3072
    min_loss_tokens: int = 8
    token_budget: int = 16384  # tokens (padded) per batch
    bucket_size: int = 256  # sequence lengths are rounded up to a multiple of this
    cache_dir: str | None = None  # tokenized cache; default OUTPUT_DIR/../.dflash-cache
    num_workers: int = 0


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


@dataclass
class LoggingConfig:
    interval: int = 10  # steps
    tensorboard: bool = False
    eval_interval: int = 0  # steps; 0 = only at the end


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
    deterministic: bool = False
    peak_tflops: float | None = None  # for MFU; default: known GPUs (H100/H200: 790 measured bf16)


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
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------- loading


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
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file '{p}' is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping at the top level")
        data = loaded or {}
        # Relative paths inside a config file are relative to that file.
        data.setdefault("_base_dir", str(p.resolve().parent))
    base_dir = data.pop("_base_dir", None)
    data = apply_overrides(data, overrides or [])
    config = _build(RunConfig, data, "")
    if base_dir:
        _resolve_paths(config, Path(base_dir))
    validate(config)
    return config


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


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(config: RunConfig) -> None:
    """Checks that need no model. Model-dependent checks run in `validate_against_target`."""
    t, d, data, o = config.target, config.drafter, config.data, config.optim
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
    _require(o.lr > 0, f"optim.lr must be > 0 (got {o.lr})")
    _require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas: two numbers in [0, 1)")
    _require(0 <= o.warmup_ratio < 1, "optim.warmup_ratio must be in [0, 1)")
    _require(o.grad_clip > 0, "optim.grad_clip must be > 0")
    _require(o.epochs >= 1, "optim.epochs must be >= 1")
    _require(o.max_steps is None or o.max_steps >= 1, "optim.max_steps must be >= 1 or null")
    _require(o.grad_accum >= 1, f"optim.grad_accum must be >= 1 (got {o.grad_accum})")
    _require(config.checkpoint.interval >= 1, "checkpoint.interval must be >= 1")
    _require(config.checkpoint.keep_last >= 1, "checkpoint.keep_last must be >= 1")
    _require(config.logging.interval >= 1, "logging.interval must be >= 1")
    validate_topology(config.topology)


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
    """DESIGN §2: round(1 + i*(L-4)/(n-1)); Qwen3-8B (L=36), n=5 -> [1, 9, 17, 25, 33]."""
    if n == 1:
        return [num_target_layers // 2]
    span = max(num_target_layers - 4, 0)
    ids = [int(1 + i * span / (n - 1) + 0.5) for i in range(n)]
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
