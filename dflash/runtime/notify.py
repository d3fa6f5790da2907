"""Liveness for the supervisor: systemd's sd_notify protocol, one datagram to $NOTIFY_SOCKET per message.

The unit (or the daemon backend's supervisor) sets NOTIFY_SOCKET and a watchdog; the trainer says
`WATCHDOG_USEC=<start-up allowance>` while it loads the target and compiles, `READY=1` with the steady
`WATCHDOG_USEC` once its first step is done, and `WATCHDOG=1` after every step. A trainer that stops sending
(SIGSTOP, a deadlocked collective, a stuck read) is killed and restarted by the supervisor.

Under torchrun the ranks notify their launcher (`RankLiveness`), which tells the supervisor only what is
true of every rank that runs the step loop: one hung rank stops the pings of the whole job.
Without NOTIFY_SOCKET every call is a no-op. A notification that cannot be sent never stops training.
"""

from __future__ import annotations

import os
import socket
import uuid


def _seconds(raw: str | None) -> float:
    try:
        return max(0.0, float(raw)) if raw else 0.0
    except ValueError:
        return 0.0


def _address(name: str) -> str | bytes:
    return "\0" + name[1:] if name.startswith("@") else name  # '@' = the abstract namespace


# module_utils/dflash_supervisor.py's parse_notify is a copy (the supervisor imports only the standard library);
# tests/distributed/test_notify.py checks that the two read datagrams alike.
def parse(data: bytes) -> dict[str, str]:
    fields = {}
    for line in data.decode(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key] = value
    return fields


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET") or None
        self.interval = _seconds(env.get("DFLASH_WATCHDOG_SEC"))  # steady: per step
        self.start_interval = max(_seconds(env.get("DFLASH_WATCHDOG_START_SEC")), self.interval)
        self.rank = env.get("RANK") if env.get("DFLASH_NOTIFY_RANKS") == "1" else None
        self.ready = False
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: object) -> bool:
        if self.address is None:
            return False
        lines = [f"{key}={value}" for key, value in fields.items()]
        if self.rank is not None:
            lines.append(f"DFLASH_RANK={self.rank}")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.sendto("\n".join(lines).encode(), _address(self.address))
            return True
        except OSError:
            return False

    def loading(self) -> None:
        """Start-up: the first interval is long enough to load the target and compile."""
        if self.start_interval:
            self.send(WATCHDOG_USEC=int(self.start_interval * 1e6), STATUS="loading")

    def step(self, step: int) -> None:
        if not self.ready:
            self.ready = True
            fields: dict[str, object] = {"READY": 1}
            if self.interval:
                fields["WATCHDOG_USEC"] = int(self.interval * 1e6)
            self.send(**fields, WATCHDOG=1, STATUS=f"training, step {step}")
        else:
            self.send(WATCHDOG=1, STATUS=f"training, step {step}")

    def stopping(self) -> None:
        self.send(STOPPING=1)


class RankLiveness:
    """The launcher's side under torchrun: a socket its ranks notify, aggregated for the supervisor.

    READY once every expected rank is ready; after that one WATCHDOG=1 each time every expected rank has
    pinged since the last one."""

    def __init__(self, upstream: Notifier, expected: set[int]) -> None:
        self.upstream, self.expected = upstream, set(expected)
        self.name = f"@dflash-ranks-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(_address(self.name))
        self.sock.setblocking(False)
        self.ready: set[int] = set()
        self.pinged: set[int] = set()
        self.last_step = 0

    def environment(self) -> dict[str, str]:
        """For the ranks: notify the launcher, name yourself."""
        return {"NOTIFY_SOCKET": self.name, "DFLASH_NOTIFY_RANKS": "1"}

    def poll(self) -> None:
        while True:
            try:
                fields = parse(self.sock.recv(4096))
            except (BlockingIOError, InterruptedError):
                break
            try:
                rank = int(fields.get("DFLASH_RANK", ""))
            except ValueError:
                continue
            if fields.get("READY") == "1":
                self.ready.add(rank)
            if fields.get("WATCHDOG") == "1":
                self.pinged.add(rank)
            step = fields.get("STATUS", "").rpartition(" ")[2]
            if step.isdigit():
                self.last_step = max(self.last_step, int(step))
        if not self.upstream.ready:
            if self.expected <= self.ready:
                self.upstream.step(self.last_step)
                self.pinged.clear()
        elif self.expected <= self.pinged:
            self.upstream.send(WATCHDOG=1, STATUS=f"training, step {self.last_step}")
            self.pinged.clear()

    def close(self) -> None:
        self.sock.close()
