"""The torchrun worker's entry point: one process per GPU, a colocated or disaggregated target/drafter rank
(docs/topology.md). `run_rank` is where `dflash train` under torchrun ends up; what each rank then runs is
`dflash.training.ranks`; roles, GPUs and process groups are `dflash.runtime.topology`'s, the hidden-state
transfers `dflash.runtime.transfer`'s.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

from torch.distributed.elastic.multiprocessing.errors import record

from dflash.config import RunConfig
from dflash.errors import BadInput
from dflash.logs import get_logger, set_reporter
from dflash.runtime.topology import (
    RankPlan,
    backend_for,
    check_devices,
    check_target_fits,
    plan_ranks,
    uses_cuda,
)

log = get_logger(__name__)

PEER_FAILURE_DELAY_S = 2.0


class PeerFailure(RuntimeError):
    """This rank failed because another rank died or stopped answering (its own error is secondary)."""


def is_peer_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    from dflash.runtime.setup_barrier import SetupPeerLost

    text = str(exc)
    return isinstance(exc, dist.DistError | SetupPeerLost) or any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Timed out waiting",
                                      "gloo/transport"))


@record  # writes the traceback to TORCHELASTIC_ERROR_FILE: torchrun's summary names this rank and its error
def run_rank(config: RunConfig) -> dict | None:
    """Run this torchrun worker's rank.

    torchrun names as root cause the failure with the earliest error-file timestamp, in whole seconds. A rank
    that fails only because a peer failed waits PEER_FAILURE_DELAY_S first, so the summary names the rank
    that failed first, not its victims (a timed-out rank is still named when the culprit hangs silently).
    """
    try:
        return _run_rank(config)
    except Exception as exc:
        if not is_peer_failure(exc):
            raise
        time.sleep(PEER_FAILURE_DELAY_S)
        raise PeerFailure(f"rank {os.environ.get('RANK')} lost a peer (see the root cause): {exc}") from exc


def _run_rank(config: RunConfig) -> dict | None:
    import torch
    import torch.distributed as dist

    from dflash.runtime import setup_barrier, stop
    from dflash.training.ranks import check_setup_fault, run_colocated, run_disaggregated

    plan = plan_ranks(config.topology)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    set_reporter(rank == plan.reporter)  # one copy of each job-wide line
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world != plan.world_size or local_world != plan.nproc_per_node:
        raise BadInput(f"torchrun started {world} processes ({local_world} on this node) but the topology needs "
                       f"{plan.world_size} ({plan.nproc_per_node} per node x {plan.nnodes} nodes); run `dflash "
                       "train CONFIG` without torchrun, or match --nproc-per-node/--nnodes to topology")
    check_devices(config, plan)
    if plan.is_target(rank) or not plan.disaggregated:  # disaggregated drafter ranks never hold the target
        check_target_fits(config, plan)
    if uses_cuda(config):
        device = torch.device("cuda", plan.gpu_of(rank))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend_for(config)
    timeout = timedelta(seconds=config.topology.timeout_s)
    dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    setup_barrier.begin(config.topology.timeout_s)  # setups of any length end together (dflash/runtime/setup_barrier.py)
    check_setup_fault(rank)
    log.info(f"distributed: {config.topology.mode}, {plan.world_size} ranks ({backend}), "
             f"{len(plan.drafter_ranks)} drafter rank(s)"
             + (f", {len(plan.target_ranks)} target rank(s)" if plan.disaggregated else "")
             + f"; this is {plan.describe(rank)} on {device}")
    if plan.disaggregated:
        result = run_disaggregated(config, plan, rank, device)
    else:
        result = run_colocated(config, plan, rank, device)
    stop.finished()  # a stop signal now must not turn a clean exit into death by signal
    dist.destroy_process_group()
    return result if rank == plan.reporter else None


__all__ = ["RankPlan", "plan_ranks", "run_rank", "check_devices"]
