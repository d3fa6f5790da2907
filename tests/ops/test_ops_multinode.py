"""One multi-node job across its containers: the worst node's state, every rank joined or not, the lost node.
The events carry dflash_health results as the module returns them for two nodes of one job."""

from __future__ import annotations

import io

from rich.console import Console

from dflash.ops.cli import render
from dflash.ops.results import EventCollector

NODES = ["mn-0", "mn-1"]


def health_event(host, state, all_joined, lost=None, step=None, healthy=True):
    unit = {"backend": "systemd", "active_state": "active" if healthy else "failed", "sub_state": "running",
            "main_pid": 100 if healthy else 0, "exit_status": None if healthy else 1}
    res = {"healthy": healthy, "state": state, "ok": healthy, "unit": unit, "step": step, "failed_invariants": [],
           "job": "dflash-mn", "nodes": NODES, "all_joined": all_joined, "lost_node": lost,
           "node": {"node_rank": NODES.index(host), "nnodes": 2, "status": "training" if healthy else "failed"}}
    return {"event": "runner_on_ok", "event_data": {"host": host, "task": "job : Read the job's health",
                                                     "resolved_action": "dflash_health", "res": res}}


def collect(*events):
    collector = EventCollector()
    for event in events:
        collector.add(event)
    return collector.result("status", "status.yml", "inv", "successful", 0)


def test_a_training_job_across_two_nodes_is_one_job():
    result = collect(health_event("mn-0", "training", True, step=40), health_event("mn-1", "training", True, step=39))
    [job] = result.jobs
    assert job.name == "dflash-mn" and job.nodes == NODES and job.state == "training" and job.all_joined
    assert job.step == 40 and job.lost_node is None  # node 0's step: its reporter trains the job's steps
    assert result.containers["mn-1"].node_rank == 1
    assert "job dflash-mn on 2 nodes: training, all ranks joined: yes, step 40" in result.message


def test_the_worst_node_and_the_lost_node_speak_for_the_job():
    result = collect(health_event("mn-0", "crashed", False, lost="mn-1", step=30, healthy=False),
                     health_event("mn-1", "crashed", False, step=30, healthy=False))
    [job] = result.jobs
    assert job.state == "crashed" and not job.all_joined and job.lost_node == "mn-1"
    out = io.StringIO()
    render(result, Console(file=out, width=200), show_logs=False)
    assert "job dflash-mn on 2 nodes: crashed, all ranks joined: no, step 30, lost node: mn-1" in out.getvalue()


def test_a_node_the_run_did_not_reach_is_named():
    result = collect(health_event("mn-0", "starting", False, step=None))
    [job] = result.jobs
    assert job.missing == ["mn-1"] and not job.all_joined and job.state == "starting"


def test_single_node_jobs_are_no_multi_node_job():
    event = health_event("mn-0", "training", None)
    for key in ("node", "all_joined"):
        event["event_data"]["res"][key] = None
    event["event_data"]["res"]["nodes"] = []
    assert collect(event).jobs == []
