"""One-call GPU measurement of dflash: ceilings, feature extraction, drafter step, end to end, hybrid fast path.

Usage (on the GPU machine):  python bench/gpu_bench.py --sections all --out DIR
Validate on a CPU first:      python bench/gpu_bench.py --tiny --sections features,drafter,e2e
Each section appends to DIR/results.json; a summary table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lib import record as record_section  # noqa: E402

QWEN3_8B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 40960, "rope_theta": 1000000.0}
QWEN36_27B = {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
              "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
              "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
              "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16}
TINY_DENSE = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
TINY_HYBRID = {"model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
               "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
               "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2}

RESULTS: dict = {}
OUT: Path = Path(".")


class _BlockKernels(importlib.abc.MetaPathFinder):
    """DFLASH_BENCH_NO_KERNELS=1: behave as if flash-linear-attention / causal-conv1d were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"fla", "causal_conv1d"}:
            raise ModuleNotFoundError(f"blocked for the benchmark: {name}")
        return None


if os.environ.get("DFLASH_BENCH_NO_KERNELS") == "1":
    sys.meta_path.insert(0, _BlockKernels())


def record(section: str, data: dict) -> None:
    RESULTS[section] = data
    record_section(OUT / "results.json", section, data)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, warmup=2, iters=5) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def peak_mem_gib(fn) -> float:
    """Peak memory of the whole process during `fn` (weights, gradients, optimizer state, activations:
    `max_memory_allocated`, the basis other trainers report), in GiB."""
    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return torch.cuda.max_memory_allocated() / 2**30


def resident_gib() -> float:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build(spec: dict, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    from dflash.models.target import target_config

    cfg = target_config(None, spec)
    torch.manual_seed(0)
    with torch.device(device()):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------- sections
def sec_ceilings(args):
    if not torch.cuda.is_available():
        return record("ceilings", {"skipped": "no GPU"})
    n = 8192
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda: a @ b, 3, 10)
    x = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    tc = timed(lambda: y.copy_(x), 3, 10)
    record("ceilings", {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "bf16_matmul_tflops": 2 * n**3 / t / 1e12, "copy_tb_s": 2 * x.numel() * 2 / tc / 1e12})


def sec_features(args):
    from dflash.config import default_layer_ids
    from dflash.models.target import Target

    spec = TINY_DENSE if args.tiny else QWEN3_8B
    model = build(spec)
    L = spec["num_hidden_layers"]
    ids_tap = default_layer_ids(L, 5)
    batch, seq = (2, 64) if args.tiny else (args.feat_batch, 3072)
    ids = torch.randint(0, spec["vocab_size"], (batch, seq), device=device())
    mask = torch.ones_like(ids)

    def plain():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, output_hidden_states=True)

    ref = plain()
    ref_feats = torch.cat([ref.hidden_states[i + 1] for i in ids_tap], -1)
    del ref
    t_plain = timed(plain, 1, 3 if not args.tiny else 2)
    m_plain = peak_mem_gib(plain)
    target = Target(model, ids_tap)

    def hooks():
        return target.features(ids, mask)

    feats = hooks()
    rel = float((feats.float() - ref_feats.float()).norm() / ref_feats.float().norm())
    del feats, ref_feats
    t_hooks = timed(hooks, 1, 3 if not args.tiny else 2)
    m_hooks = peak_mem_gib(hooks)
    toks = batch * seq
    out = {"model": "Qwen3-8B-shaped" if not args.tiny else "tiny", "batch": batch, "seq": seq,
           "tapped": ids_tap, "plain_tok_s": toks / t_plain, "hooks_tok_s": toks / t_hooks,
           "speedup": t_plain / t_hooks, "plain_peak_gib": m_plain, "hooks_peak_gib": m_hooks,
           "rel_err_vs_hidden_states": rel, "compiled": {}}
    # A trainer batch is right-padded to its bucket: rows of different lengths. With that mask SDPA cannot
    # take its causal fast path; without one (causal, right padding) the valid positions are the same.
    lengths = [seq - (r * seq) // 16 for r in range(batch)]
    padded = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        padded[r, :n] = 1
    valid = padded.bool()
    eager_padded = target.features(ids, padded)
    t_hooks_padded = timed(lambda: target.features(ids, padded), 1, 3 if not args.tiny else 2)
    out |= {"row_lengths": lengths, "hooks_padded_mask_tok_s": toks / t_hooks_padded}
    eager = hooks()

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    nomask = target.features(ids, None)
    out["nomask_rel_err_on_valid_positions"] = rel(nomask[valid], eager_padded[valid])
    record("features", out)
    # the trainer's compiled target (compile.target): each decoder layer compiled, hooks eager
    from dflash.compile import compile_target_layers

    for mode in [m for m in args.target_modes.split(",") if m]:
        target.__dict__.pop("features", None)  # back to the eager method before the next mode
        torch._dynamo.reset()
        guard = compile_target_layers(target, mode)
        row = {}
        for name, m in (("ones", mask), ("padded", padded), ("none", None)):
            t0 = time.perf_counter()
            feats = target.features(ids, m)
            sync()
            first = time.perf_counter() - t0
            t_c = timed(lambda m=m: target.features(ids, m), 1, 3 if not args.tiny else 2)
            ref, sel = (eager, slice(None)) if name == "ones" else (eager_padded, valid)
            row[name] = {"first_call_s": first, "tok_s": toks / t_c, "speedup_vs_plain": t_plain / t_c,
                         "speedup_vs_eager_hooks_same_mask": (t_hooks if name == "ones" else t_hooks_padded) / t_c,
                         "rel_err_vs_eager": rel(feats[sel], ref[sel]),
                         "max_abs_err_vs_eager": float((feats[sel].float() - ref[sel].float()).abs().max())}
            del feats
        row |= {"fell_back": guard.failed, "peak_gib": peak_mem_gib(lambda: target.features(ids, None))}
        out["compiled"][mode] = row
        print(f"  target compiled ({mode}): {row}", flush=True)
        record("features", out)
    target.__dict__.pop("features", None)


def _drafter_setup(args):
    from dflash.components.loss import build_blocks, sample_anchors
    from dflash.models.drafter import Drafter, arch_from_target
    from dflash.models.target import target_config

    tcfg = target_config(None, TINY_DENSE if args.tiny else QWEN3_8B)
    seq, anchors_n, bsz, layers = (64, 8, 4, 2) if args.tiny else (3072, 512, 16, 5)
    arch = arch_from_target(tcfg, num_layers=layers, block_size=bsz, layer_ids=[1, 9, 17, 25, 33][: 5],
                            mask_token_id=0, vocab_size=tcfg.vocab_size)
    dev = device()
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    drafter = Drafter(arch).to(dev)
    embed = torch.nn.Embedding(tcfg.vocab_size, arch.hidden_size, device=dev, dtype=dt).requires_grad_(False)
    head = (torch.randn(tcfg.vocab_size, arch.hidden_size, device=dev, dtype=dt) * 0.02)
    feats = torch.randn(1, seq, len(arch.target_layer_ids) * arch.hidden_size, device=dev, dtype=dt)
    ids = torch.randint(0, tcfg.vocab_size, (1, seq), device=dev)
    loss_mask = torch.zeros(1, seq, dtype=torch.bool)
    loss_mask[:, seq // 8:] = True  # a prompt then a long response
    lengths = torch.tensor([seq])
    anchors, valid = sample_anchors(loss_mask, lengths, anchors_n, torch.Generator().manual_seed(0))
    # built on the host and moved with their loss rows, as the trainer does (no device sync for the rows)
    blocks = build_blocks(ids.cpu(), loss_mask, lengths, anchors, valid, bsz, 0).to(dev)
    return arch, drafter, embed, head, feats, blocks, seq


# kernel name -> category of the profile breakdown (first match wins)
KERNEL_CATEGORIES = [
    ("flex attention", ("flex_attention", "flex_decoding", "triton_tem_fused", "flashattention", "flash_attn",
                        "flash_fwd", "flash_bwd")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "norm_kernel", "l2norm")),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul", "sm80_xmma", "wgmma")),
    ("fused elementwise (inductor)", ("triton_poi", "triton_per", "triton_red")),
    ("copy / cast", ("copy", "cast", "memcpy", "memset", "fill")),
    ("softmax / loss", ("softmax", "log_softmax", "nll", "cross_entropy", "logsumexp")),
    ("reduction", ("reduce",)),
    ("elementwise (eager)", ("elementwise", "vectorized", "unrolled")),
]


def kernel_breakdown(fn, steps=2) -> dict:
    """CUDA kernel time of `fn` per category and the top kernels (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync()
    cats: dict[str, float] = {}
    kernels = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if not t or ev.key.startswith("ProfilerStep"):
            continue
        low = ev.key.lower()
        if low.startswith(("aten::", "autograd", "torch", "optimizer", "compiledfunction", "## ")):
            continue  # CPU-side ranges that wrap kernels: counted through their kernels
        cat = next((c for c, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "other")
        cats[cat] = cats.get(cat, 0.0) + t / 1e3 / steps
        kernels.append((t / 1e3 / steps, ev.count // steps, ev.key[:90]))
    kernels.sort(reverse=True)
    total = sum(cats.values())
    return {"gpu_ms_per_step": total,
            "categories_ms": {k: round(v, 2) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"ms": round(t, 3), "calls": n, "name": k} for t, n, k in kernels[:15]]}


def sec_compile(args):
    """Cold compile cost of each compiled piece at the drafter's training shape, in the order a fresh process
    meets them (run it first, on an empty inductor cache, to see what a first start pays)."""
    from dflash.compile import CompilePlan, configure
    from dflash.components.loss import ce_rows_kernel
    from dflash.models.attention import compiled_flex_attention, flex_block_mask

    arch, _drafter, _embed, _head, _feats, blocks, seq = _drafter_setup(args)
    dev = device()
    out = {"inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default (/tmp/torchinductor_$USER)")}

    def first_and_next(fn):
        t0 = time.perf_counter()
        fn()
        sync()
        t1 = time.perf_counter()
        fn()
        sync()
        return round(t1 - t0, 2), round(time.perf_counter() - t1, 4)

    m = blocks.anchors.shape[1]
    out["block_mask_first_s"], out["block_mask_next_s"] = first_and_next(
        lambda: flex_block_mask(blocks.anchors, seq, arch.block_size))
    mask = flex_block_mask(blocks.anchors, seq, arch.block_size)
    hq, hkv, d = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    q = torch.randn(1, hq, m * arch.block_size, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, hkv, seq + m * arch.block_size, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    flex = compiled_flex_attention()
    out["flex_forward_first_s"], out["flex_forward_next_s"] = first_and_next(
        lambda: flex(q, k, v, block_mask=mask, enable_gqa=True))
    out["flex_backward_first_s"], out["flex_backward_next_s"] = first_and_next(
        lambda: flex(q, k, v, block_mask=mask, enable_gqa=True).sum().backward())
    n = int(blocks.label_valid.sum())
    logits = torch.randn(min(n, 4096), arch.vocab_size, device=dev, dtype=torch.bfloat16)
    labels = torch.randint(0, arch.vocab_size, (logits.shape[0],), device=dev)
    w = torch.rand(logits.shape[0], device=dev)
    configure(CompilePlan(loss=True, flex=True))
    ce = ce_rows_kernel(dev)
    out["ce_rows_first_s"], out["ce_rows_next_s"] = first_and_next(lambda: ce(logits, labels, w))
    out["ce_rows_other_length_s"], _ = first_and_next(lambda: ce(logits[:1000], labels[:1000], w[:1000]))
    record("compile", out)


def sec_drafter(args):
    import copy

    from dflash.compile import CompilePlan, configure
    from dflash.components.flops import drafter_step_flops
    from dflash.components.loss import weighted_block_loss
    from dflash.models.attention import FLASH_OPTIONS, compiled_flex_attention, flex_options_for

    arch, drafter, embed, head, feats, blocks, seq = _drafter_setup(args)
    dev = device()
    flops = drafter_step_flops(arch, seq, blocks.anchors, blocks.anchor_valid, int(blocks.label_valid.sum()))
    peak = (args.peak_tflops or RESULTS.get("ceilings", {}).get("bf16_matmul_tflops") or 790.0) * 1e12
    out = {"shape": {"hidden": arch.hidden_size, "layers": arch.num_hidden_layers, "block": arch.block_size,
                     "anchors": int(blocks.anchor_valid.sum()), "seq": seq, "vocab": arch.vocab_size},
           "flops_per_step": flops.training, "flops_detail": flops.__dict__, "variants": {}}
    full_logits_gib = blocks.label_valid.numel() * arch.vocab_size * 4 / 2**30
    out["full_vocab_logits_fp32_gib"] = full_logits_gib
    # (name, attention, compilation: None | "forward" (whole drafter.forward, as drafter.compile does) |
    # "layers" (each layer; mask, RoPE and fc eager), loss implementation). Every "fusedce" variant runs the
    # loss's per-chunk softmax compiled (`dflash.components.loss.ce_rows`); "+eagerce" runs it eagerly (the baseline).
    # "autotune" compiles the forward with mode="max-autotune-no-cudagraphs" (compile.drafter_mode): inductor
    # then autotunes the GEMM epilogues and flex attention's forward and backward tiles.
    variants = [("sdpa-dense", "sdpa", None, "checkpoint"), ("flex", "flex", None, "checkpoint"),
                ("flex+compile", "flex", "forward", "checkpoint"), ("flex+fusedce", "flex", None, "fused"),
                ("flex+compile+fusedce", "flex", "forward", "fused"),
                ("flex+compile+fusedce+eagerce", "flex", "forward", "fused"),
                ("flex+layercompile+fusedce", "flex", "layers", "fused"),
                ("flex+autotune+fusedce", "flex", "autotune", "fused"),
                ("flex+compile+fusedce+tiles", "flex", "forward", "fused"),
                # "+graph": the whole step (forward, loss, backward, AdamW) captured once in a CUDA graph and
                # replayed: no launch gaps and no host work per step (static shapes; capturable AdamW)
                ("flex+compile+fusedce+tiles+graph", "flex", "forward", "fused"),
                # "+fp8" / "+fp8row": the drafter's linear layers (attention, MLP, fc) in float8 through torchao's
                # Float8Linear (dynamic tensorwise / rowwise scaling; bf16 master weights and everything else
                # unchanged; the frozen LM head stays bf16)
                ("flex+compile+fusedce+tiles+fp8", "flex", "forward", "fused"),
                ("flex+compile+fusedce+tiles+fp8row", "flex", "forward", "fused"),
                ("flex+compile+fusedce+tiles+fp8+graph", "flex", "forward", "fused"),
                # "+fp8skip": float8 except the layers named by --fp8-skip (name suffixes)
                ("flex+compile+fusedce+tiles+fp8skip", "flex", "forward", "fused"),
                ("flex+compile+fusedce+tiles+fp8skip+graph", "flex", "forward", "fused"),
                # "+flash": flex_attention on FlashAttention-4's kernels (compile.flex_backend, flash-attn-4)
                ("flex+compile+fusedce+flash", "flex", "forward", "fused"),
                ("flex+compile+fusedce+flash+graph", "flex", "forward", "fused"),
                ("flex+compile+fusedce+flash+fp8", "flex", "forward", "fused"),
                ("flex+compile+fusedce+flash+fp8+graph", "flex", "forward", "fused")]
    if dev.type != "cuda":
        variants = [("sdpa-dense", "sdpa", None, "checkpoint"), ("sdpa-dense+fusedce", "sdpa", None, "fused")]
    grads = {}
    initial = {k: v.clone() for k, v in drafter.state_dict().items()}
    by_name = {v[0]: v for v in variants}  # in the order asked: a later variant may run on a hotter GPU
    wanted = [by_name[n] for n in args.drafter_variants.split(",") if n in by_name]

    def flags(name):
        tokens = set(name.split("+"))
        fp8 = ("rowwise" if "fp8row" in tokens else "tensorwise" if tokens & {"fp8", "fp8skip"} else None)
        skip = tuple(x for x in args.fp8_skip.split(",") if x) if "fp8skip" in tokens else ()
        return {"tiles": "tiles" in tokens, "flash": "flash" in tokens, "graph": "graph" in tokens, "fp8": fp8, "fp8_skip": skip,
                "eager_ce": "eagerce" in tokens}

    def prepare(compile_mode, fresh=False, fp8=None, fp8_skip=()):
        """A drafter at the initial weights, compiled as asked, and its forward. `fresh`: a copy whose
        parameters no earlier step touched. A graph capture needs it: autograd keeps a parameter's gradient
        accumulator alive while any earlier step's graph is (a `loss` still held), with the stream that step
        ran on; a backward captured on a side stream then waits on the legacy default stream and the capture
        fails with cudaErrorStreamCaptureImplicit (pytorch/pytorch#164302). A copy's parameters have no
        accumulator yet, whatever earlier losses are still held."""
        model = copy.deepcopy(drafter) if compile_mode == "layers" or fresh or fp8 else drafter
        model.load_state_dict(initial)
        if fp8:  # dflash.components.float8, as drafter.float8 converts ("tensorwise", no skip) or a variant of it
            from dflash.components.float8 import convert_linears

            convert_linears(model, fp8, fp8_skip)
        if compile_mode == "layers":
            for layer in model.layers:
                layer.compile()
        if compile_mode == "autotune":
            return model, torch.compile(model.forward, mode="max-autotune-no-cudagraphs")
        return model, (torch.compile(model.forward) if compile_mode == "forward" else model.forward)

    def step_fn(model, fwd, kind, impl, opt=None, eager_ce=False, tiles=False, graph=False, flash=False):
        # "+tiles": flex_attention with --flex-options (JSON kernel_options, default: dflash's tuned choice)
        options = (json.loads(args.flex_options) if args.flex_options else
                   flex_options_for(None, dev, arch.head_dim)) if tiles else {}
        if flash:
            options = dict(FLASH_OPTIONS)
        flex = compiled_flex_attention("default", options) if (kind == "flex" and dev.type == "cuda") else None

        def step(zero=True):
            configure(CompilePlan(loss=not eager_ce, flex=True))
            if zero:
                model.zero_grad(set_to_none=True)
            # (a captured region must not reuse autocast's cached casts: torch.cuda.graph's documentation)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda", cache_enabled=not graph):
                hidden = fwd(feats, blocks.block_ids, blocks.anchors, embed, kind, flex)
                loss, _ = weighted_block_loss(hidden, head, blocks, 7.0, 4096, impl)
            loss.backward()
            if opt is not None:
                opt.step()
            return loss
        return step

    def graphed(step, model):
        """`step` captured whole in a CUDA graph (after warm-up steps on a side stream, as torch's docs do for
        whole-network capture); the returned function replays it and gives the loss of that replay."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        model.zero_grad(set_to_none=True)  # the graph allocates the gradients in its pool; each replay rewrites them
        with torch.cuda.graph(graph):
            loss = step(zero=False)

        def replay():
            graph.replay()
            return loss
        return replay

    for name, kind, compile_mode, impl in wanted:  # gradients of every variant at the same weights first
        f = flags(name)
        model, fwd = prepare(compile_mode, fp8=f["fp8"], fp8_skip=f["fp8_skip"])
        t0 = time.perf_counter()
        loss = step_fn(model, fwd, kind, impl, eager_ce=f["eager_ce"], tiles=f["tiles"],
                       flash=f["flash"])()
        sync()
        first = time.perf_counter() - t0
        grads[name] = torch.cat([p.grad.flatten().float() for p in model.parameters()])
        out["variants"][name] = {"loss_at_init": float(loss.detach()), "first_step_s": first}
        print(f"  {name}: loss {float(loss):.6f}, first step (compilation included) {first:.1f}s", flush=True)
        del model, fwd
    for name, kind, compile_mode, impl in wanted if args.drafter_timing else []:
        try:
            f = flags(name)
            graph = f["graph"]
            model, fwd = prepare(compile_mode, fresh=graph, fp8=f["fp8"], fp8_skip=f["fp8_skip"])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda", capturable=graph)
            step = step_fn(model, fwd, kind, impl, opt, eager_ce=f["eager_ce"], tiles=f["tiles"], graph=graph,
                           flash=f["flash"])
            if args.loss_trace and not graph:  # training steps from the initial weights: numerics compared
                out["variants"][name]["loss_trace"] = [float(step().detach()) for _ in range(args.loss_trace)]
                trace = " ".join(f"{x:.4f}" for x in out["variants"][name]["loss_trace"])
                print(f"  {name}: losses {trace}", flush=True)
            if graph:
                eager_step = step
                step = graphed(step, model)
                weights = [p.detach().clone() for p in model.parameters()]
                replayed = float(step().detach())  # the loss at `weights`, from the graph
                with torch.no_grad():
                    for p, w0 in zip(model.parameters(), weights, strict=True):
                        p.copy_(w0)  # in place: the graph reads the same addresses
                eager = float(eager_step().detach())  # the same weights, eagerly
                out["variants"][name]["graph_loss_vs_eager"] = [replayed, eager]
                print(f"  {name}: loss from the graph {replayed:.6f}, eagerly {eager:.6f}", flush=True)
                del weights
            loss = step()
            t = timed(step, 2, 5)
            resident = resident_gib()  # weights, gradients and optimizer state after a step
            mem = peak_mem_gib(step)
            out["variants"][name] |= {"step_s": t, "tokens_per_s": seq / t,
                                     "blocks_per_s": int(blocks.anchor_valid.sum()) / t,
                                     "tflops": flops.training / t / 1e12, "mfu": flops.training / t / peak,
                                     "peak_gib": mem, "resident_gib": resident,
                                     "peak_above_resident_gib": mem - resident, "loss": float(loss.detach())}
            if dev.type == "cuda" and name in args.profile.split(","):
                out["variants"][name]["profile"] = kernel_breakdown(step)
            del opt, model, fwd, step
            record("drafter", out)  # after every variant: a run cut short keeps what it measured
        except Exception as exc:  # keep the other variants
            out["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            traceback.print_exc()
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    first_name = next(iter(grads), None)
    for name, g in grads.items():  # the gradient at the initial weights against the first variant asked
        if name != first_name:
            out["variants"][name]["grad_rel_err_vs_first"] = float((g - grads[first_name]).norm()
                                                                   / grads[first_name].norm())
    if "sdpa-dense" in grads:
        for name, g in grads.items():
            if name != "sdpa-dense":
                out["variants"][name]["grad_rel_err_vs_dense"] = float((g - grads["sdpa-dense"]).norm() / grads["sdpa-dense"].norm())
    record("drafter", out)


def sec_e2e(args):
    """Colocated training on one GPU through the real Trainer, sweeping the token budget."""
    from dflash.config import RunConfig, _build, validate
    from dflash.training.trainer import Trainer

    budgets = [128, 256] if args.tiny else [int(b) for b in args.budgets.split(",")]
    spec = TINY_DENSE if args.tiny else QWEN3_8B
    out = {"runs": []}
    for budget in budgets:
        cfg = {
            "output_dir": str(OUT / f"e2e-{budget}"), "seed": 0,
            "target": {"random_init": spec, "dtype": "bfloat16" if torch.cuda.is_available() else "float32",
                       "layer_ids": [1, 3, 5] if args.tiny else None},
            "tokenizer": {"synthetic_vocab_size": 400},
            "drafter": {"num_layers": 2 if args.tiny else 5, "block_size": 4 if args.tiny else 16,
                        "num_anchors": 8 if args.tiny else 512},
            "data": {"synthetic": {"num_samples": 40 if args.tiny else 64, "min_length": 20 if args.tiny else 1400,
                                   "max_length": 40 if args.tiny else 1500, "strides": [1, 2, 3]},
                     "max_length": 128 if args.tiny else 3072, "token_budget": budget, "bucket_size": 64 if args.tiny else 512,
                     "min_loss_tokens": 4, "eval_fraction": 0.0},
            "optim": {"max_steps": 4 if args.tiny else args.e2e_steps, "warmup_ratio": 0.0},
            "checkpoint": {"interval": 100000, "keep_last": 1, "resume": False},
            "logging": {"interval": 2 if args.tiny else 5},
            "runtime": {"device": "auto"},
        }
        try:
            config = _build(RunConfig, cfg, "")
            validate(config)
            tr = Trainer(config).setup()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            rows: list[int] = []  # sequences of each micro-batch, counted as the trainer fetches them
            fetch = tr.source.next

            def counted(fetch=fetch, rows=rows):
                epoch, batch, features = fetch()
                rows.append(int(batch.input_ids.shape[0]))
                return epoch, batch, features

            tr.source.next = counted
            tr.train_step()  # warm-up (compile, allocator)
            sync()
            rows.clear()
            n = config.optim.max_steps - 1
            tokens = blocks = 0
            flops = 0.0
            t_feat = t_draft = 0.0
            t0 = time.perf_counter()
            for _ in range(n):
                _, res = tr.train_step()
                tokens += res.tokens
                blocks += int(res.stats.num_blocks)
                flops += tr.step_flops
            sync()
            wall = time.perf_counter() - t0
            # the parts, timed separately on one batch: target features alone, drafter step alone
            _, batch, feats = fetch()
            t_feat = timed(lambda: tr.source.features(batch), 1, 3)
            gen = torch.Generator().manual_seed(0)

            def dstep():  # forward, loss, backward and optimizer step, as in `Trainer.train_step`
                tr.optimizer.zero_grad(set_to_none=True)
                loss, _ = tr.drafter_loss(feats, batch, gen)
                (loss * tr.last_weight).backward()
                tr.optimizer_step(1.0 / max(tr.last_weight, 1e-12))

            t_draft = timed(dstep, 1, 3)
            per_step = wall / n
            out["runs"].append({"token_budget": budget, "steps": n, "step_s": per_step,
                                "target_tokens_per_s": tokens / wall, "anchor_blocks_per_s": blocks / wall,
                                "sequences_per_s": sum(rows) / wall,
                                "parts_step_s": t_feat + t_draft, "features_s": t_feat, "drafter_s": t_draft,
                                "overlap_loss": per_step / (t_feat + t_draft),
                                "drafter_tflops": flops / wall / 1e12,
                                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0})
            tr = None  # free the models before the next budget
        except torch.cuda.OutOfMemoryError as exc:
            out["runs"].append({"token_budget": budget, "error": f"OOM: {str(exc)[:200]}"})
        except Exception as exc:
            out["runs"].append({"token_budget": budget, "error": f"{type(exc).__name__}: {exc}"[:400]})
            traceback.print_exc()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    record("e2e", out)


def sec_hybrid_one(args):
    """Feature extraction on the hybrid target in this process (kernels as this process sees them)."""
    from dflash.config import default_layer_ids
    from dflash.models.target import Target

    spec = TINY_HYBRID if args.tiny else QWEN36_27B
    t_build = time.perf_counter()
    model = build(spec)
    t_build = time.perf_counter() - t_build
    L = spec["num_hidden_layers"]
    target = Target(model, default_layer_ids(L, 5))
    report = target.fast_path_report()
    batch, seq = (1, 64) if args.tiny else (args.hybrid_batch, 4096)
    compiled = None
    if os.environ.get("DFLASH_BENCH_COMPILE_TARGET") == "1":  # the trainer's default on CUDA (compile.target)
        from dflash.compile import compile_target_layers

        compiled = compile_target_layers(target, "default")
    ids = torch.randint(0, spec["vocab_size"], (batch, seq), device=device())
    t_first = time.perf_counter()
    feats = target.features(ids).float()
    t_first = time.perf_counter() - t_first
    t = timed(lambda: target.features(ids), 1, 2)
    params = sum(p.numel() for p in model.parameters())
    sample = feats[0, :64, :4096].cpu()
    torch.save(sample, OUT / f"hybrid-feats-{args.label}.pt")
    print(json.dumps({"label": args.label, "params_b": params / 1e9, "build_s": t_build, "tokens_per_s": batch * seq / t,
                      "first_call_s": t_first, "compiled": compiled is not None,
                      "compile_fallback": compiled.failed if compiled is not None else None,
                      "report": report.describe(), "fast": report.fast, "kernels_seen": report.kernels_seen}))


def sec_hybrid(args):
    """Slow path vs fast path, each in its own process (transformers binds kernels at import)."""
    out = {}
    paths = {"slow": {"DFLASH_BENCH_NO_KERNELS": "1"}, "fast": {},
             "slowcompiled": {"DFLASH_BENCH_NO_KERNELS": "1", "DFLASH_BENCH_COMPILE_TARGET": "1"},
             "fastcompiled": {"DFLASH_BENCH_COMPILE_TARGET": "1"}}
    for label in args.hybrid_paths.split(","):
        env = paths[label]
        cmd = [sys.executable, __file__, "--sections", "hybrid_one", "--out", str(OUT), "--label", label]
        if args.tiny:
            cmd.append("--tiny")
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=900)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        out[label] = json.loads(lines[-1]) if lines else {"error": (r.stderr or r.stdout)[-800:]}
        print(f"  hybrid {label}: {json.dumps(out[label])[:600]}", flush=True)
        record("hybrid", out)  # each path as it finishes: a call that runs out of time keeps what it measured
        for check in ("doctor", "refuse") if args.hybrid_checks and label in ("slow", "fast") else ():
            r = subprocess.run([sys.executable, __file__, "--sections", check, "--out", str(OUT)], capture_output=True,
                               text=True, env={**os.environ, **env}, cwd=ROOT, timeout=600)
            text = (r.stdout + r.stderr).strip().splitlines()
            out[label][f"{check}_exit"] = r.returncode
            out[label][check] = [ln for ln in text if "fast path" in ln or "error" in ln][-2:] or text[-2:]
    try:
        a = torch.load(OUT / "hybrid-feats-slow.pt")
        b = torch.load(OUT / "hybrid-feats-fast.pt")
        out["rel_err_fast_vs_slow"] = float((a - b).norm() / a.norm())
    except Exception as exc:
        out["rel_err_fast_vs_slow"] = str(exc)
    for label in [k for k in out if k in paths]:
        if label != "slow" and "tokens_per_s" in out.get("slow", {}) and "tokens_per_s" in out[label]:
            out[f"speedup_{label}_vs_slow"] = out[label]["tokens_per_s"] / out["slow"]["tokens_per_s"]
    record("hybrid", out)


def sec_doctor(args):
    from dflash.cli import main as cli

    sys.exit(cli(["doctor", "--require-fast-path"]))


def sec_refuse(args):
    """`dflash train` on CUDA with a hybrid target: exit 2 on the slow path unless allowed."""
    import yaml

    from dflash.cli import main as cli

    cfg = yaml.safe_load((ROOT / "configs" / "tiny-cpu.yaml").read_text())
    cfg["target"]["random_init"] = dict(TINY_HYBRID, vocab_size=96)
    cfg["target"]["layer_ids"] = [1, 3, 5]
    cfg["runtime"]["device"] = "auto"
    cfg["output_dir"] = str(OUT / "refuse")
    cfg["optim"]["max_steps"] = 3
    path = OUT / "refuse.yaml"
    path.write_text(yaml.safe_dump(cfg))
    sys.exit(cli(["train", str(path)]))


SECTIONS = {"compile": sec_compile, "doctor": sec_doctor, "refuse": sec_refuse, "ceilings": sec_ceilings, "features": sec_features, "drafter": sec_drafter, "e2e": sec_e2e,
            "hybrid": sec_hybrid, "hybrid_one": sec_hybrid_one}


def main() -> int:
    global OUT
    p = argparse.ArgumentParser()
    p.add_argument("--sections", default="ceilings,features,drafter,hybrid,e2e")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU validation of the script)")
    p.add_argument("--label", default="")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--feat-batch", type=int, default=4)
    p.add_argument("--target-modes", default="max-autotune-no-cudagraphs,default",
                   help="torch.compile modes of the compiled-target rows of the features section ('' = none)")
    p.add_argument("--hybrid-batch", type=int, default=2)
    p.add_argument("--hybrid-paths", default="slow,fast,fastcompiled",
                   help="of slow, fast, slowcompiled, fastcompiled (compiled: the target's layers, compile.target)")
    p.add_argument("--hybrid-checks", action="store_true", help="also run doctor and the train refusal per path")
    p.add_argument("--budgets", default="3072,6144,12288,24576")
    p.add_argument("--e2e-steps", type=int, default=12)
    p.add_argument("--drafter-variants", default="sdpa-dense,flex,flex+compile,flex+fusedce,flex+compile+fusedce,"
                   "flex+layercompile+fusedce,sdpa-dense+fusedce")
    p.add_argument("--flex-options", default="", help="JSON kernel_options of the drafter's '+tiles' variant")
    p.add_argument("--profile", default="", help="drafter variants to profile by kernel category (CUDA)")
    p.add_argument("--no-drafter-timing", dest="drafter_timing", action="store_false")
    p.add_argument("--fp8-skip", default="k_proj,v_proj,fc",
                   help="the '+fp8skip' variants keep these layers (name suffixes) in bf16")
    p.add_argument("--loss-trace", type=int, default=0,
                   help="drafter: record this many training steps' losses of each variant (graph variants: none)")
    args = p.parse_args()
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    names = list(SECTIONS) if args.sections == "all" else args.sections.split(",")
    for name in names:
        if name in ("hybrid_one", "doctor", "refuse"):
            SECTIONS[name](args)
            continue
        t0 = time.perf_counter()
        try:
            SECTIONS[name](args)
        except Exception as exc:
            traceback.print_exc()
            record(name, {"error": f"{type(exc).__name__}: {exc}"[:500]})
        print(f"== {name} took {time.perf_counter() - t0:.0f}s", flush=True)
    if names[0] not in ("hybrid_one", "doctor", "refuse"):
        print(json.dumps(RESULTS, indent=1)[-6000:])
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
