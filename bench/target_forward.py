"""Where the target's feature forward spends its time, whether FlashAttention-4 would make its attention
faster, and the GEMM shapes of the next levers, on one GPU. Run from the repository root on the GPU machine
(flash-attn-4 importable for the FlashAttention-4 row):

    python3 bench/target_forward.py [--batch 4] [--length 3072] [--out DIR]

Sections (one JSON line each, also collected in DIR/target_forward.json):
* attention: one layer's causal attention alone at the Qwen3-8B head layout (32 query heads, 8 KV heads, 128),
  SDPA as transformers calls it (the baseline), SDPA forced to cuDNN, FlashAttention-4; ms, TFLOP/s,
  relative difference to SDPA.
* features: the whole feature forward of the Qwen3-8B-shaped random target (taps [1, 9, 17, 25, 33], compiled
  decoder layers as the trainer compiles them): ms, tokens/s, the kernel time by class and the top kernels.
* features_float8: the same forward with `target.float8` beside its bf16 one in the same process: ms each,
  the speed-up, each tap's relative difference to bf16, the float8 forward's kernel time by class.
* gemms: the projections of one target layer apart and fused (q/k/v, gate/up), and the drafter loss's LM head
  (rows x 4096 x 151936, forward and the rows' gradient) in bf16 and float8 (rowwise scales).
* gemm_sites: why the feature forward's GEMMs run slower than the same GEMMs alone. Each GEMM shape of the
  compiled forward (from the profiler's input shapes) with its device time and TFLOP/s in place, beside the
  same shape alone, timed one call at a time (a sync after each, as `gemms` times) and back to back (100 calls,
  one sync); the GPU's SM clock, power and throttle reasons sampled (nvidia-smi) during each; all of it again
  with cuBLASLt as torch's preferred BLAS library.
Timings are medians of CUDA-event-timed repetitions after warm-up.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from flex_tiles import median_ms  # noqa: E402
from gpu_power import GpuSampler  # noqa: E402

from bench.lib import record as record_section  # noqa: E402

QWEN3_8B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 4096}
RESULTS: dict = {}


def record(out: Path, name: str, data: dict) -> None:
    record_section(out / "target_forward.json", name, data, RESULTS)


def cuda_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    return median_ms(fn, warmup, iters)  # CUDA-event timed, as bench/flex_tiles.py times its kernels


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def kernel_classes(fn) -> dict:
    """CUDA kernel time of one call of `fn` by class (ms), and its ten longest kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    # first match wins: inductor's kernels carry the names of the ops they fused (an "sdpa" among them), and
    # attention kernels the names of their instructions ("wgmma", "cutlass")
    classes = {"fused elementwise": ("triton_",),
               "attention": ("flash", "fmha", "fprop", "sdpa", "attention"),
               "gemm": ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "wgmma")}
    totals: dict[str, float] = {}
    rows = []
    for evt in prof.key_averages():
        ms = evt.device_time_total / 1e3
        if ms <= 0:
            continue
        name = evt.key.lower()
        kind = next((k for k, words in classes.items() if any(w in name for w in words)), "other")
        totals[kind] = totals.get(kind, 0.0) + ms
        rows.append((ms, evt.key[:90]))
    rows.sort(reverse=True)
    return {"ms_by_class": {k: round(v, 2) for k, v in totals.items()},
            "top": [(round(ms, 2), name) for ms, name in rows[:10]]}


def flash_causal(q, k, v):
    """FlashAttention-4's causal attention: (B, L, H, D) in and out."""
    from flash_attn.cute import flash_attn_func

    got = flash_attn_func(q, k, v, causal=True)
    return got[0] if isinstance(got, tuple) else got


def sec_attention(args, out: Path) -> None:
    b, n, h, hkv, d = args.batch, args.length, 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, x, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for x in (h, hkv, hkv))
    flops = 4 * b * h * n * n * d / 2  # causal: half the score matrix
    runs = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "flash4": lambda: flash_causal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2),
    }

    def cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kk, vv = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)

    runs["sdpa_cudnn_with_kv_copy"] = cudnn
    base = runs["sdpa"]()
    data = {"shape": {"batch": b, "length": n, "heads": h, "kv_heads": hkv, "head_dim": d}}
    for name, fn in runs.items():
        try:
            ms = cuda_ms(fn)
            data[name] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "rel_vs_sdpa": rel(fn(), base)}
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run this layout is a result too
            data[name] = {"error": " ".join(str(exc).split())[:300]}
    record(out, "attention", data)


def sec_features(args, out: Path) -> None:
    from dflash.compile import compile_target_layers
    from dflash.config import default_layer_ids
    from dflash.models.target import Target, build_hf_model

    model = build_hf_model(None, dict(QWEN3_8B), "bfloat16", seed=0, device="cuda")
    target = Target(model, default_layer_ids(36, 5))
    compile_target_layers(target, "default")
    ids = torch.randint(0, 151936, (args.batch, args.length), device="cuda")
    ms = cuda_ms(lambda: target.features(ids), warmup=3, iters=8)
    record(out, "features", {"taps": target.layer_ids, "tokens": args.batch * args.length, "ms": round(ms, 2),
                             "tokens_per_s": round(args.batch * args.length / ms * 1e3),
                             **kernel_classes(lambda: target.features(ids))})


def sec_features_float8(args, out: Path) -> None:
    """The same feature forward with `target.float8` (the decoder layers' linears in float8, rowwise), beside
    the bf16 one of the same model in the same process."""
    from dflash.compile import _allow_recompiles, compile_target_layers
    from dflash.components.float8 import target_float8
    from dflash.config import default_layer_ids
    from dflash.models.target import Target, build_hf_model

    model = build_hf_model(None, dict(QWEN3_8B), "bfloat16", seed=0, device="cuda")
    target = Target(model, default_layer_ids(36, 5))
    compile_target_layers(target, "default")
    ids = torch.randint(0, 151936, (args.batch, args.length), device="cuda")
    bf16_ms = cuda_ms(lambda: target.features(ids), warmup=3, iters=8)
    want = target.features(ids)
    _allow_recompiles(2 * len(target.layers))  # each layer compiles again with the float8 forwards
    done, kept = target_float8(target)
    fp8_ms = cuda_ms(lambda: target.features(ids), warmup=3, iters=8)
    got = target.features(ids)
    hid = QWEN3_8B["hidden_size"]
    per_tap = [round(rel(got[..., i * hid:(i + 1) * hid], want[..., i * hid:(i + 1) * hid]), 4)
               for i in range(len(target.layer_ids))]
    record(out, "features_float8", {"taps": target.layer_ids, "tokens": args.batch * args.length,
                                    "float8_linears": done, "kept": kept, "bf16_ms": round(bf16_ms, 2),
                                    "float8_ms": round(fp8_ms, 2), "speedup": round(bf16_ms / fp8_ms, 3),
                                    "rel_diff_per_tap": per_tap, "float8": kernel_classes(lambda: target.features(ids))})


def sec_gemms(args, out: Path) -> None:
    m, hid, inter = args.batch * args.length, 4096, 12288
    x = torch.randn(m, hid, device="cuda", dtype=torch.bfloat16)
    wq, wk, wv = (torch.randn(o, hid, device="cuda", dtype=torch.bfloat16) * 0.02 for o in (4096, 1024, 1024))
    wg, wu = (torch.randn(inter, hid, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2))
    wqkv, wgu = torch.cat([wq, wk, wv]), torch.cat([wg, wu])
    data = {"rows": m}
    for name, fn, flops in (
            ("qkv_apart", lambda: (x @ wq.t(), x @ wk.t(), x @ wv.t()), 2 * m * hid * 6144),
            ("qkv_fused", lambda: x @ wqkv.t(), 2 * m * hid * 6144),
            ("gate_up_apart", lambda: (x @ wg.t(), x @ wu.t()), 2 * m * hid * 2 * inter),
            ("gate_up_fused", lambda: x @ wgu.t(), 2 * m * hid * 2 * inter)):
        ms = cuda_ms(fn)
        data[name] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
    _lm_head(data)
    record(out, "gemms", data)


def _lm_head(data: dict) -> None:
    # the trainer's cast; the gradient is cast here in its default e4m3 (the loss's own is e5m2)
    from dflash.components.float8 import rowwise

    hid, vocab = 4096, 151936
    rows = 7680  # the loss rows of one sequence: 512 blocks x 15 labels
    r = torch.randn(rows, hid, device="cuda", dtype=torch.bfloat16)
    head = torch.randn(vocab, hid, device="cuda", dtype=torch.bfloat16) * 0.02
    g = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 1e-4
    flops = 2 * rows * hid * vocab
    data["lm_head_fwd_bf16"] = {"ms": round(ms := cuda_ms(lambda: r @ head.t()), 3), "tflops": round(flops / ms / 1e9, 1)}
    data["lm_head_dgrad_bf16"] = {"ms": round(ms := cuda_ms(lambda: g @ head), 3), "tflops": round(flops / ms / 1e9, 1)}
    try:
        r8, rs = rowwise(r)
        h8, hs = rowwise(head)  # the head is frozen: cast once
        fwd = lambda: torch._scaled_mm(r8, h8.t(), scale_a=rs, scale_b=hs.t(), out_dtype=torch.bfloat16)  # noqa: E731
        data["lm_head_fwd_fp8_rowwise"] = {"ms": round(ms := cuda_ms(fwd), 3), "tflops": round(flops / ms / 1e9, 1),
                                           "rel_vs_bf16": rel(fwd(), r @ head.t())}
        def fwd_with_cast():  # the rows change every step: their cast counts
            a, s = rowwise(r)
            return torch._scaled_mm(a, h8.t(), scale_a=s, scale_b=hs.t(), out_dtype=torch.bfloat16)

        data["lm_head_fwd_fp8_with_row_cast"] = {"ms": round(cuda_ms(fwd_with_cast), 3)}
        g8, gs = rowwise(g)
        ht8, hts = rowwise(head.t().contiguous())
        dgrad = lambda: torch._scaled_mm(g8, ht8.t(), scale_a=gs, scale_b=hts.t(), out_dtype=torch.bfloat16)  # noqa: E731
        data["lm_head_dgrad_fp8_rowwise"] = {"ms": round(ms := cuda_ms(dgrad), 3), "tflops": round(flops / ms / 1e9, 1),
                                             "rel_vs_bf16": rel(dgrad(), g @ head)}
    except Exception as exc:  # noqa: BLE001
        data["fp8_error"] = " ".join(str(exc).split())[:300]


def _sustained(fn, seconds: float = 3.0) -> tuple[float, float, float]:
    """`fn` back to back for about `seconds` (one sync at the end): (ms per call, start, end stamps)."""
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.time()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    one = cuda_ms(fn, warmup=1, iters=3)
    n = max(10, int(seconds * 1e3 / max(one, 1e-3)))
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n, t0, time.time()


def sec_gemm_sites(args, out: Path) -> None:
    import time

    from torch.profiler import ProfilerActivity, profile

    from dflash.compile import compile_target_layers
    from dflash.config import default_layer_ids
    from dflash.models.target import Target, build_hf_model

    sampler = GpuSampler()
    model = build_hf_model(None, dict(QWEN3_8B), "bfloat16", seed=0, device="cuda")
    target = Target(model, default_layer_ids(36, 5))
    compile_target_layers(target, "default")
    ids = torch.randint(0, 151936, (args.batch, args.length), device="cuda")
    feats = lambda: target.features(ids)  # noqa: E731
    data: dict = {"gpu_limits": sampler.limits}
    for blas in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(blas)
        res: dict = {}
        ms, t0, t1 = _sustained(feats, seconds=6.0)
        res["features_sustained"] = {"ms": round(ms, 2), "gpu": sampler.window(t0, t1)}
        res["features_synced"] = {"ms": round(cuda_ms(feats, warmup=2, iters=8), 2)}
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            feats()
            torch.cuda.synchronize()
        shapes: dict = {}
        for evt in prof.key_averages(group_by_input_shape=True):
            if evt.key not in ("aten::mm", "aten::addmm"):
                continue
            dims = [s for s in evt.input_shapes if len(s) == 2][:2]
            if len(dims) != 2:
                continue
            (m, k), (_, n) = dims
            dev_ms = evt.self_device_time_total / 1e3
            flops = 2 * m * k * n * evt.count
            shapes[f"{m}x{k}x{n}"] = {"calls": evt.count, "ms_in_place": round(dev_ms, 2),
                                      "tflops_in_place": round(flops / dev_ms / 1e9, 1) if dev_ms else None}
        for key, row in shapes.items():
            m, k, n = (int(x) for x in key.split("x"))
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            mm = lambda a=a, w=w: a @ w.t()  # noqa: E731
            flops = 2 * m * k * n
            synced = cuda_ms(mm, warmup=3, iters=20)
            ms, t0, t1 = _sustained(mm, seconds=3.0)
            row.update(alone_synced_tflops=round(flops / synced / 1e9, 1), alone_sustained_tflops=round(flops / ms / 1e9, 1),
                       alone_gpu=sampler.window(t0, t1))
            del a, w
        res["shapes"] = shapes
        res["kernels"] = kernel_classes(feats)
        data[blas] = res
        record(out, "gemm_sites", data)
        time.sleep(2)
    torch.backends.cuda.preferred_blas_library("cublas")
    sampler.stop()
    record(out, "gemm_sites", data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=3072)
    parser.add_argument("--sections", default="attention,features,gemms")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record(out, "machine", {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__})
    for name in args.sections.split(","):
        try:
            {"attention": sec_attention, "features": sec_features, "features_float8": sec_features_float8,
             "gemms": sec_gemms, "gemm_sites": sec_gemm_sites}[name](args, out)
            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - report and go on to the next section
            record(out, name, {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
