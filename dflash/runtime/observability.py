"""Human log line, JSON lines, heartbeat file and TensorBoard scalars (the trainer's runtime contract)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from dflash.errors import DiskFull
from dflash.fileio import NO_SPACE, append_line, atomic_file
from dflash.logs import get_logger
from dflash.runtime.trackers import RunTrackers

log = get_logger(__name__)


def atomic_write_json(path: Path, data: dict[str, Any]) -> None:
    """Not fsynced (the heartbeat is rewritten every few steps): atomic against a reader, not against a crash."""
    text = json.dumps(data)
    try:
        with atomic_file(path, durable=False, disk_full=False) as fh:
            fh.write(text)
    except OSError as exc:
        if exc.errno not in NO_SPACE or not path.is_file():
            raise
        # disk full: rewrite the existing small file in place (its blocks are allocated already), so the
        # heartbeat can still say `failed` instead of a stale `training`
        with open(path, "r+") as fh:
            fh.write(text)
            fh.truncate()


def _append_record(path: Path, record: dict[str, Any]) -> None:
    try:
        append_line(path, json.dumps(record))
    except OSError as exc:
        if exc.errno in NO_SPACE:
            raise DiskFull(f"no space left in {path.parent} while writing {path.name}: free space there or "
                           "move output_dir") from None
        raise


class RunObserver:
    """Only the reporting rank writes; others construct it with `enabled=False`."""

    def __init__(self, output_dir: str | os.PathLike, tensorboard: bool = False, enabled: bool = True,
                 trackers: RunTrackers | None = None):
        self.dir = Path(output_dir)
        self.enabled = enabled
        # MLflow, W&B (dflash/runtime/trackers.py): the scalars TensorBoard gets, under the same tags
        self.trackers = trackers if trackers is not None and enabled else RunTrackers()
        self.heartbeat_path = self.dir / "heartbeat.json"
        self.metrics_path = self.dir / "metrics.jsonl"
        self._tb = None
        # A `starting` heartbeat is rewritten every STARTING_REFRESH_S while the run loads its models and prepares
        # (regenerates) its data: the health check tells a slow start from a frozen one by its age.
        self._beat_lock = threading.Lock()
        self._starting_done: threading.Event | None = None
        self._starting_thread: threading.Thread | None = None  # the refresher (tests join it)
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.dir / "tensorboard"))

    STARTING_REFRESH_S = 30.0

    def heartbeat(self, step: int, epoch: int, status: str, **extra: Any) -> None:
        if not self.enabled:
            return
        with self._beat_lock:
            if status != "starting":
                self._end_refresh()  # any later status ends the refresh; it never overwrites one
            self._write_beat(step, epoch, status, extra)
            if status == "starting" and self._starting_done is None:
                self._starting_done = threading.Event()
                self._starting_thread = threading.Thread(
                    target=self._refresh_starting, args=(self._starting_done, step, epoch, extra),
                    name="dflash-starting-heartbeat", daemon=True)
                self._starting_thread.start()

    def _write_beat(self, step: int, epoch: int, status: str, extra: dict[str, Any]) -> None:
        atomic_write_json(self.heartbeat_path, {"step": step, "epoch": epoch, "time": time.time(),
                                                "pid": os.getpid(), "status": status,
                                                "loss": extra.get("loss"), "tau": extra.get("tau"),
                                                "tokens_per_s": extra.get("tokens_per_s"),
                                                **{k: v for k, v in extra.items()
                                                   if k not in ("loss", "tau", "tokens_per_s")}})

    def _refresh_starting(self, done: threading.Event, step: int, epoch: int, extra: dict[str, Any]) -> None:
        while not done.wait(self.STARTING_REFRESH_S):
            with self._beat_lock:
                if done.is_set():
                    return
                try:
                    self._write_beat(step, epoch, "starting", extra)
                except OSError as exc:  # a full disk: the main thread meets it and reports it
                    log.warning(f"heartbeat: could not refresh {self.heartbeat_path}: {exc}")
                    return

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        acc = record.get("acc") or []
        acc_text = " ".join(f"acc@{k + 1} {a:.3f}" for k, a in enumerate(acc[:3]))
        line = (f"step {record['step']} epoch {record['epoch']} loss {record['loss']:.4f} {acc_text} "
                f"tau {record['tau']:.3f} tok/s {record['tokens_per_s']:.0f} lr {record['lr']:.2e} "
                f"mem {record.get('mem_gib', 0.0):.2f}GiB")
        if record.get("mfu") is not None:
            line += f" mfu {record['mfu']:.1%}"
        if record.get("input_frac") is not None:
            line += f" input {record['input_frac']:.0%}"
        log.info(line)
        _append_record(self.metrics_path, {**record, "time": time.time()})
        scalars = {f"train/{key}": record[key] for key in ("loss", "tau", "tokens_per_s", "lr", "mem_gib", "mfu",
                                                           "input_frac") if record.get(key) is not None}
        scalars.update({f"acc/pos{k + 1}": a for k, a in enumerate(acc)})
        self._scalars(scalars, record["step"])

    def log_eval(self, record: dict[str, Any]) -> None:
        """An eval record: one JSON line (`"kind": "eval"`) in metrics.jsonl and TensorBoard `eval/*` scalars."""
        if not self.enabled:
            return
        _append_record(self.metrics_path, {"kind": "eval", **record, "time": time.time()})
        self._scalars({f"eval/{key}": value for key, value in record.items()
                       if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)},
                      record["step"])

    def _scalars(self, scalars: dict[str, float], step: int) -> None:
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, step)
            self._tb.flush()
        self.trackers.scalars(scalars, step)

    def event(self, message: str) -> None:
        if self.enabled:
            log.info(message)

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self.enabled:
            self._scalars({tag: value}, step)

    def artifact(self, path: Path, name: str) -> None:
        """A directory (the run's export) uploaded to the trackers that keep artifacts (not TensorBoard)."""
        if self.enabled:
            self.trackers.artifact(path, name)

    def _end_refresh(self) -> None:
        """Stop the `starting` refresher (the caller holds _beat_lock)."""
        if self._starting_done is not None:
            self._starting_done.set()
            self._starting_done = None

    def close(self, failed: bool = False) -> None:
        with self._beat_lock:
            self._end_refresh()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self.trackers.close(failed)

