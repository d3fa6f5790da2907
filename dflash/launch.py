"""`dflash train`: run training in this process, or start torchrun (one process per GPU) when the topology has
more ranks.

`dflash train CONFIG` is the one command in every case:
* one rank -> trains here;
* several ranks -> this process validates the config and the GPUs, starts `python -m torch.distributed.run`
  running `dflash train CONFIG` per rank through the one torchrun launcher (dflash/runtime/torchrun.py, which passes
  a stop signal on to the workers) and returns the verdict: the failure class of the rank that failed first;
* started by torchrun (ours or an external one: LOCAL_RANK and WORLD_SIZE set) -> runs this rank.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from dflash.config import RunConfig
from dflash.logs import get_logger
from dflash.runtime import torchrun
from dflash.runtime.torchrun import hard_exit, under_torchrun

log = get_logger(__name__)  # stdout lines; a failure's one-line error goes to stderr

# Rendezvous settings from the environment win over the config (one config file, one unit per node).
RENDEZVOUS_ENV = {"DFLASH_NNODES": "nnodes", "DFLASH_NODE_RANK": "node_rank", "DFLASH_MASTER_ADDR": "master_addr",
                  "DFLASH_MASTER_PORT": "master_port"}


def apply_rendezvous_env(config: RunConfig) -> None:
    from dflash.config import validate_topology
    from dflash.errors import BadInput

    for env, key in RENDEZVOUS_ENV.items():
        if env in os.environ:
            raw = os.environ[env]
            if key == "master_addr":
                value: str | int = raw
            else:
                try:
                    value = int(raw)
                except ValueError:
                    raise BadInput(f"{env}={raw!r} is not an integer") from None
            setattr(config.topology, key, value)
    validate_topology(config.topology)


def run_training(config: RunConfig, config_path: str, overrides: list[str]) -> int:
    # first of all (torch imports take a second): a stop while this process starts up starts nothing, or
    # stops the trainer cleanly before its first step (dflash/runtime/stop.py: its handler takes the request over)
    from dflash.runtime import stop

    stop.install()
    from dflash.runtime.notify import Notifier

    Notifier().loading()  # the supervisor's watchdog: the start-up allowance while the target loads
    apply_rendezvous_env(config)
    from dflash.runtime import stacks

    if under_torchrun():
        stacks.install(config.output_dir, int(os.environ.get("RANK", "0")))  # hang evidence (dflash/runtime/stacks.py)
        return _run_worker(config)
    from dflash.runtime.topology import plan_ranks

    plan = plan_ranks(config.topology)
    if plan.world_size == 1:
        from dflash.training.run import train

        stacks.install(config.output_dir, 0)
        _print_done(train(config))
        return 0
    from dflash.runtime.topology import check_devices, check_target_fits

    check_devices(config, plan)  # exit 2 before any process starts
    check_target_fits(config, plan)
    if stop.requested():
        log.info("dflash: stopped by a signal before the ranks were started")
        return 0
    return launch_torchrun(config, config_path, overrides, plan)


def _run_worker(config: RunConfig) -> int:
    """A torchrun worker. A failing rank reports (as the CLI does) and exits at once: interpreter teardown
    can take seconds, or hang in a process group whose peer is gone, and torchrun only acts on the exit."""
    from dflash.errors import DflashError
    from dflash.runtime import failures
    from dflash.training import worker

    try:
        result = worker.run_rank(config)  # @record has written the error file on failure
    except BaseException as exc:  # noqa: BLE001 - any failure of this rank ends the job
        # its class (dflash/runtime/failures.py) for the launcher: torchrun's own exit says only that a rank failed
        cls = failures.classify(exc) if isinstance(exc, Exception) else "unknown"
        if isinstance(exc, DflashError):
            message = str(exc)
        else:
            traceback.print_exc()
            message = failures.describe(cls, exc, config)
        if cls != "unknown" or isinstance(exc, DflashError):
            print(f"dflash: error: {message}", file=sys.stderr, flush=True)
        failures.write_rank_failure(config.output_dir, int(os.environ.get("RANK", "0")), cls,
                                    message.splitlines()[0] if message else cls)
        hard_exit(failures.EXIT_CODES[cls])
    if result is not None:
        _print_done(result)
    # Success exits hard too: every file is written and synced by now, and a normal interpreter teardown
    # of a torch.distributed worker can abort in C++ ("terminate called without an active exception").
    hard_exit(0)
    return 0


def _print_done(result: dict) -> None:
    saved = ", checkpoint saved" if result.get("step") else ""
    log.info(f"done: step {result['step']}" + (f" (stopped by signal{saved})" if result.get("stopped") else ""))


def torchrun_command(config: RunConfig, config_path: str, overrides: list[str], nproc_per_node: int) -> list[str]:
    top = config.topology
    rendezvous = None  # one node: --standalone
    if top.nnodes > 1:
        # the c10d TCP store on node 0 at master_addr:master_port, keyed by the run id; the static handler
        # keeps the nodes' ranks as given (c10d's dynamic one orders them by hostname), so rank 0 and the
        # reporter stay on node 0; every node waits for all the others up to timeout_s
        from dflash.runtime.multinode import run_id

        rendezvous = ["--nnodes", str(top.nnodes), "--node-rank", str(top.node_rank), "--rdzv-backend", "static",
                      "--rdzv-endpoint", f"{top.master_addr}:{top.master_port}", "--rdzv-id",
                      run_id(config.output_dir), "--rdzv-conf", f"timeout={top.timeout_s}"]
    return torchrun.command(nproc_per_node, ["train", str(Path(config_path).resolve()), *overrides], rendezvous)


def launch_torchrun(config: RunConfig, config_path: str, overrides: list[str], plan) -> int:
    """The ranks of this node through the one torchrun launcher (dflash/runtime/torchrun.py): a stop signal asks them to
    checkpoint and stop within topology.timeout_s; the exit is the failure class of the rank that failed first."""
    from dflash.runtime import failures

    cmd = torchrun_command(config, config_path, overrides, plan.nproc_per_node)
    grace = config.topology.timeout_s  # after SIGTERM: time for the ranks to agree, checkpoint and exit
    failures.clear_rank_failures(config.output_dir)  # the ranks of this launch record their failures there
    liveness = rank_liveness(config, plan)
    presence = node_presence(config, plan)

    def poll(workers: int) -> None:
        if liveness is not None:
            liveness.poll()
        if presence is not None:
            presence.poll(workers, liveness)

    try:
        rc = torchrun.run(cmd, grace, what=f"{plan.world_size} ranks ({plan.nproc_per_node} on this node)",
                          stop_note=f"asking the ranks to checkpoint and stop (bounded by topology.timeout_s={grace}s)",
                          env=liveness.environment() if liveness else None, poll=poll,
                          stopping=presence.stopping if presence is not None else None)
    finally:
        if liveness is not None:
            liveness.close()
    lost = presence.finish(rc) if presence is not None else None
    if presence is not None:
        presence.close()
    if rc != 0:
        if lost:
            print(f"dflash: error: the distributed job failed (torchrun exit {rc}): {lost}", file=sys.stderr,
                  flush=True)
            return 1
        first = failures.first_rank_failure(config.output_dir)
        if first is not None:  # the job ends with the class of the rank that failed first
            print(f"dflash: error: the distributed job failed (torchrun exit {rc}): rank {first.get('rank')} "
                  f"failed first, {first['failure_class']}: {first.get('error')}", file=sys.stderr, flush=True)
            return failures.EXIT_CODES[first["failure_class"]]
        print(f"dflash: error: the distributed job failed (torchrun exit {rc}); the failing rank and its "
              "traceback are in torchrun's error summary above", file=sys.stderr, flush=True)
        return 1
    return 0


def rank_liveness(config: RunConfig, plan):
    """Under a supervisor's watchdog: the socket this node's step-loop ranks (drafter ranks) notify."""
    from dflash.runtime.notify import Notifier, RankLiveness

    upstream = Notifier()
    if not upstream.enabled and config.topology.nnodes == 1:
        return None  # multi-node: the node file reports this node's step and whether its ranks all joined
    node = config.topology.node_rank
    expected = {r for r in plan.drafter_ranks if r // plan.nproc_per_node == node}
    return RankLiveness(upstream, expected)


def node_presence(config: RunConfig, plan):
    """Multi-node: this node's presence record and node file (dflash/runtime/multinode.py)."""
    if config.topology.nnodes == 1:
        return None
    from dflash.runtime.multinode import NodePresence

    top = config.topology
    return NodePresence(config.output_dir, top.nnodes, top.node_rank, top.master_addr, top.master_port,
                        plan.nproc_per_node, plan.world_size, top.timeout_s)
