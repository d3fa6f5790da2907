"""Which rank does what: roles, GPUs and process groups derived from `topology` (one process per GPU).

Ranks are numbered the way torchrun numbers them: global rank = node * nproc_per_node + local rank, and
every node has the same layout. In disaggregated mode the first `len(target_gpus)` local ranks of a node
are target ranks and the rest drafter ranks.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from dflash.config import RunConfig, TopologyConfig
from dflash.errors import BadInput


@dataclass(frozen=True)
class RankPlan:
    mode: str
    nnodes: int
    nproc_per_node: int
    target_ranks: tuple[int, ...]  # global ranks that run the target forward for others (disaggregated)
    drafter_ranks: tuple[int, ...]  # global ranks that train the drafter (data-parallel group)
    local_gpus: tuple[int, ...]  # GPU id of each local rank (the same on every node)
    target_stages: int = 1  # target ranks that share one target replica by layers (stages.py)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def disaggregated(self) -> bool:
        return self.mode == "disaggregated"

    @property
    def reporter(self) -> int:
        """The one rank that logs, writes the heartbeat and checkpoints: drafter rank 0."""
        return self.drafter_ranks[0]

    def is_target(self, rank: int) -> bool:
        return rank in self.target_ranks

    def drafter_index(self, rank: int) -> int:
        return self.drafter_ranks.index(rank)

    def target_index(self, rank: int) -> int:
        return self.target_ranks.index(rank)

    @property
    def producers(self) -> tuple[int, ...]:
        """Target ranks that send features to drafter ranks: the last stage of each replica."""
        return self.target_ranks[self.target_stages - 1::self.target_stages]

    def replica_of(self, rank: int) -> int:
        return self.target_index(rank) // self.target_stages

    def stage_of(self, rank: int) -> int:
        return self.target_index(rank) % self.target_stages

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        s = self.target_stages
        return self.target_ranks[replica * s:(replica + 1) * s]

    def gpu_of(self, rank: int) -> int:
        return self.local_gpus[rank % self.nproc_per_node]

    def describe(self, rank: int) -> str:
        if self.is_target(rank):
            where = (f" (stage {self.stage_of(rank)}/{self.target_stages} of replica {self.replica_of(rank)})"
                     if self.target_stages > 1 else "")
            return f"target rank {self.target_index(rank)}/{len(self.target_ranks)}{where}"
        return f"drafter rank {self.drafter_index(rank)}/{len(self.drafter_ranks)}"


def plan_ranks(top: TopologyConfig) -> RankPlan:
    if top.mode == "colocated":
        n = top.nproc
        ranks = tuple(range(top.nnodes * n))
        return RankPlan("colocated", top.nnodes, n, (), ranks, tuple(range(n)))
    tg, dg = list(top.target_gpus or []), list(top.drafter_gpus or [])
    n = len(tg) + len(dg)
    targets = tuple(node * n + i for node in range(top.nnodes) for i in range(len(tg)))
    drafters = tuple(node * n + i for node in range(top.nnodes) for i in range(len(tg), n))
    return RankPlan("disaggregated", top.nnodes, n, targets, drafters, tuple(tg + dg), top.target_stages)


def uses_cuda(config: RunConfig) -> bool:
    requested = config.runtime.device
    return requested == "cuda" or (requested == "auto" and torch.cuda.is_available())


def backend_for(config: RunConfig) -> str:
    backend = config.topology.backend
    cuda = uses_cuda(config)
    if backend == "auto":
        return "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise BadInput("topology.backend is 'nccl' but the ranks run on the CPU (runtime.device); set "
                       "topology.backend=gloo or auto")
    return backend


def check_devices(config: RunConfig, plan: RankPlan) -> None:
    """Before any model loads (and in `dflash train --check`): the GPUs the config asks for exist, one process
    per GPU (CUDA runs only). Each refusal is one line naming the setting and the fix."""
    if not uses_cuda(config):
        return
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        raise BadInput(f"runtime.device is 'cuda' but no CUDA GPU is visible{where}; set runtime.device=cpu (or auto), "
                       "or run where CUDA_VISIBLE_DEVICES names GPUs of this machine")
    if plan.disaggregated:
        top = config.topology
        for key, ids in (("topology.target_gpus", top.target_gpus or []), ("topology.drafter_gpus", top.drafter_gpus or [])):
            bad = sorted(g for g in ids if g >= visible)
            if bad:
                raise BadInput(f"{key} {list(ids)} names GPU ids {bad} but only ids 0..{visible - 1} are visible{where} "
                               "(ids are positions in CUDA_VISIBLE_DEVICES); fix topology.target_gpus / "
                               "topology.drafter_gpus or expose more GPUs")
    if plan.nproc_per_node > visible:
        key = "topology.nproc" if plan.mode == "colocated" else "topology.target_gpus + topology.drafter_gpus"
        raise BadInput(f"{key} asks for {plan.nproc_per_node} ranks (one GPU each) on this node but only {visible} "
                       f"GPU(s) are visible{where}; lower {key} or expose more GPUs")
    listed = [entry for entry in (shown or "").split(",") if entry.strip()]
    if len(listed) > visible:
        raise BadInput(f"CUDA_VISIBLE_DEVICES={shown} lists {len(listed)} GPUs but only {visible} are visible: "
                       f"'{listed[visible].strip()}' (position {visible}) is no GPU of this machine and CUDA ignores "
                       "it and every entry after it; list only GPUs that nvidia-smi shows")


def check_target_fits(config: RunConfig, plan: RankPlan) -> None:
    """Each target rank holds the whole target, or 1/target_stages of it: refuse what cannot fit."""
    if not uses_cuda(config):
        return
    need = target_weight_bytes(config)
    if need is None:
        return
    share = need / plan.target_stages  # layers are split evenly; the embedding makes stage 0 a bit larger
    holders = plan.local_gpus[:len(plan.target_ranks) // plan.nnodes] if plan.disaggregated else plan.local_gpus
    for gpu in holders:
        have = torch.cuda.get_device_properties(gpu).total_memory
        if share > 0.9 * have:
            stages = int(math.ceil(need / (0.8 * have)))
            what = ("the target's weights" if plan.target_stages == 1
                    else f"1/{plan.target_stages} of the target's weights")
            raise BadInput(f"{what} need {_size(share)} but GPU {gpu} has {_size(have)}; split "
                           f"the target by layers over more target ranks (topology.mode=disaggregated, "
                           f"topology.target_stages={stages} with a multiple of {stages} target_gpus), use "
                           "larger GPUs, or target.dtype=bfloat16")


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def target_weight_bytes(config: RunConfig) -> int | None:
    """Size of the target's weights from its config alone (built on the meta device; nothing is loaded)."""
    from transformers import AutoModelForCausalLM

    from dflash.models.target import DTYPES, target_config

    try:
        tcfg = target_config(config.target.path, config.target.random_init)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tcfg)
    except Exception:  # noqa: BLE001 - an estimate only; loading reports real problems later
        return None
    itemsize = torch.empty((), dtype=DTYPES[config.target.dtype]).element_size()
    return sum(p.numel() for p in model.parameters()) * itemsize
