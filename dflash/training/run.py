"""One process's trainer run to its end: `run_to_end` (every drafter rank's run, its failure in the heartbeat and
as its exit class) and `train`, single-process training (`dflash train` without torchrun)."""

from __future__ import annotations

import contextlib
from typing import Any

from dflash.config import RunConfig
from dflash.logs import get_logger
from dflash.runtime import failures, stop
from dflash.training.trainer import Trainer

log = get_logger(__name__)


def run_to_end(trainer: Trainer) -> dict[str, Any]:
    """trainer.run(), then the input source's finish(); the reporter's heartbeat says `failed` (with the
    reason) if either raises."""
    try:
        result = trainer.run()
        trainer.source.finish()
        return result
    except BaseException as exc:
        # the failure's class (dflash/runtime/failures.py) goes into the heartbeat and, as its exit code, to the supervisor
        cls = failures.classify(exc) if isinstance(exc, Exception) else None
        classified = cls in failures.RAISED_CLASSES and not isinstance(exc, failures.ClassifiedFailure)
        reason = failures.describe(cls, exc, trainer.config) if classified else (
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        with contextlib.suppress(OSError):  # a full disk must not hide the error itself
            trainer.observer.heartbeat(trainer.step, trainer.sampler.epoch, "failed", error=reason,
                                       **({"failure_class": cls} if cls else {}))
        with contextlib.suppress(Exception):
            trainer.observer.close(failed=True)  # the trackers' runs end as failed
        if classified:
            raise failures.ClassifiedFailure(cls, reason) from exc
        raise


def train(config: RunConfig) -> dict[str, Any]:
    """Single-process training. A stop signal during start-up (caught by the launcher's `stop.install()`)
    ends it cleanly: before setup, nothing is loaded; during setup, it stops before the first step."""
    if stop.requested():
        log.info("received a stop signal during start-up: not starting")
        return {"step": 0, "stopped": True}
    trainer = Trainer(config).setup()
    stop.install(lambda signum: log.info(f"received signal {signum}: stopping at the next step boundary with a "
                                         f"checkpoint (an eval under way ends early)"))
    if stop.requested():
        log.info("received a stop signal during start-up: stopping before training")
    try:
        return run_to_end(trainer)
    finally:
        stop.finished()
