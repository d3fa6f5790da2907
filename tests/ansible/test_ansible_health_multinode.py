"""Health of a multi-node job on real files: every rank joined, the node that did not join, the lost node, and a
node other than 0 whose heartbeat is its node file (dflash/runtime/multinode.py writes it)."""

from __future__ import annotations

import json
import os
import time

from ansible.module_utils.dflash_health import check_health
from ansible.module_utils.dflash_host import LocalHost
from test_ansible_health import ACTIVE, Trainer, params, write_heartbeat

NODES = ["mn-a", "mn-b"]


def write_node(tmp_path, rank, status, step=0, age=0.0, **extra):
    data = {"node_rank": rank, "nnodes": 2, "node": NODES[rank], "pid": os.getpid(), "time": time.time() - age,
            "status": status, "step": step, "joined": status != "waiting", "all_joined": status == "training",
            "missing": [], "nodes": {"0": NODES[0], "1": NODES[1]}, **extra}
    path = tmp_path / "nodes" / f"node-{rank}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(data))
    return str(path)


def node_params(tmp_path, rank, **kw):
    return params(tmp_path, node_heartbeat_path=str(tmp_path / "nodes" / f"node-{rank}.json"), node_rank=rank,
                  nodes=NODES, **kw)


def test_node_0_is_healthy_when_every_rank_joined(tmp_path):
    write_node(tmp_path, 0, "training", step=1)
    trainer = Trainer(tmp_path)
    trainer.start()
    try:
        result = check_health(LocalHost(), node_params(tmp_path, 0), lambda: dict(ACTIVE))
    finally:
        trainer.running = False
    assert result["healthy"] and result["all_joined"] is True, result["diagnosis"]
    assert "node: 0 of 2 (mn-a), status training, all ranks joined: yes" in result["diagnosis"]


def test_node_0_names_the_node_that_did_not_join(tmp_path):
    write_node(tmp_path, 0, "waiting", missing=[1])
    (tmp_path / "job.log").write_text("dflash: starting 2 ranks (1 on this node)\n")
    launched = {**ACTIVE, "started_at": time.time() - 5}
    result = check_health(LocalHost(), node_params(tmp_path, 0, progress_window=2, timeout=4), lambda: dict(launched))
    assert not result["healthy"] and "joined" in result["failed_invariants"] and result["all_joined"] is False
    reasons = {f["invariant"]: f["reason"] for f in result["failures"]}
    assert reasons["joined"].startswith("rendezvous incomplete after ")
    assert "node 1 (mn-b) did not join (never reached the rendezvous on node 0 (mn-a))" in reasons["joined"]


def test_a_waiting_node_names_the_rendezvous_host(tmp_path):
    write_node(tmp_path, 1, "waiting")
    (tmp_path / "job.log").write_text("dflash: starting 2 ranks (1 on this node)\n")
    launched = {**ACTIVE, "started_at": time.time() - 5}
    result = check_health(LocalHost(), node_params(tmp_path, 1, progress_window=2, timeout=3), lambda: dict(launched))
    reasons = {f["invariant"]: f["reason"] for f in result["failures"]}
    assert "node 1 (mn-b) is waiting" in reasons["joined"] and "on node 0 (mn-a)" in reasons["joined"]
    assert "log" not in reasons  # a node other than 0 writes no step lines


def test_other_node_progress_comes_from_its_node_file(tmp_path):
    # node 0's reporter wrote the shared heartbeat: not a process of this node's unit, not its evidence
    write_heartbeat(tmp_path / "heartbeat.json", 50, pid=1)
    (tmp_path / "job.log").write_text("dflash: all 2 ranks joined\n")
    os.utime(tmp_path / "job.log", (time.time() - 600, time.time() - 600))
    write_node(tmp_path, 1, "training", step=40, age=0.5)
    result = check_health(LocalHost(), node_params(tmp_path, 1, timeout=0, progress_window=30), lambda: dict(ACTIVE))
    assert result["healthy"] and result["step"] == 40 and result["state"] == "training", result["diagnosis"]
    write_node(tmp_path, 1, "training", step=40, age=60)  # the node's ranks stopped stepping
    result = check_health(LocalHost(), node_params(tmp_path, 1, timeout=0, progress_window=30), lambda: dict(ACTIVE))
    assert not result["healthy"] and "progress" in result["failed_invariants"]


def test_the_survivor_names_the_lost_node(tmp_path):
    error = "lost node 1 (mn-b): it stopped answering 1.6s ago; this node's ranks failed after it"
    write_node(tmp_path, 0, "failed", step=30, error=error, lost_node=1, lost_node_name="mn-b")
    write_heartbeat(tmp_path / "heartbeat.json", 30, status="failed")
    (tmp_path / "job.log").write_text(f"dflash: error: the distributed job failed (torchrun exit 1): {error}\n")
    dead = {**ACTIVE, "active_state": "failed", "sub_state": "failed", "main_pid": 0, "exit_status": 1,
            "started_at": time.time() - 60}
    result = check_health(LocalHost(), node_params(tmp_path, 0, timeout=0), lambda: dict(dead))
    assert result["state"] == "crashed" and result["lost_node"] == "mn-b"
    assert f"node: 0 of 2 (mn-a), status failed, all ranks joined: no, {error}" in result["diagnosis"]


def test_a_node_file_of_an_earlier_launch_is_not_evidence(tmp_path):
    write_node(tmp_path, 1, "training", step=10, age=30)
    (tmp_path / "job.log").write_text("x\n")
    launched = {**ACTIVE, "started_at": time.time() - 2}
    result = check_health(LocalHost(), node_params(tmp_path, 1, timeout=0, progress_window=30), lambda: dict(launched))
    reasons = {f["invariant"]: f["reason"] for f in result["failures"]}
    assert "not this launch's" in reasons["joined"] and result["step"] is None


def test_ranks_loading_after_the_rendezvous_are_starting_until_the_start_up_allowance(tmp_path):
    """Every node joined and the ranks load the models (no step yet) for longer than the progress window: on
    node 0 (its trainer refreshes `starting`) and on node 1 (its node file is the heartbeat) that reads
    `starting`, not `hung`, until the start-up allowance has passed."""
    write_heartbeat(tmp_path / "heartbeat.json", 0, status="starting", age=5)
    (tmp_path / "job.log").write_text("dflash: rendezvous complete\n")
    os.utime(tmp_path / "job.log", (time.time() - 100, time.time() - 100))
    launched = {**ACTIVE, "started_at": time.time() - 100}
    for rank in (0, 1):
        write_node(tmp_path, rank, "joined", age=90)
        result = check_health(LocalHost(), node_params(tmp_path, rank, timeout=0, progress_window=30, start_window=600),
                              lambda: dict(launched))  # fmt: skip
        reasons = {f["invariant"]: f["reason"] for f in result["failures"]}
        assert result["state"] == "starting" and result["ok"], (rank, result["diagnosis"])
        assert "start-up allowance 600s" in reasons["joined"], reasons

    beyond = {**ACTIVE, "started_at": time.time() - 700}
    for rank in (0, 1):
        write_node(tmp_path, rank, "joined", age=690)
        result = check_health(LocalHost(), node_params(tmp_path, rank, timeout=0, progress_window=30, start_window=600),
                              lambda: dict(beyond))  # fmt: skip
        assert result["state"] == "hung" and not result["ok"], (rank, result["diagnosis"])
