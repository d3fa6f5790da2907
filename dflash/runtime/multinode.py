"""One job across several nodes: who joined, who was lost (docs/topology.md#multi-node).

Every node's launcher (`dflash train` with `topology.nnodes > 1`) keeps a small presence record in a TCP
store hosted by node 0's launcher on `topology.master_port + 1` (the rendezvous itself uses
`master_port`): its name, a beat every `BEAT_S`, and the time its ranks ended. It also writes this
node's state to `OUTPUT_DIR/nodes/node-<rank>.json` for the health check:

* `status`: `waiting` (the rendezvous is not complete: `missing` names the nodes node 0 has not heard
  from), `joined` (torchrun started this node's workers: every node came to the rendezvous),
  `training` (every rank of this node finished a step, so all ranks of the job joined: `all_joined`),
  `exited` (torchrun exited 0: finished, or stopped on purpose), `failed` (with `error` and `lost_node`);
* `step`: the latest step this node's ranks reported, `pid`: the launcher (the unit's MainPID).

When the job fails, the node whose ranks ended first is the lost one: a node whose ranks were killed
ends before its peers, which fail only after `PEER_FAILURE_DELAY_S`; a node that vanished entirely
stops beating, and a vanished node 0 takes the store with it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

BEAT_S = 0.5  # presence beat and store reads
STALE_S = 1.5  # a node that has not beaten for this long is gone
SETTLE_S = 3.0  # after this node's ranks ended: time for the other nodes' records to arrive
TIE_S = 0.5  # ranks that ended this close together failed of one cause, not one of a lost peer (2 s later)
ENV_NODE_NAME = "DFLASH_NODE_NAME"
ENV_RUN_ID = "DFLASH_RUN_ID"


def node_name() -> str:
    return os.environ.get(ENV_NODE_NAME) or socket.gethostname()


def run_id(output_dir: str) -> str:
    """The rendezvous id: DFLASH_RUN_ID, else the name of the (shared) output directory, the same on every node."""
    return os.environ.get(ENV_RUN_ID) or Path(output_dir).name or "dflash"


def describe(rank: int, name: str | None) -> str:
    return f"node {rank} ({name})" if name else f"node {rank}"


class NodePresence:
    """This node's side of the presence store, and its node file."""

    def __init__(self, output_dir: str, nnodes: int, node_rank: int, master_addr: str, master_port: int,
                 nproc: int, world_size: int, timeout_s: int) -> None:
        self.nnodes, self.rank, self.nproc, self.world = nnodes, node_rank, nproc, world_size
        self.addr, self.port, self.timeout_s = master_addr, master_port + 1, timeout_s
        self.name, self.run_id = node_name(), run_id(output_dir)
        self.path = Path(output_dir) / "nodes" / f"node-{node_rank}.json"
        self.prefix = f"dflash/{self.run_id}/"
        self.lock = threading.Lock()
        self.names: dict[int, str] = {node_rank: self.name}
        self.beats: dict[int, float] = {}
        self.ended: dict[int, tuple[float, str]] = {}
        self.store_lost_at: float | None = None
        self.own_end: tuple[float, str] | None = None
        self.state = {"node_rank": node_rank, "nnodes": nnodes, "node": self.name, "run_id": self.run_id,
                      "pid": os.getpid(), "status": "waiting", "step": 0, "joined": False, "all_joined": False,
                      "world_size": world_size, "missing": [], "lost_node": None, "error": None}
        self._had_workers = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-presence", daemon=True)
        self.write()
        self._thread.start()

    # --- the store, in its own thread: connecting may wait for node 0 ---------------------------------
    def _key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def _connect(self):
        from torch.distributed import TCPStore

        deadline = time.monotonic() + self.timeout_s
        while not self._stop.is_set():
            try:
                return TCPStore(self.addr, self.port, None, self.rank == 0, timedelta(seconds=10),
                                wait_for_workers=False, multi_tenant=True)
            except (RuntimeError, OSError, ValueError) as exc:
                if self.rank == 0 or time.monotonic() > deadline:
                    with self.lock:
                        self.state["error"] = f"presence store {self.addr}:{self.port}: {exc}"
                    return None
                time.sleep(BEAT_S)
        return None

    def _run(self) -> None:
        store = self._connect()
        if store is None:
            return
        try:
            store.set(self._key("name", self.rank), self.name)
            published_end = False
            while True:
                with self.lock:
                    own_end = self.own_end
                if own_end is not None and not published_end:
                    store.set(self._key("ended", self.rank), f"{own_end[0]}|{own_end[1]}")
                    published_end = True
                store.set(self._key("beat", self.rank), str(time.time()))
                self._read(store)
                if self._stop.wait(BEAT_S):
                    return
        except (RuntimeError, OSError, ValueError):
            if self.rank != 0:  # node 0 hosts the store: an error here means node 0 is gone
                with self.lock:
                    self.store_lost_at = time.time()

    def _read(self, store) -> None:
        for other in range(self.nnodes):
            if other == self.rank:
                continue
            keys = {kind: self._key(kind, other) for kind in ("name", "beat", "ended")}
            found = {kind: store.get(key).decode() for kind, key in keys.items() if store.check([key])}
            with self.lock:
                if "name" in found:
                    self.names[other] = found["name"]
                if "beat" in found:
                    self.beats[other] = float(found["beat"])
                if "ended" in found and other not in self.ended:
                    at, _, reason = found["ended"].partition("|")
                    self.ended[other] = (float(at), reason)

    # --- the launcher's loop ---------------------------------------------------------------------------
    def poll(self, workers: int, liveness) -> None:
        """Called from the launcher's wait loop: this node's worker count and its ranks' liveness."""
        now = time.time()
        changed = False
        with self.lock:
            st = self.state
            if workers >= self.nproc and not self._had_workers:
                self._had_workers = True
                st.update(status="joined", joined=True, joined_at=now)
                changed = True
                print(f"dflash: rendezvous complete (run id {self.run_id}): {self.nnodes} nodes, {self.world} ranks; "
                      f"{describe(self.rank, self.name)} runs ranks {self.rank * self.nproc}.."
                      f"{(self.rank + 1) * self.nproc - 1}", flush=True)
            elif self._had_workers and workers < self.nproc and self.own_end is None:
                self.own_end = (now, f"{self.nproc - workers} of its {self.nproc} rank(s) ended")
            if liveness is not None:
                if not st["all_joined"] and liveness.expected <= liveness.ready:
                    st.update(status="training", all_joined=True, all_joined_at=now)
                    changed = True
                    print(f"dflash: all {self.world} ranks joined: every rank of {describe(self.rank, self.name)} "
                          f"finished step {liveness.last_step}", flush=True)
                if liveness.last_step != st["step"]:
                    st["step"] = liveness.last_step
                    changed = True
            if self.rank == 0 and not self._had_workers:
                missing = [r for r in range(1, self.nnodes) if r not in self.names]
                if missing != st["missing"]:
                    st["missing"] = missing
                    changed = True
        if changed:  # its time is the last change: a step that stays put ages like the trainer's heartbeat
            self.write()

    def write(self) -> None:
        from dflash.runtime.observability import atomic_write_json

        with self.lock:
            data = {**self.state, "time": time.time(), "nodes": {str(r): n for r, n in sorted(self.names.items())}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.path, data)
        except OSError as exc:
            print(f"dflash: warning: cannot write the node file {self.path}: {exc}", flush=True)

    def lost_node(self) -> tuple[int | None, str]:
        """After this node's ranks failed: (the node lost first or None for this node, why)."""
        with self.lock:
            if self.own_end is None:
                self.own_end = (time.time(), "its torchrun failed")
        deadline = time.monotonic() + SETTLE_S
        while True:
            with self.lock:
                now = time.time()
                ends = {self.rank: self.own_end}
                for other in range(self.nnodes):
                    if other == self.rank:
                        continue
                    if other in self.ended:
                        ends[other] = self.ended[other]
                    elif other == 0 and self.store_lost_at is not None:
                        ends[other] = (self.store_lost_at - BEAT_S, "its presence store stopped answering")
                    elif other in self.beats and now - self.beats[other] > STALE_S:
                        ends[other] = (self.beats[other], f"it stopped answering {now - self.beats[other]:.1f}s ago")
                    elif other not in self.beats:
                        ends[other] = (0.0, "it never joined")
                settled = len(ends) == self.nnodes
            if settled or time.monotonic() > deadline:
                break
            time.sleep(BEAT_S / 2)
        first = min(ends, key=lambda r: ends[r][0])
        if first != self.rank and ends[self.rank][0] - ends[first][0] < TIE_S:
            return None, f"{ends[self.rank][1]}, as did {describe(first, self.names.get(first))}'s at the same time"
        return (None if first == self.rank else first), ends[first][1]

    def finish(self, rc: int) -> str | None:
        """Record the end in the node file; for a failure, the line naming the lost node."""
        message = None
        with self.lock:
            self.state["status"] = "exited" if rc == 0 else "failed"
        if rc != 0:
            lost, why = self.lost_node()
            if lost is None:
                message = (f"{describe(self.rank, self.name)} (this node) failed first: {why}; its failing rank "
                           "is in torchrun's error summary above")
            else:
                message = f"lost {describe(lost, self.names.get(lost))}: {why}; this node's ranks failed after it"
            with self.lock:
                self.state.update(error=message, lost_node=lost if lost is not None else self.rank,
                                  lost_node_name=self.names.get(lost if lost is not None else self.rank))
        self.write()
        return message

    def stopping(self) -> None:
        """A stop on purpose: nodes other than 0 leave the store now, before node 0 (its host) exits."""
        if self.rank != 0:
            self._stop.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * BEAT_S)
