"""The operator API: train, status, stop and logs of the training containers of an inventory."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from dflash.ops.results import OpsResult
from dflash.ops.runner import DEFAULT_KEEP_ARTIFACTS, EventHandler, start

# True: live progress on stderr (rich); False/None: quiet; a callable: your own event handler.
Progress = bool | EventHandler | None
PathLike = str | os.PathLike[str]


def _handler(progress: Progress) -> EventHandler | None:
    if progress is True:
        from dflash.ops.progress import RichProgress

        return RichProgress()
    return progress or None


def run(operation: str, inventory: PathLike, *, extravars: dict[str, Any] | None = None, limit: str | None = None,
        progress: Progress = True, keep_artifacts: int = DEFAULT_KEEP_ARTIFACTS,
        timeout: int | None = None) -> OpsResult:
    """Run one operation's playbook to the end and return its typed result."""
    handler = _handler(progress)
    try:
        result = start(operation, inventory, extravars=extravars, limit=limit, event_handler=handler,
                       keep_artifacts=keep_artifacts, timeout=timeout).wait()
    finally:
        close = getattr(handler, "close", None)
        if close is not None:
            close()
    assert result is not None
    return result


def train(inventory: PathLike, *, limit: str | None = None, progress: Progress = True,
          extravars: dict[str, Any] | None = None, **more_extravars: Any) -> OpsResult:
    """Provision the containers, deploy and launch the trainer, prove it trains (playbooks/train.yml).

    Keyword arguments are extra variables, e.g. ``dflash_job_state="restarted"``.
    """
    return run("train", inventory, extravars={**(extravars or {}), **more_extravars}, limit=limit, progress=progress)


def deploy(inventory: PathLike, *, limit: str | None = None, progress: Progress = True,
           extravars: dict[str, Any] | None = None, **more_extravars: Any) -> OpsResult:
    """Deploy and (re)start the job in already provisioned containers, prove it trains (playbooks/deploy.yml)."""
    return run("deploy", inventory, extravars={**(extravars or {}), **more_extravars}, limit=limit, progress=progress)


def status(inventory: PathLike, *, limit: str | None = None, progress: Progress = True,
           extravars: dict[str, Any] | None = None, **more_extravars: Any) -> OpsResult:
    """Unit state, pid, exit status, step, tokens/s, tau, GPUs and log tail of every job (playbooks/status.yml)."""
    return run("status", inventory, extravars={**(extravars or {}), **more_extravars}, limit=limit, progress=progress)


def stop(inventory: PathLike, *, limit: str | None = None, progress: Progress = True,
         extravars: dict[str, Any] | None = None, **more_extravars: Any) -> OpsResult:
    """Stop every job (SIGTERM, checkpoint, SIGKILL after the timeout) and wait for its GPUs (playbooks/stop.yml).

    ``dflash_job_stop_state="absent"`` also removes the unit's state.
    """
    return run("stop", inventory, extravars={**(extravars or {}), **more_extravars}, limit=limit, progress=progress)


LineHandler = Callable[[str, list[str]], Any]


def _print_lines(host: str, lines: list[str]) -> None:
    for line in lines:
        print(f"{host} | {line}", flush=True)


def logs(inventory: PathLike, lines: int = 40, follow: bool = False, *, limit: str | None = None,
         progress: Progress = False, on_lines: LineHandler | None = None, interval: float = 5.0,
         until: Callable[[], bool] | None = None, extravars: dict[str, Any] | None = None) -> OpsResult:
    """The last ``lines`` log lines of every job (``result.containers[host].log_tail``).

    With ``follow``, keeps reading the lines appended since (one playbook run every
    ``interval`` seconds) and hands each host's new lines to ``on_lines(host, lines)``
    (default: print ``host | line``), the first tail included, until Ctrl-C, ``until()``
    returns true, or a read fails. Returns the last read's result. Each read is a
    playbook run (a few seconds), so ``interval`` is a floor, not a period.
    """
    extravars = dict(extravars or {})
    result = run("logs", inventory, extravars={**extravars, "dflash_ops_log_lines": lines}, limit=limit,
                 progress=progress)
    if not follow:
        return result
    emit = on_lines or _print_lines
    offsets: dict[str, int] = {}
    try:
        while True:
            for host, container in result.containers.items():
                if container.log_tail:
                    emit(host, container.log_tail)
                if container.log_next_offset is not None:
                    offsets[host] = container.log_next_offset
            if not result.ok or (until is not None and until()):
                return result
            time.sleep(interval)
            follow_vars = {**extravars, "dflash_ops_log_offsets": dict(offsets)}
            result = run("logs", inventory, extravars=follow_vars, limit=limit, progress=False)
    except KeyboardInterrupt:
        return result
