"""The ranks' setups end together before their first collective (docs/topology.md, "Setups of different length").

The ranks of a job set up at different speeds: the reporter recovers and verifies the checkpoints, a node reads
its model from a slower disk or regenerates its data on a busier machine. The collectives' timeout
(`topology.timeout_s`) is how long a rank waits for a peer that stopped answering while training: a short one
finds a lost node fast. Without this barrier the first collective after the setup (the drafter ranks' resume
check, the target ranks' first broadcast) waited that same timeout, so setups that ended more than `timeout_s`
apart failed a healthy job at its start.

So each rank beats in the job's store (torchrun's, the one the process group was made with) from the moment
the process group exists, and before its first collective it waits for every rank's `done` as long as each
missing rank keeps beating. A rank that has not beaten for `timeout_s` is gone (its setup died, or its node was
lost): the wait fails naming it. A rank that keeps beating is waited for however long its setup takes, as a
one-process run's own setup is (its `starting` heartbeat is refreshed meanwhile); the waiting rank logs whom
it waits for every `REPORT_S`.
"""

from __future__ import annotations

import threading
import time

from dflash.logs import EVERY_RANK, get_logger

log = get_logger(__name__)

BEAT_S = 2.0  # a rank setting up beats this often
POLL_S = 0.5  # the waiting rank reads the store this often
REPORT_S = 60.0  # ... and says whom it waits for this often
PREFIX = "dflash/setup/"


class SetupPeerLost(RuntimeError):
    """A peer stopped beating during its setup (it died, or its node was lost): a collective_timeout."""

    failure_class = "collective_timeout"


class SetupBarrier:
    """One rank's side: `begin()` right after the process group exists, `wait()` before the first collective
    (again: a no-op). `store` is any torch.distributed Store shared by the `world` ranks."""

    def __init__(self, store, rank: int, world: int, timeout_s: float, beat_s: float = BEAT_S,
                 poll_s: float = POLL_S, report_s: float = REPORT_S) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.timeout_s, self.beat_s, self.poll_s, self.report_s = timeout_s, beat_s, poll_s, report_s
        self.passed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _beat_key(rank: int) -> str:
        return f"{PREFIX}beat/{rank}"

    @staticmethod
    def _done_key(rank: int) -> str:
        return f"{PREFIX}done/{rank}"

    DONE = f"{PREFIX}done"  # how many ranks finished their setup: the one key a waiting rank polls

    def begin(self) -> SetupBarrier:
        self.store.add(self._beat_key(self.rank), 1)
        self._thread = threading.Thread(target=self._beat, name="dflash-setup-beat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self.store.add(self._beat_key(self.rank), 1)
            except Exception:  # noqa: BLE001 - the store's host is gone: the waiting side reports it
                return

    def end(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.beat_s)

    def wait(self) -> None:
        """Return once every rank finished its setup; raise SetupPeerLost when a missing rank stops beating."""
        if self.passed:
            return
        self.store.set(self._done_key(self.rank), "1")
        self.store.add(self.DONE, 1)
        start = last_report = next_look = time.monotonic()
        seen: dict[int, tuple[int, float]] = {}  # rank -> (its beat count, when it last changed here)
        missing = [r for r in range(self.world) if r != self.rank]
        try:
            # one store read per poll; the missing ranks' own keys only once per beat (thousands of ranks wait)
            while int(self.store.add(self.DONE, 0)) < self.world:
                now = time.monotonic()
                if now < next_look:
                    time.sleep(self.poll_s)
                    continue
                next_look = now + self.beat_s
                missing = [r for r in missing if not self.store.check([self._done_key(r)])]
                for r in missing:
                    count = int(self.store.add(self._beat_key(r), 0))
                    if r not in seen or seen[r][0] != count:
                        seen[r] = (count, now)
                    elif now - seen[r][1] > self.timeout_s:
                        raise SetupPeerLost(
                            f"rank {r} stopped during its setup: no sign of it in the job's store for "
                            f"{now - seen[r][1]:.0f}s (timed out after topology.timeout_s={self.timeout_s:g}s); "
                            f"it died or its node was lost: that node's log says why")
                if now - last_report >= self.report_s:
                    last_report = now
                    log.info(f"rank {self.rank}: set up; waiting {now - start:.0f}s so far for rank(s) "
                             f"{_ranks(missing)} to finish their setup", extra=EVERY_RANK)
                time.sleep(self.poll_s)
        finally:
            self.end()
        waited = time.monotonic() - start
        if waited >= self.report_s:
            log.info(f"rank {self.rank}: every rank set up after {waited:.0f}s of waiting", extra=EVERY_RANK)
        self.passed = True


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


_CURRENT: SetupBarrier | None = None


def begin(timeout_s: float) -> SetupBarrier:
    """This process's barrier over the default process group's store (call after init_process_group)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    global _CURRENT
    beat_s = min(BEAT_S, timeout_s / 4)  # a short topology.timeout_s still sees a few beats of a live rank
    _CURRENT = SetupBarrier(_get_default_store(), dist.get_rank(), dist.get_world_size(), timeout_s,
                            beat_s=beat_s).begin()
    return _CURRENT


def wait() -> None:
    """Before a rank's first collective: every rank's setup is done (no-op without a barrier, or once passed)."""
    if _CURRENT is not None:
        _CURRENT.wait()
