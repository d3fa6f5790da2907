"""Cost of shipping tapped hidden states between two GPUs, as the disaggregated topology does.

Run on a machine with two GPUs:

    torchrun --nproc-per-node 2 bench/p2p_bench.py --config tests/distributed/configs/gpu-8b.yaml

Rank 0 sends one micro-batch item (meta + tokens + features, the fixed-size buffers of
`dflash.runtime.transfer`) to rank 1 over NCCL point-to-point, the way `FeatureProducer` does;
reported: bytes per item, time per item, GB/s. Baseline in the same call: a peer-to-peer
`Tensor.copy_` of the same features buffer from GPU 0 to GPU 1 (copy engine, no NCCL).
Writes p2p.json under --out (or $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash.config import load_config
from dflash.data.buckets import BatchShape
from dflash.models.target import DTYPES
from dflash.runtime.transfer import Slot, TransferLayout


def layout_for(config_path: str, num_layers: int | None) -> TransferLayout:
    c = load_config(config_path)
    hidden = c.target.random_init["hidden_size"] if c.target.random_init else None
    if hidden is None:
        raise SystemExit("p2p_bench: the config needs target.random_init.hidden_size (the feature width)")
    taps = num_layers or c.drafter.num_layers
    return TransferLayout.for_batches(BatchShape.of(c.data), taps * hidden, DTYPES[c.target.dtype])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--taps", type=int, default=None, help="tapped layers (default: drafter.num_layers)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args()
    dist.init_process_group("nccl", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    layout = layout_for(args.config, args.taps)
    slot = Slot.allocate(layout, device)
    slot.features.normal_()

    def one():
        if rank == 0:
            slot.isend(1)
        else:
            slot.irecv(0)
        slot.wait(timedelta(seconds=60))
        torch.cuda.synchronize(device)

    for _ in range(3):
        one()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        one()
    nccl_s = (time.perf_counter() - t0) / args.iters
    result = None
    if rank == 0:
        dst = torch.empty_like(slot.features, device="cuda:1")
        for _ in range(3):
            dst.copy_(slot.features)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dst.copy_(slot.features)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        copy_s = (time.perf_counter() - t0) / args.iters
        nbytes = layout.bytes_per_item()
        fbytes = slot.features.numel() * slot.features.element_size()
        result = {"layout": {"max_rows": layout.max_rows, "max_tokens": layout.max_tokens,
                             "feature_dim": layout.feature_dim, "dtype": str(layout.feature_dtype)},
                  "bytes_per_item": nbytes, "nccl_ms_per_item": nccl_s * 1e3, "nccl_GBps": nbytes / nccl_s / 1e9,
                  "peer_copy_ms_features": copy_s * 1e3, "peer_copy_GBps": fbytes / copy_s / 1e9,
                  "ratio_nccl_vs_copy": (nbytes / nccl_s) / (fbytes / copy_s),
                  "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                  "date": time.strftime("%Y-%m-%d")}
        print(json.dumps(result, indent=1), flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "p2p.json"), "w") as fh:
            json.dump(result, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
