"""flex_attention's kernel tiles at the drafter's training shape: forward and backward time of each candidate.

The drafter's attention (block queries against [context ; blocks], dflash.models.attention) at the Qwen3-8B
width: 32 query heads, 8 KV heads, head_dim 128, 512 anchors of block 16 over a 3072-token context (8192
queries against 11264 keys), the BlockMask the trainer builds. Each candidate is a `kernel_options` dict
(torch's names; `fwd_`/`bwd_` prefixes apply to one pass), compiled on its own; `default` is torch's own
choice for the GPU and the baseline of the ratios. Outputs and gradients of every candidate are compared with
the default's (relative L2 error, bf16), so a tile that computes something else is seen, not timed.

Usage (GPU machine):  python bench/flex_tiles.py --out DIR [--candidates NAME,...] [--best-json FILE]
Validate on a CPU:     python bench/flex_tiles.py --tiny   (no timing: flex backward needs CUDA)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (name, kernel_options). Backward: BLOCK_M1/BLOCK_N1 tile the dK/dV pass (a KV tile walks the query tiles
# that see it), BLOCK_M2/BLOCK_N2 the dQ pass; each must divide the BlockMask tile (128).
def bwd(m: int, n: int, stages: int, warps: int) -> dict:
    """Backward tiles in torch's symmetric pairing: dK/dV m x n, dQ n x m."""
    return {"bwd_BLOCK_M1": m, "bwd_BLOCK_N1": n, "bwd_BLOCK_M2": n, "bwd_BLOCK_N2": m,
            "bwd_num_stages": stages, "bwd_num_warps": warps}


def fwd(m: int, n: int, stages: int, warps: int) -> dict:
    return {"fwd_BLOCK_M": m, "fwd_BLOCK_N": n, "fwd_num_stages": stages, "fwd_num_warps": warps}


CANDIDATES: list[tuple[str, dict]] = [
    ("default", {}),
    *((f"bwd {m}/{n} s{s} w{w}", bwd(m, n, s, w)) for m, n, s, w in (
        (64, 64, 3, 4), (64, 64, 3, 8), (64, 64, 2, 4), (32, 64, 3, 4), (32, 64, 4, 4), (32, 128, 3, 8),
        (64, 128, 2, 8), (32, 32, 3, 4))),
    ("bwd 64/128 s3 w8 tma", {"bwd_USE_TMA": True}),
    ("fwd 128/128 s2 w8", fwd(128, 128, 2, 8)),
    ("fwd 64/128 s3 w4", fwd(64, 128, 3, 4)),
    ("fwd tma", {"fwd_USE_TMA": True}),
    # FlashAttention-4's CuTe DSL kernels behind flex_attention (torch's BACKEND="FLASH"; needs flash-attn-4)
    ("tuned", {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
               "bwd_num_stages": 2, "bwd_num_warps": 4}),  # dflash's choice on Hopper (TUNED_FLEX_OPTIONS)
    ("flash", {"BACKEND": "FLASH"}),
]


def shape(tiny: bool) -> dict:
    if tiny:
        return {"hq": 4, "hkv": 2, "d": 16, "ctx": 256, "anchors": 16, "block": 16, "prompt": 32}
    return {"hq": 32, "hkv": 8, "d": 128, "ctx": 3072, "anchors": 512, "block": 16, "prompt": 384}


def inputs(s: dict, dev: torch.device, dtype: torch.dtype):
    """q/k/v and the trainer's BlockMask for anchors drawn as the trainer draws them (answer after a prompt)."""
    from dflash.components.loss import sample_anchors
    from dflash.models.attention import flex_block_mask

    loss_mask = torch.zeros(1, s["ctx"], dtype=torch.bool)
    loss_mask[:, s["prompt"]:] = True
    anchors, _ = sample_anchors(loss_mask, torch.tensor([s["ctx"]]), s["anchors"], torch.Generator().manual_seed(0))
    anchors = anchors.to(dev)
    mask = flex_block_mask(anchors, s["ctx"], s["block"])
    lq, lk = s["anchors"] * s["block"], s["ctx"] + s["anchors"] * s["block"]
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(1, s["hq"], lq, s["d"], device=dev, dtype=dtype, generator=g)
    k = torch.randn(1, s["hkv"], lk, s["d"], device=dev, dtype=dtype, generator=g)
    v = torch.randn(1, s["hkv"], lk, s["d"], device=dev, dtype=dtype, generator=g)
    grad = torch.randn(1, s["hq"], lq, s["d"], device=dev, dtype=dtype, generator=g)
    useful = float((anchors.float() + s["block"]).sum()) * s["block"] * s["hq"]  # visible (q, k) pairs
    return q, k, v, grad, mask, useful


def median_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    from torch.nn.attention.flex_attention import flex_attention

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench-out")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--candidates", default="", help="comma-separated names (default: all)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--best-json", default="", help="write the fastest correct candidate's kernel_options here")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    s = shape(args.tiny)
    q0, k0, v0, grad, mask, useful = inputs(s, dev, dtype)
    wanted = [c for c in CANDIDATES if not args.candidates or c[0] in args.candidates.split(",")]
    if wanted[0][0] != "default":
        wanted.insert(0, CANDIDATES[0])
    results, ref = {}, None
    for name, options in wanted:
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention
        q, k, v = (t.detach().clone().requires_grad_(cuda) for t in (q0, k0, v0))

        def forward(q=q, k=k, v=v, fn=fn, options=options):
            return fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options or None)

        def both(forward=forward, q=q, k=k, v=v):
            q.grad = k.grad = v.grad = None
            forward().backward(grad)

        row: dict = {"kernel_options": options}
        try:
            t0 = time.perf_counter()
            o = forward()
            if cuda:
                o.backward(grad)
                torch.cuda.synchronize()
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            got = [o.detach().float()] + ([t.grad.float() for t in (q, k, v)] if cuda else [])
            if ref is None:
                ref = got
            row["rel_err_vs_default"] = [float((a - b).norm() / b.norm().clamp(min=1e-30)) for a, b in zip(got, ref, strict=True)]
            row["finite"] = all(bool(torch.isfinite(a).all()) for a in got)
            if cuda:
                with torch.no_grad():
                    row["fwd_ms"] = median_ms(lambda forward=forward: forward(), 3, args.iters)
                row["fwd_bwd_ms"] = median_ms(both, 3, args.iters)
                row["bwd_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]
                row["fwd_tflops"] = 4 * s["d"] * useful / row["fwd_ms"] / 1e9
                row["bwd_tflops"] = 10 * s["d"] * useful / row["bwd_ms"] / 1e9  # dQ, dK, dV, dP, recompute S
        except Exception as exc:  # a tile that does not fit the GPU: reported, the others still run
            row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
            traceback.print_exc()
        results[name] = row
        print(f"{name:24s} {json.dumps({k: v for k, v in row.items() if k != 'kernel_options'})}", flush=True)
        (out / "flex-tiles.json").write_text(json.dumps({"shape": s, "results": results}, indent=2))
    if not cuda:
        return 0
    base = results["default"]
    print(f"\n{'candidate':24s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd+bwd':>8s} {'vs default':>10s} {'max rel err':>11s}")
    for name, row in results.items():
        if "fwd_bwd_ms" in row:
            print(f"{name:24s} {row['fwd_ms']:8.3f} {row['bwd_ms']:8.3f} {row['fwd_bwd_ms']:8.3f} "
                  f"{base['fwd_bwd_ms'] / row['fwd_bwd_ms']:9.3f}x {max(row['rel_err_vs_default']):11.2e}")
        else:
            print(f"{name:24s} {row.get('error', '')[:80]}")
    ok = {n: r for n, r in results.items() if "fwd_bwd_ms" in r and r["finite"] and max(r["rel_err_vs_default"]) < 2e-2}
    # the best forward tile and the best backward tile are independent choices: combine them
    best_fwd = min((n for n in ok if not n.startswith("bwd")), key=lambda n: ok[n]["fwd_ms"])
    best_bwd = min((n for n in ok if not n.startswith("fwd")), key=lambda n: ok[n]["bwd_ms"])
    best = {**results[best_fwd]["kernel_options"], **results[best_bwd]["kernel_options"]}
    print(f"\nbest forward: {best_fwd}; best backward: {best_bwd}; combined kernel_options: {json.dumps(best)}")
    if args.best_json:
        Path(args.best_json).write_text(json.dumps(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
