# Copyright: dflash authors
# Apache-2.0
"""A per-job deploy lock that lives across tasks: a lock file created with O_EXCL.

A deploy holds it from copying the code until the unit is (re)started, so two deploys of the
same job never interleave: the second waits, then finds the job already deployed. The file
names its owner (a token of the play), when it was taken and the controller process of the deploy
(``controller``: host, boot id, pid and its start time). A deploy that finds the lock held and
its holder's process gone from this controller (killed: Ctrl-C, SIGKILL) takes it over
(``take_over``, decided on the controller: playbooks/action_plugins/dflash_lock.py); a lock older
than ``stale_after`` is broken with a warning. It lives under /run, so a reboot clears it.
"""

from __future__ import annotations

import json
import os
import time
import uuid


class LockError(Exception):
    pass


class LockBusy(LockError):
    """Another owner holds the lock and the caller asked not to wait: ``held`` is its record."""

    def __init__(self, held):
        super().__init__(f"held by {held['holder']}")
        self.held = held


def read_lock(path):
    """``{"owner", "holder", "since"}`` of a held lock (``since`` from the file's mtime if unreadable), or None."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        mtime = os.stat(path).st_mtime
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    data.setdefault("owner", None)
    data.setdefault("holder", "unknown (unreadable lock file)")
    if not isinstance(data.get("since"), (int, float)):
        data["since"] = mtime
    return data


def _try_create(path, record):
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(record, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return True


def _break(path):
    # Rename first: of two deploys breaking the same stale lock, only one succeeds.
    aside = f"{path}.stale-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    os.unlink(aside)


def acquire(path, owner, holder, timeout, stale_after, host, what="deploy", wait=True, take_over=None, controller=None):
    """Take the lock (waiting up to ``timeout`` s). Returns ``(changed, waited_s, broken_lock_or_None)``.

    ``wait=False`` raises LockBusy (with the holder's record) instead of waiting; ``take_over`` is the owner token of
    a lock whose holder is known to be gone: that lock is broken and taken at once (it is returned as broken).
    ``controller`` (a dict) is written into the record for the next deploy to judge whether this one is alive."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    start = host.now()
    broken = None
    while True:
        record = {"owner": owner, "holder": holder, "since": time.time()}
        if controller:
            record["controller"] = controller
        if _try_create(path, record):
            return True, round(host.now() - start, 1), broken
        held = read_lock(path)
        if held is None:
            continue  # released between our two calls
        if held["owner"] == owner:
            return False, round(host.now() - start, 1), broken
        age = time.time() - held["since"]
        if age > stale_after or (take_over and held["owner"] == take_over):
            broken = held
            _break(path)
            continue
        if not wait:
            raise LockBusy(held)
        waited = host.now() - start
        if waited >= timeout:
            raise LockError(
                f"{what} lock {path} is held by {held['holder']} since {age:.0f}s ago: another {what} of this job is "
                f"running; waited {waited:.0f}s. If none is running (it was killed), remove {path}, or wait until the "
                f"lock counts as stale ({stale_after:.0f}s)."
            )
        host.sleep(min(1.0, max(0.1, timeout - waited)))


def release(path, owner):
    """Remove the lock if ``owner`` holds it. Returns ``(changed, holder_of_someone_elses_lock_or_None)``."""
    held = read_lock(path)
    if held is None:
        return False, None
    if held["owner"] != owner:
        return False, held
    os.unlink(path)
    return True, None
