"""The end of a finished run with experiment trackers: its final checkpoint exported for serving
(OUTPUT_DIR/trackers/export) and uploaded to the trackers as the artifact `export`."""

from __future__ import annotations

import shutil
from pathlib import Path

from dflash.components.checkpoint import CheckpointManager
from dflash.logs import get_logger
from dflash.runtime.observability import RunObserver

log = get_logger(__name__)


def export_to_trackers(observer: RunObserver, store: CheckpointManager, step: int, output_dir: str | Path) -> None:
    """Step `step`'s checkpoint of `store` exported and uploaded; a failure is one warning, never the run's."""
    from dflash.components.export import export

    target = Path(output_dir) / "trackers" / "export"
    try:
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        observer.artifact(export(store.path_for(step), target, which="latest"), "export")
    except Exception as exc:  # noqa: BLE001 - the trained checkpoint is kept whatever the export does
        log.warning(f"trackers: the export of step {step} for the trackers failed ({type(exc).__name__}: "
                    f"{exc}); the checkpoint is kept, `dflash export` makes it")
