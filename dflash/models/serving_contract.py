"""The serving contract of an exported drafter: what the engines' DFlash loaders read, checked on the directory.

Every rule names the engine file it comes from (docs/serving.md has the table per engine and version). A broken
rule is an error (`dflash export --check` exits 2 naming rule and source); a known trap is a warning.

Sources (public repositories; the commits the rules were read at are in docs/serving.md):
* vLLM `vllm/model_executor/models/qwen3_dflash.py` (DFlashDraftModel), `qwen3_dflash2.py` (DFlash2DraftModel),
  `vllm/model_executor/models/registry.py` (architectures), `vllm/model_executor/layers/logits_processor.py`;
* SGLang `python/sglang/srt/speculative/dflash_utils.py` (target_layer_ids, mask token, block size) and
  `python/sglang/srt/models/dflash.py` (layer attention, hidden_act);
* z-lab `dflash/model.py` (DFlash2's modules and the names of its weights).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_DFLASH = "vLLM vllm/model_executor/models/qwen3_dflash.py"
VLLM_DFLASH2 = "vLLM vllm/model_executor/models/qwen3_dflash2.py"
VLLM_REGISTRY = "vLLM vllm/model_executor/models/registry.py"
VLLM_LOGITS = "vLLM vllm/model_executor/layers/logits_processor.py"
SGLANG_UTILS = "SGLang python/sglang/srt/speculative/dflash_utils.py"
SGLANG_MODEL = "SGLang python/sglang/srt/models/dflash.py"
ZLAB_MODEL = "z-lab dflash/model.py"

ARCHITECTURES = {"DFlashDraftModel", "DFlash2DraftModel"}
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
LAYER_TYPES = ("full_attention", "sliding_attention")
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclass(frozen=True)
class Finding:
    rule: str  # e.g. "target_layer_ids"
    source: str  # the engine file the rule comes from
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message} (rule from {self.source})"


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _header(path: Path) -> dict[str, dict]:
    """The safetensors header (names, dtypes, shapes) without reading the tensors."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Weight names and shapes the loaders expect for a config (the names of z-lab's and vLLM's modules)."""
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or h // heads
    dc = cfg.get("dflash_config") or {}
    taps = len(dc.get("target_layer_ids") or [])
    out: dict[str, tuple[int, ...]] = {"fc.weight": (h, taps * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for j in range(n):
        p = f"layers.{j}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                    p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                    p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
        if dc.get("conv_kernel_size"):
            k, g = int(dc["conv_kernel_size"]), h // int(dc["conv_group_size"])
            for conv in ("attention_conv", "mlp_conv"):
                out[p + conv + ".base_kernel"] = (2, k, h)
                out[p + conv + ".kernel_projection.weight"] = (2 * k * g, h)
    if dc.get("selector_rank"):
        r, v = int(dc["selector_rank"]), cfg["vocab_size"]
        out.update({"candidate_selector.hidden_projection.weight": (r, h),
                    "candidate_selector.predecessor_codebook": (v, r),
                    "candidate_selector.successor_codebook": (v, r)})
    return out


def check_export(directory: str | Path) -> tuple[list[Finding], list[Finding]]:
    """(errors, warnings) of an exported drafter directory against the engines' loaders."""
    d = Path(directory)
    errors: list[Finding] = []
    warnings: list[Finding] = []

    def err(rule, source, message):
        errors.append(Finding(rule, source, message))

    def warn(rule, source, message):
        warnings.append(Finding(rule, source, message))

    for name in ("config.json", "model.safetensors"):
        if not (d / name).is_file():
            err("files", VLLM_DFLASH, f"{d / name} is missing; the loaders read config.json and model.safetensors")
    if errors:
        return errors, warnings
    try:
        cfg = json.loads((d / "config.json").read_text())
    except json.JSONDecodeError as exc:
        return [Finding("config.json", VLLM_DFLASH, f"config.json is not JSON: {exc}")], warnings
    dc = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}

    arch = cfg.get("architectures")
    dflash2 = any(dc.get(k) for k in DFLASH2_KEYS)
    if not (isinstance(arch, list) and len(arch) == 1 and arch[0] in ARCHITECTURES):
        err("architectures", VLLM_REGISTRY, f"architectures is {arch!r}; the engines map only "
            f"{sorted(ARCHITECTURES)} to their DFlash model classes")
    elif (arch[0] == "DFlash2DraftModel") != dflash2:
        err("architectures", VLLM_DFLASH2, f"architectures {arch[0]} but dflash_config "
            f"{'has' if dflash2 else 'lacks'} the DFlash2 fields {', '.join(DFLASH2_KEYS)}")
    if cfg.get("model_type") != "qwen3":
        err("model_type", VLLM_DFLASH, f"model_type is {cfg.get('model_type')!r}; the DFlash loaders build a "
            "Qwen3Config (model_type qwen3)")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not _int(cfg.get(key)) or cfg[key] < 1:
            err(key, VLLM_DFLASH, f"{key} is {cfg.get(key)!r}; a positive integer is required")
    if errors:
        return errors, warnings
    if cfg.get("hidden_act", "silu") != "silu":
        err("hidden_act", SGLANG_MODEL, f"hidden_act is {cfg['hidden_act']!r}; only silu is implemented")
    if cfg.get("attention_bias"):
        warn("attention_bias", VLLM_DFLASH, "attention_bias is true: the export carries no biases")

    ids = dc.get("target_layer_ids")
    n_target = cfg.get("num_target_layers")
    if not (isinstance(ids, list) and ids and all(_int(i) and i >= 0 for i in ids)):
        err("target_layer_ids", SGLANG_UTILS, f"dflash_config.target_layer_ids is {ids!r}; a non-empty list of "
            "0-based target layer ids is required (else SGLang falls back to a default spread)")
    elif _int(n_target) and n_target > 0 and max(ids) >= n_target:
        err("target_layer_ids", SGLANG_UTILS, f"dflash_config.target_layer_ids {ids} has an id >= num_target_layers "
            f"{n_target} (SGLang refuses an out-of-range layer id)")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and isinstance(ids, list) and list(aux) != [i + 1 for i in ids]:
        err("eagle_aux_hidden_state_layer_ids", VLLM_DFLASH, f"eagle_aux_hidden_state_layer_ids {aux} is not "
            "target_layer_ids + 1 (vLLM numbers a tap by the layer whose input it is)")

    mask = dc.get("mask_token_id")
    if not _int(mask) or not 0 <= mask < cfg["vocab_size"]:
        err("mask_token_id", VLLM_DFLASH, f"dflash_config.mask_token_id is {mask!r}; a token id below vocab_size "
            f"{cfg['vocab_size']} is required (without it SGLang adds a <|MASK|> token the drafter never saw)")

    nested, top = dc.get("block_size"), cfg.get("block_size")
    block = nested if nested is not None else top
    if not _int(block) or block < 2:
        err("block_size", SGLANG_UTILS, f"block_size is {block!r}; an integer >= 2 in dflash_config.block_size "
            "(read first) or at the top level is required")
    elif nested is not None and top is not None and nested != top:
        err("block_size", SGLANG_UTILS, f"dflash_config.block_size {nested} and block_size {top} disagree (SGLang "
            "reads the nested one, other readers the top-level one)")

    types, window = cfg.get("layer_types"), cfg.get("sliding_window")
    if types is not None:
        if not isinstance(types, list) or len(types) != cfg["num_hidden_layers"] or any(
                t not in LAYER_TYPES for t in types):
            err("layer_types", VLLM_DFLASH, f"layer_types is {types!r}; one of {LAYER_TYPES} per layer "
                f"({cfg['num_hidden_layers']}) is required")
        elif "sliding_attention" in types:
            if not _int(window) or window < 1:
                err("sliding_window", VLLM_DFLASH, f"sliding layers but sliding_window is {window!r}; vLLM "
                    "refuses a sliding DFlash layer without a window")
            if cfg.get("use_sliding_window") is False:
                err("use_sliding_window", SGLANG_MODEL, "sliding layers with use_sliding_window false: "
                    "transformers drops the window that SGLang and vLLM apply")
            if 0 < types.count("sliding_attention") < len(types):
                warn("vllm_v2_runner", VLLM_DFLASH, "mixed sliding/full layers: vLLM serves them only with its V2 "
                     "model runner (VLLM_USE_V2_MODEL_RUNNER=1), where a DFlash drafter was reported at 0% "
                     "acceptance; compare the server's acceptance with `dflash eval` before relying on it")

    params = cfg.get("rope_parameters") or {}
    theta, ptheta = cfg.get("rope_theta"), params.get("rope_theta")
    if theta is None or ptheta is None:  # z-lab's released DFlash2 config.json has rope_parameters only
        warn("rope", VLLM_DFLASH, f"only {'rope_parameters.rope_theta' if theta is None else 'rope_theta'} is "
             "written: transformers 5 (vLLM's config.rope_parameters) converts one spelling into the other, readers "
             "on transformers 4.x take rope_theta alone (default 10000); write both for them")
    elif float(theta) != float(ptheta):
        err("rope", VLLM_DFLASH, f"rope_theta {theta} and rope_parameters.rope_theta {ptheta} disagree")
    scaling = cfg.get("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type")) != params.get("rope_type"):
        err("rope", SGLANG_MODEL, f"rope_scaling {scaling} and rope_parameters {params} name different rope types")

    if dflash2:
        for key in DFLASH2_KEYS:
            if not _int(dc.get(key)) or dc[key] < 1:
                err(key, VLLM_DFLASH2, f"dflash_config.{key} is {dc.get(key)!r}; a positive integer is required")
        if _int(dc.get("conv_group_size")) and dc["conv_group_size"] > 0 and cfg["hidden_size"] % dc[
                "conv_group_size"]:
            err("conv_group_size", VLLM_DFLASH2, f"conv_group_size {dc['conv_group_size']} does not divide "
                f"hidden_size {cfg['hidden_size']}")
        if cfg.get("is_causal") is not False:
            warn("is_causal", ZLAB_MODEL, f"is_causal is {cfg.get('is_causal')!r}; the released DFlash2 drafters "
                 "say false (non-causal blocks), and vLLM reads it first")
        if float(dc.get("output_multiplier", 1.0) or 1.0) != 1.0 and dc.get("final_logit_softcapping"):
            warn("logit_order", VLLM_LOGITS, "output_multiplier and final_logit_softcapping both set: z-lab's "
                 "compute_logits (and dflash) scale then soft-cap, vLLM's LogitsProcessor soft-caps then scales; "
                 "the top-k candidates agree, the selector's unary term differs")
    if errors:
        return errors, warnings

    header = _header(d / "model.safetensors")
    want = expected_shapes(cfg)
    stray = sorted(set(header) - set(want))
    head = [k for k in stray if "lm_head" in k or "embed_tokens" in k or k in ("d2t", "t2d")]
    if head:
        warn("lm_head", VLLM_DFLASH, f"the export carries {', '.join(head)}: the engines use the target's own "
             "embedding and LM head; a replaced (e.g. reduced-vocabulary) draft head is reported to collapse "
             "acceptance")
    stray = [k for k in stray if k not in head]
    missing = sorted(set(want) - set(header))
    if missing or stray:
        err("weights", ZLAB_MODEL, f"weight names differ from what the loaders read: missing {missing[:6]}"
            f"{' ...' if len(missing) > 6 else ''}, unexpected {stray[:6]}{' ...' if len(stray) > 6 else ''}")
    bad = [f"{k} {tuple(header[k]['shape'])} (want {want[k]})" for k in sorted(set(want) & set(header))
           if tuple(header[k]["shape"]) != want[k]]
    if bad:
        err("weights", VLLM_DFLASH, f"weight shapes differ from the config's: {'; '.join(bad[:4])}")
    dtypes = {header[k]["dtype"] for k in header if k not in head}
    declared = cfg.get("dtype") or cfg.get("torch_dtype")
    if not dtypes <= set(FLOAT_DTYPES) or len(dtypes) > 1:
        err("dtype", VLLM_DFLASH, f"tensors of dtypes {sorted(dtypes)}; one of {sorted(FLOAT_DTYPES.values())} for "
            "all is required (vLLM casts the draft to one model dtype)")
    elif declared is not None and FLOAT_DTYPES[next(iter(dtypes))] != declared:
        err("dtype", VLLM_DFLASH, f"config.json says dtype {declared} but the tensors are "
            f"{FLOAT_DTYPES[next(iter(dtypes))]}")
    warn("llama.cpp", "llama.cpp", "llama.cpp has no DFlash loader checked here; the same drafter is reported "
         "far below vLLM's acceptance there: measure before serving with it")
    return errors, warnings
