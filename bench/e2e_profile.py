"""Where the end-to-end step's time goes: the real Trainer, its steps timed, then profiled.

Builds `dflash.training.trainer.Trainer` from a config (and overrides, as `dflash train` takes them), runs warm-up steps
(compilation), times `--steps` steps (a sync after each, the trainer's own), then profiles two steps with
torch.profiler and reports how much of their wall time the GPU was busy (the union of kernel intervals): what
is left is the GPU waiting for the host (syncs, launches, host-side work). No logging, no checkpoints. On a GPU
with nvidia-smi, the timed steps' median power, SM clock and clock-event reasons (bench/gpu_power.py), the joules
each sequence of 3072 costs and the sequences per second the card's power limit allows at that cost.

Usage (GPU machine):  python bench/e2e_profile.py CONFIG [key=value ...] [--steps N] [--warmup N] [--label L]
Prints one JSON line; with --out DIR appends it to DIR/e2e-profile.jsonl.

--overlap ROUNDS: instead, the experiment of overlapping the target with the drafter. In the same process,
ROUNDS times: --steps steps as the trainer runs them (the target's forward, then the drafter's step), then
--steps steps whose next batch's target forward is launched on a second CUDA stream as soon as the current
batch's features are handed over, so it runs beside the drafter's step. One sync per block of steps (the
trainer's own per-step loss read stays). One JSON line per block.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from gpu_power import GpuSampler  # noqa: E402


def busy_ms(prof) -> tuple[float, float]:
    """(union of the GPU kernels' intervals, sum of their durations) in ms, from a profiler's trace."""
    spans = []
    for ev in prof.events():
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA and ev.time_range.elapsed_us() > 0:
            spans.append((ev.time_range.start, ev.time_range.end))
    spans.sort()
    union, total, end = 0.0, 0.0, None
    start0 = None
    for s, e in spans:
        total += e - s
        if end is None or s > end:
            if end is not None:
                union += end - start0
            start0, end = s, e
        else:
            end = max(end, e)
    if end is not None:
        union += end - start0
    return union / 1e3, total / 1e3


def main() -> int:
    from torch.profiler import ProfilerActivity, profile

    from dflash.config import load_config
    from dflash.training.trainer import Trainer

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--label", default="")
    p.add_argument("--out", default="")
    p.add_argument("--overlap", type=int, default=0, metavar="ROUNDS")
    args = p.parse_args()
    run_dir = tempfile.mkdtemp(prefix="e2e-profile-", dir=os.environ.get("RUNS_DIR", "/dev/shm"))
    overrides = [f"output_dir={run_dir}", "logging.interval=1000000", "checkpoint.interval=1000000",
                 "eval.speculative_prompts=0", *args.overrides]
    config = load_config(args.config, overrides)
    t0 = time.perf_counter()
    trainer = Trainer(config).setup()
    setup_s = time.perf_counter() - t0
    trainer.drafter.train()
    shapes: list[tuple[int, int]] = []  # (sequences, positions) of each micro-batch, as the trainer fetches them
    fetch = trainer.source.next

    def counted():
        epoch, batch, features = fetch()
        shapes.append(tuple(batch.input_ids.shape))
        return epoch, batch, features

    trainer.source.next = counted
    cuda = trainer.device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        trainer.train_step()
    sync()
    warmup_s = time.perf_counter() - t0
    if args.overlap:
        return overlap_rounds(trainer, counted, args, setup_s, warmup_s)
    times, tokens, drafter_flops = [], 0, 0.0
    shapes.clear()
    sampler = GpuSampler() if cuda and shutil.which("nvidia-smi") else None
    time.sleep(0.3 if sampler else 0)  # its first sample lands before the timed window
    wall0 = time.time()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        _, res = trainer.train_step()
        sync()
        times.append(time.perf_counter() - t0)
        tokens += res.tokens
        drafter_flops += trainer.step_flops
    gpu = sampler.window(wall0, time.time()) if sampler else {}
    if sampler:
        sampler.stop()
    step_s = sum(times) / len(times)
    timed_shapes = list(shapes)  # the profiled steps below fetch more
    sequences = sum(b for b, _ in timed_shapes)
    of_3072 = tokens / sum(times) / 3072  # sequences of 3072 positions per second
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync()
        t0 = time.perf_counter()
        for _ in range(2):
            trainer.train_step()
        sync()
        prof_wall_ms = (time.perf_counter() - t0) * 1e3
    union, total = busy_ms(prof)
    row = {"label": args.label, "overrides": args.overrides, "setup_s": round(setup_s, 1),
           "warmup_s": round(warmup_s, 1), "steps": args.steps, "step_ms": round(step_s * 1e3, 1),
           "step_ms_min": round(min(times) * 1e3, 1), "tokens_per_step": tokens / args.steps,
           "tokens_per_s": round(tokens / sum(times), 1), "sequences_per_s": round(sequences / sum(times), 3),
           "sequences_per_s_of_3072": round(of_3072, 3),
           "profiled_wall_ms_per_step": round(prof_wall_ms / 2, 1), "gpu_busy_ms_per_step": round(union / 2, 1),
           "gpu_kernel_ms_per_step": round(total / 2, 1),
           "gpu_idle_ms_per_step": round((prof_wall_ms - union) / 2, 1),
           "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
           "loss": float(res.loss)}
    target_flops = counted_target_flops(getattr(trainer.source, "target", None), timed_shapes)
    if target_flops is not None:
        total = (drafter_flops + target_flops) / args.steps
        row.update(drafter_tflop_per_step=round(drafter_flops / args.steps / 1e12, 2),
                   target_tflop_per_step=round(target_flops / args.steps / 1e12, 2),
                   counted_tflops=round(total / step_s / 1e12, 1))
    if sampler:
        row.update(gpu=gpu, gpu_limits=sampler.limits, **energy(gpu, sampler.limits, of_3072))
    emit(row, args.out)
    return 0


def counted_target_flops(target, shapes: list[tuple[int, int]]) -> float | None:
    """The target's feature forwards over `shapes` (micro-batches of (sequences, positions)): 2 x the parameters
    of the layers up to the deepest tap x tokens, plus causal attention in each of those layers (dflash.components.flops). A
    target with layers other than full attention (a hybrid) is not counted: None."""
    from dflash.components.flops import target_forward_flops
    from dflash.models.families import text_config_of

    if target is None or not hasattr(target, "layers"):
        return None
    tc = text_config_of(target.model.config)
    used = list(target.layers)[: max(target.layer_ids) + 1]
    if any(t != "full_attention" for t in (getattr(tc, "layer_types", None) or [])[: len(used)]):
        return None
    params = sum(p.numel() for layer in used for p in layer.parameters())
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    return sum(target_forward_flops(params, b * n, n, len(used), tc.num_attention_heads, head_dim) for b, n in shapes)


def energy(gpu: dict, limits: dict, sequences_per_s: float) -> dict:
    """Joules per sequence of 3072 at the median power drawn over the timed steps, and the sequences per second
    the card's power limit allows at that energy: when the step already draws the limit, only fewer joules per
    sequence make it faster."""
    watts = gpu.get("power.draw")
    if not isinstance(watts, float) or sequences_per_s <= 0:
        return {}
    joules = watts / sequences_per_s
    out = {"joules_per_sequence_of_3072": round(joules, 1)}
    if limits.get("power_limit_w"):
        out["sequences_per_s_at_power_limit"] = round(limits["power_limit_w"] / joules, 3)
    return out


def emit(row: dict, out: str) -> None:
    """Print `row` as one JSON line; with an --out DIR, append it to DIR/e2e-profile.jsonl too."""
    print(json.dumps(row), flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / "e2e-profile.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def prefetching(fetch):
    """`fetch` (the trainer's source.next) with the next micro-batch's target forward launched on a side stream
    as soon as the current one is handed over (the experiment: no sampler bookkeeping for resume)."""
    side = torch.cuda.Stream()
    pending = None

    def launch():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            epoch, batch, features = fetch()
        done = torch.cuda.Event()
        done.record(side)
        return epoch, batch, features, done

    def next_():
        nonlocal pending
        if pending is None:
            pending = launch()
        epoch, batch, features, done = pending
        here = torch.cuda.current_stream()
        here.wait_event(done)
        for t in (features, batch.input_ids, batch.loss_mask, batch.attention_mask, batch.lengths):
            t.record_stream(here)
        pending = launch()
        return epoch, batch, features

    return next_


def overlap_rounds(trainer, counted, args, setup_s, warmup_s) -> int:
    for r in range(args.overlap):
        for mode in ("sequential", "overlapped"):
            trainer.source.next = counted if mode == "sequential" else prefetching(counted)
            torch.cuda.synchronize()
            t0, tokens = time.perf_counter(), 0
            for _ in range(args.steps):
                _, res = trainer.train_step()
                tokens += res.tokens
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            row = {"label": args.label, "round": r, "mode": mode, "overrides": args.overrides,
                   "setup_s": round(setup_s, 1), "warmup_s": round(warmup_s, 1), "steps": args.steps,
                   "step_ms": round(wall / args.steps * 1e3, 1), "tokens_per_s": round(tokens / wall, 1),
                   "sequences_per_s_of_3072": round(tokens / wall / 3072, 3),
                   "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1), "loss": float(res.loss)}
            emit(row, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
