"""Run training in this process, or under torchrun when the topology has more than one rank."""

from __future__ import annotations

from dflash.config import RunConfig
from dflash.observability import warn


def run_training(config: RunConfig, config_path: str, overrides: list[str]) -> int:
    from dflash.train import train

    if config.topology.mode != "colocated" or config.topology.nproc > 1:
        warn("multi-rank topologies need dflash.distributed; running a single process")
    result = train(config)
    print(f"done: step {result['step']}" + (" (stopped by signal, checkpoint saved)" if result.get("stopped") else ""))
    return 0
