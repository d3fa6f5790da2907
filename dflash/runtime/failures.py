"""Failure classes: every end of the trainer is one class, with one exit code (docs/operations.md, "Self-healing").

Plain Python, no torch at import: module_utils/dflash_failures.py holds the same table for the unit's restart
policy (it cannot import dflash); tests/test_failure_classes.py checks that the two tables are equal.
"""

from __future__ import annotations

import os
import re

from dflash.errors import DflashError

# class -> exit code. 0 is success; 128+N (a signal, shell-style) is `signal`.
EXIT_CODES = {
    "unknown": 1,
    "bad_input": 2,
    "data_error": 3,
    "cuda_oom": 4,
    "collective_timeout": 5,
    "gpu_error": 6,
}
SIGNAL = "signal"  # killed by a signal: exit status 128+N
CLASSES = (*EXIT_CODES, SIGNAL)
# What the trainer turns into a ClassifiedFailure (the others are errors of their own already, or unknown).
RAISED_CLASSES = ("cuda_oom", "collective_timeout", "gpu_error")

# Messages of CUDA faults that a restart on the same GPU does not cure (the driver's Xid errors behind them).
GPU_ERROR_PATTERNS = re.compile(
    r"illegal memory access|uncorrectable ECC|ECC error|unspecified launch failure|Xid|GPU is lost|fallen off the bus|"
    r"misaligned address|device-side assert|CUDA error: (?!out of memory)|CUDA driver error|NCCL.*unhandled cuda error",
    re.IGNORECASE)
# torch.distributed's words for a collective or store operation that waited too long (gloo, NCCL's watchdog).
TIMEOUT_PATTERNS = re.compile(r"timed out|timeout|Watchdog caught collective operation", re.IGNORECASE)


def class_of_exit(status: int | None) -> str | None:
    """The class of a shell-style exit status (None for a success or no status)."""
    if status is None or status == 0:
        return None
    if status >= 128:
        return SIGNAL
    return next((name for name, code in EXIT_CODES.items() if code == status), "unknown")


def classify(exc: BaseException) -> str:
    """The class of an exception that ended the trainer."""
    from dflash.errors import BadInput, DataError

    if isinstance(exc, DataError):
        return "data_error"
    if isinstance(exc, BadInput):
        return "bad_input"
    known = getattr(exc, "failure_class", None)
    if known in EXIT_CODES:
        return known
    names = {cls.__name__ for cls in type(exc).__mro__}
    text = f"{type(exc).__name__}: {exc}"
    if "OutOfMemoryError" in names or "CUDA out of memory" in text:
        return "cuda_oom"
    if GPU_ERROR_PATTERNS.search(text) or "AcceleratorError" in names:
        return "gpu_error"
    if "DistBackendError" in names or "DistStoreError" in names or (
            isinstance(exc, RuntimeError | TimeoutError) and TIMEOUT_PATTERNS.search(text)):
        return "collective_timeout"
    return "unknown"


def gpu_name() -> str:
    """The GPU this process used: its CUDA device index (LOCAL_RANK under torchrun) and the visible devices."""
    local = os.environ.get("LOCAL_RANK", "0")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"cuda:{local}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")


def describe(cls: str, exc: BaseException, config=None) -> str:
    """One line: the class, what happened and the fix."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if cls == "cuda_oom":
        budget = f" (now {config.data.token_budget})" if config is not None else ""
        limit = f" (now {config.data.max_length})" if config is not None else ""
        return (f"cuda_oom: CUDA out of memory: lower data.token_budget{budget} or data.max_length{limit} "
                f"({text})")
    if cls == "gpu_error":
        return f"gpu_error on {gpu_name()}: {text}; the job is stopped: check that GPU (nvidia-smi, Xid in dmesg)"
    if cls == "collective_timeout":
        return f"collective_timeout: {text}"
    return f"{cls}: {text}"


class ClassifiedFailure(DflashError):
    """A failure of a known class, its message naming the fix (raised from the exception it classifies)."""

    def __init__(self, failure_class: str, message: str):
        super().__init__(message)
        self.failure_class = failure_class


# A torchrun worker's class, for its launcher (torchrun itself exits 1 whichever rank failed, however it failed).
RANK_FAILURES_DIR = "failures"


def write_rank_failure(output_dir: str, rank: int, cls: str, message: str) -> None:
    import json
    import time

    directory = os.path.join(output_dir, RANK_FAILURES_DIR)
    try:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"rank-{rank}.json"), "w") as handle:
            json.dump({"rank": rank, "failure_class": cls, "error": message, "time": time.time()}, handle)
    except OSError:
        pass  # a full disk: the launcher reports the job's failure without its class


def first_rank_failure(output_dir: str) -> dict | None:
    """The earliest failure a rank of this launch recorded (its class, rank and message), or None."""
    import json

    directory = os.path.join(output_dir, RANK_FAILURES_DIR)
    records = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        try:
            with open(os.path.join(directory, name)) as handle:
                record = json.load(handle)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("failure_class") in EXIT_CODES:
            records.append(record)
    return min(records, key=lambda r: r.get("time") or 0.0, default=None)


def clear_rank_failures(output_dir: str) -> None:
    import shutil

    shutil.rmtree(os.path.join(output_dir, RANK_FAILURES_DIR), ignore_errors=True)
