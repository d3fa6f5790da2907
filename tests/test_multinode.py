"""The nodes of one job meet in node 0's presence store (dflash/runtime/multinode.py): each writes its node file, and a
failed job names the node it lost first — one whose ranks ended, one that vanished, or node 0 itself."""

from __future__ import annotations

import json
import socket
import time

import pytest

from dflash.runtime import multinode
from dflash.runtime.multinode import NodePresence


class Liveness:
    """What RankLiveness tells the launcher: which local ranks finished a step, the latest step."""

    def __init__(self):
        self.expected, self.ready, self.last_step = {0}, set(), 0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1] - 1  # the presence store listens on master_port + 1


def wait_until(predicate, timeout=300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


@pytest.fixture
def two_nodes(tmp_path, monkeypatch):
    port = free_port()
    nodes = []
    for rank, name in enumerate(("alpha", "beta")):
        monkeypatch.setenv(multinode.ENV_NODE_NAME, name)
        nodes.append(NodePresence(str(tmp_path), 2, rank, "127.0.0.1", port, 1, 2, 10))
    wait_until(lambda: all(len(n.names) == 2 for n in nodes))
    yield nodes
    for node in nodes:
        node.close()


def read(tmp_path, rank):
    return json.loads((tmp_path / "nodes" / f"node-{rank}.json").read_text())


def test_nodes_join_and_report_every_rank_joined(tmp_path, two_nodes):
    zero, one = two_nodes
    assert read(tmp_path, 1)["status"] == "waiting"
    liveness = Liveness()
    for node in two_nodes:
        node.poll(1, liveness)  # torchrun started this node's worker: the rendezvous is complete
    assert read(tmp_path, 0)["joined"] and not read(tmp_path, 0)["all_joined"]
    liveness.ready, liveness.last_step = {0}, 1
    for node in two_nodes:
        node.poll(1, liveness)
    state = read(tmp_path, 1)
    assert state["status"] == "training" and state["all_joined"] and state["step"] == 1
    assert state["nodes"] == {"0": "alpha", "1": "beta"} and state["pid"] > 0


def test_the_node_whose_ranks_ended_first_is_the_lost_one(tmp_path, two_nodes):
    zero, one = two_nodes
    for node in two_nodes:
        node.poll(1, None)
    one.poll(0, None)  # node 1's rank died; node 0's fail 2 s later (PEER_FAILURE_DELAY_S)
    wait_until(lambda: 1 in zero.ended)
    time.sleep(multinode.TIE_S)
    message = zero.finish(1)
    assert message == "lost node 1 (beta): 1 of its 1 rank(s) ended; this node's ranks failed after it"
    state = read(tmp_path, 0)
    assert state["status"] == "failed" and state["lost_node"] == 1 and state["lost_node_name"] == "beta"
    assert one.finish(1).startswith("node 1 (beta) (this node) failed first: 1 of its 1 rank(s) ended")


def test_a_node_that_vanished_is_lost_when_it_stops_beating(tmp_path, two_nodes):
    zero, one = two_nodes
    for node in two_nodes:
        node.poll(1, None)
    one.close()  # its launcher is gone with its ranks: no record, the beats stop
    time.sleep(multinode.STALE_S + multinode.BEAT_S)
    message = zero.finish(1)
    assert message.startswith("lost node 1 (beta): it stopped answering ")


def test_node_0_is_lost_when_its_store_stops_answering(tmp_path, two_nodes):
    zero, one = two_nodes
    for node in two_nodes:
        node.poll(1, None)
    zero.close()  # node 0's launcher hosted the store
    del zero
    wait_until(lambda: one.store_lost_at is not None)
    time.sleep(multinode.TIE_S)
    assert one.finish(1).startswith("lost node 0 (alpha): its presence store stopped answering")


def test_ranks_that_failed_together_are_not_blamed_on_a_peer(tmp_path, two_nodes):
    zero, one = two_nodes
    for node in two_nodes:
        node.poll(1, None)
    one.poll(0, None)
    zero.poll(0, None)  # the same moment: one cause on every node (a bad batch), not a lost peer
    wait_until(lambda: 1 in zero.ended)
    assert "(this node) failed first" in zero.finish(1)


def test_a_clean_exit_names_nobody(tmp_path, two_nodes):
    zero, _ = two_nodes
    assert zero.finish(0) is None and read(tmp_path, 0)["status"] == "exited"
