"""Operator API over ansible-runner: drive the project's playbooks from Python.

    from dflash import ops

    result = ops.train("inventories/local")
    for host, job in ops.status("inventories/local").containers.items():
        print(host, job.state, job.step, job.tokens_per_s)

Results are typed (:class:`OpsResult`, :class:`ContainerStatus`), built from the
runner's structured events. See docs/ops-api.md.
"""

from dflash.ops.api import deploy, logs, run, status, stop, train
from dflash.ops.results import ContainerStatus, GpuMemory, OpsFailed, OpsResult, TaskFailure
from dflash.ops.runner import OpsRun, start

__all__ = [
    "ContainerStatus", "GpuMemory", "OpsFailed", "OpsResult", "OpsRun", "TaskFailure",
    "deploy", "logs", "run", "start", "status", "stop", "train",
]
