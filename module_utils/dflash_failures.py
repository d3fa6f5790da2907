# Copyright: dflash authors
# Apache-2.0
"""The trainer's failure classes (the same table as dflash/runtime/failures.py, which module_utils cannot import; a test
checks they are equal) and the restart policy per class of the unit (both backends).
"""

from __future__ import annotations

# A copy on purpose of dflash/runtime/failures.py's table (module_utils cannot import dflash): tests/test_failure_classes.py
# checks the two are equal. class -> exit code. 0 is success; 128+N (a signal, shell-style) is `signal`.
EXIT_CODES = {
    "unknown": 1,
    "bad_input": 2,
    "data_error": 3,
    "cuda_oom": 4,
    "collective_timeout": 5,
    "gpu_error": 6,
}
SIGNAL = "signal"  # killed by a signal: exit status 128+N

# never: the unit stays failed (the input, the data or the GPU does not fix itself); once: restarted at most once
# per launch, then it stays failed (systemd: the exit recorder stops the unit at the second such end; the daemon
# backend: its supervisor); always: restarted (within the burst), like any other failure.
POLICIES = ("never", "once", "always")
DEFAULT_POLICY = {
    "bad_input": "never",
    "data_error": "never",
    "gpu_error": "never",
    "cuda_oom": "once",
    "collective_timeout": "always",
    "unknown": "always",
}


class PolicyError(ValueError):
    pass


def class_of_exit(status):
    """The class of a shell-style exit status (None for a success or no status)."""
    if status is None or status == 0:
        return None
    if status >= 128:
        return SIGNAL
    return next((name for name, code in EXIT_CODES.items() if code == status), "unknown")


def restart_policy(given=None):
    """The policy per class: the defaults with ``given`` on top, checked."""
    policy = dict(DEFAULT_POLICY)
    for cls, value in (given or {}).items():
        if cls not in DEFAULT_POLICY:
            raise PolicyError(f"restart_policy: unknown failure class {cls!r}; use {', '.join(DEFAULT_POLICY)}")
        if value not in POLICIES:
            raise PolicyError(f"restart_policy: {cls}: {value!r} is not one of {', '.join(POLICIES)}")
        policy[cls] = value
    return policy


def codes_with(policy, value):
    """The exit codes whose class has this policy (sorted); `unknown` stands for 1 alone."""
    return sorted(EXIT_CODES[cls] for cls, v in restart_policy(policy).items() if v == value)
