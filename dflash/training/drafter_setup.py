"""The drafter a run trains, built once at the trainer's setup: a new one shaped by the config and the target, or
`drafter.init_from`'s (checked against the config first); its float8 linear layers; its attention kind and, for
flex_attention, the kernel options (FlashAttention-4's where they pass their start-up check, else the Triton tiles);
its compiled forward; and the block pass (`dflash.components.loss.BlockPass`) the training step and the evals share."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from dflash.compile import CompilePlan, compile_drafter, flash_version
from dflash.components.float8 import check_float8_head, convert_linears, float8_linears
from dflash.components.loss import BlockPass
from dflash.config import RunConfig, check_dflash2, default_gamma
from dflash.errors import BadInput
from dflash.logs import get_logger
from dflash.models.attention import (
    FLASH_OPTIONS,
    compiled_flex_attention,
    flex_options_for,
    probe_flash,
    resolve_flex_backend,
    resolve_kind,
)
from dflash.models.drafter import Drafter, DrafterArch, arch_from_target
from dflash.models.target import Target, target_config, text_config_of

log = get_logger(__name__)


@dataclass
class DrafterSetup:
    drafter: Drafter
    gamma: float
    attention_kind: str
    flex: Any  # the compiled flex_attention, or None
    block_pass: BlockPass


def mask_token_id(config: RunConfig, tokenizer, vocab_size: int) -> int:
    c = config.drafter
    mid = c.mask_token_id
    if mid is None:
        mid = getattr(tokenizer, "mask_token_id", None)
    if mid is None:
        mid = tokenizer.pad_token_id
    if mid is None or not 0 <= mid < vocab_size:
        raise BadInput(f"drafter.mask_token_id {mid} is not a token of the target's vocabulary (0..{vocab_size - 1}); "
                       "set drafter.mask_token_id to a reserved token id")
    return int(mid)


def build_drafter(config: RunConfig, layer_ids: list[int], tokenizer, target: Target | None, device: torch.device,
                  plan: CompilePlan) -> DrafterSetup:
    c = config
    tcfg = target_config(c.target.path, c.target.random_init)
    text_cfg = text_config_of(tcfg)
    vocab = target.vocab_size if target is not None else text_cfg.vocab_size
    if c.drafter.init_from:  # must agree with this config: what it trains is the config's drafter
        from dflash.components.export import load_init_drafter

        mask_key = "drafter.mask_token_id" if c.drafter.mask_token_id is not None else (
            "drafter.mask_token_id (unset: the tokenizer's mask or pad token)")
        expected = {"block_size": ("drafter.block_size", c.drafter.block_size),
                    "num_hidden_layers": ("drafter.num_layers", c.drafter.num_layers),
                    "target_layer_ids": ("target.layer_ids (resolved)", list(layer_ids)),
                    "mask_token_id": (mask_key, mask_token_id(c, tokenizer, vocab)),
                    "hidden_size": ("the target's hidden_size", int(text_cfg.hidden_size))}
        for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads"):  # when set
            if getattr(c.drafter, key) is not None:
                expected[key] = (f"drafter.{key}", getattr(c.drafter, key))
        for key, value in (check_dflash2(c.drafter.dflash2, "drafter.dflash2") or {}).items():
            expected[key] = (f"drafter.dflash2.{key}", value)  # where set, the init must be that DFlash2
        drafter = load_init_drafter(c.drafter.init_from, expected)
    else:
        arch = arch_from_target(tcfg, num_layers=c.drafter.num_layers, block_size=c.drafter.block_size,
                                layer_ids=layer_ids, mask_token_id=mask_token_id(c, tokenizer, vocab),
                                vocab_size=vocab, intermediate_size=c.drafter.intermediate_size,
                                num_attention_heads=c.drafter.num_attention_heads,
                                num_key_value_heads=c.drafter.num_key_value_heads,
                                layer_types=c.drafter.layer_types, sliding_window=c.drafter.sliding_window,
                                dflash2=check_dflash2(c.drafter.dflash2, "drafter.dflash2"))
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(c.seed + 17)
        drafter = Drafter(arch)
        torch.random.set_rng_state(gen_state)
    drafter.to(device)
    if c.drafter.float8_head:
        check_float8_head(drafter.arch.vocab_size, drafter.arch.hidden_size)
    if c.drafter.float8:  # before compilation: the compiled forward fuses the float8 casts
        kept = convert_linears(drafter)
        log.info(f"drafter: {len(float8_linears(drafter))} linear layers in float8 (torchao, tensorwise)"
                 + ("; the loss's LM head in float8 (rowwise)" if c.drafter.float8_head else "")
                 + (f"; kept in their precision (dimensions not divisible by 16): {', '.join(kept)}"
                    if kept else ""))
    gamma = c.drafter.gamma or default_gamma(c.drafter.block_size)
    attention_kind = resolve_kind(c.drafter.attention, device)
    flex = None
    if attention_kind == "flex" and plan.flex:
        flex = compiled_flex_attention(plan.drafter_mode,
                                       flex_kernel_options(c.compile, drafter.arch, device, plan.drafter_mode))
    elif c.compile.flex_backend == "flash":
        raise BadInput("compile.flex_backend=flash but this run's drafter attention is not compiled "
                       f"flex_attention ({attention_kind} on {device.type}"
                       f"{'' if plan.flex else ', compile.flex off'}); set compile.flex_backend=auto")
    if plan.drafter:  # the whole forward (measured faster than per layer); the BlockMask stays eager
        compile_drafter(drafter, plan.drafter_mode)
    d = c.drafter
    block_pass = BlockPass(drafter, d.block_size, gamma, d.num_anchors, d.loss_chunk_size, d.loss_impl,
                           attention_kind, device, flex, d.float8_head)
    return DrafterSetup(drafter, gamma, attention_kind, flex, block_pass)


def flex_kernel_options(c: Any, arch: DrafterArch, device: torch.device, mode: str) -> dict:
    """flex_attention's kernel options (`c`: the config's `compile` section): FlashAttention-4's kernels where they
    run here and pass the start-up check (dflash.models.attention.probe_flash), else the Triton tiles. One log line
    says which and why."""
    backend, why = resolve_flex_backend(c.flex_backend, device, arch.head_dim)
    if backend == "flash":
        t0 = time.monotonic()
        layers = tuple(arch.layer_mask(i) for i in range(arch.num_hidden_layers))
        why = probe_flash(mode, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim,
                          arch.block_size, device, layers)
        if why is None:
            log.info(f"compile: flex_attention on FlashAttention-4's kernels (flash-attn-4 {flash_version()}; "
                     f"checked against the Triton kernels in {time.monotonic() - t0:.0f}s)")
            return dict(FLASH_OPTIONS)
        log.warning(f"compile: FlashAttention-4's kernels failed their start-up check ({why}); flex_attention "
                    "runs on the Triton kernels. Set compile.flex_backend=triton to skip the check")
    tiles = flex_options_for(c.flex_kernel_options, device, arch.head_dim)
    log.info(f"compile: flex_attention kernel options {tiles or 'torch defaults'}"
             + (f" (Triton: {why})" if why and device.type == "cuda" else ""))
    return tiles
