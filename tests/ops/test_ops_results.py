"""Typed results from replays of recorded ansible-runner event streams: a launch that trains, a failed health
check, an unreachable host, logs and stop. The streams were recorded once by tests/ops/record_events.py (some in
LXC containers, some on a GPU machine); these tests feed them to the result collector and run no ansible, no
container and no GPU themselves."""

from __future__ import annotations

import io
import json

import pytest
from ops_replay import load, replay
from rich.console import Console

from dflash.ops import OpsFailed
from dflash.ops.progress import RichProgress
from dflash.ops.results import EventCollector, derive_state, failure_message, module_name


def test_the_recordings_are_runner_event_streams():
    for name in ("deploy_success", "deploy_health_failed", "status_unreachable", "stop", "logs", "status_lxc_systemd"):
        kinds = {e["event"] for e in load(name)["events"]}
        assert {"playbook_on_play_start", "playbook_on_task_start", "playbook_on_stats"} <= kinds
        assert kinds & {"runner_on_ok", "runner_on_failed", "runner_on_unreachable"}


def test_replay_a_launch_that_trains():
    result = replay("deploy_success")
    assert result.ok and result.failures == [] and result.error is None
    job = result.containers["dflash-fixture"]
    assert job.state == "training" and job.reachable
    assert job.backend == "daemon" and job.unit_state == "active" and job.sub_state == "running"
    assert isinstance(job.pid, int) and job.pid > 1
    assert job.action == "started" and job.exit_status is None
    assert job.healthy is True and job.failed_invariants == []
    assert job.step >= 1 and job.tokens_per_s > 0 and job.tau >= 1.0
    assert job.gpus == []  # a CPU job: dflash_gpu_facts found no GPU
    assert any(line.startswith("step ") for line in job.log_tail)
    assert result.message.startswith("deploy ok: dflash-fixture training, step ")
    assert result.stats["ok"]["dflash-fixture"] > 10 and result.stats["failures"] == {}


def test_replay_a_failed_health_check_names_task_host_and_the_trainers_error():
    result = replay("deploy_health_failed")
    assert not result.ok and result.status == "failed" and result.rc == 2
    [failure] = result.failures
    assert failure.host == "dflash-fixture" and failure.task == "job : Assert that the trainer trains"
    assert failure.module == "dflash_health" and not failure.unreachable
    assert "dflash: error: optim.lr" in failure.diagnosis
    job = result.containers["dflash-fixture"]
    assert job.failure is failure
    assert job.state == "failed" and job.healthy is False and "unit" in job.failed_invariants
    assert job.exit_status == 2 and job.unit_state in ("failed", "inactive")
    assert job.action in ("started", "restarted")  # the config changed: the restart sequence ran
    message = result.message
    assert message.startswith("deploy failed: task 'job : Assert that the trainer trains' failed on dflash-fixture: ")
    assert "unit failed" in message and "exit status 2" in message
    assert "last error in the log: dflash: error: optim.lr: expected a number, got 'fast'" in message
    assert "\n" not in message


def test_replay_an_unreachable_host_fails_the_operation_and_the_other_host_still_reports():
    result = replay("status_unreachable")
    assert not result.ok
    [failure] = result.failures
    assert failure.unreachable and failure.host == "dflash-gone"
    assert failure.task == "job : Read the job's health"
    assert "port 1" in failure.message and "Connection refused" in failure.message
    gone = result.containers["dflash-gone"]
    assert gone.state == "unreachable" and not gone.reachable and gone.pid is None
    assert result.message.startswith("status failed: dflash-gone is unreachable (task 'job : Read the job's health'): ")
    assert result.stats["dark"] == {"dflash-gone": 1}
    job = result.containers["dflash-fixture"]
    assert job.state == "training" and job.failure is None and job.pid and job.step is not None


def test_replay_logs_last_lines_and_a_follow_read():
    job = replay("logs").containers["dflash-fixture"]
    assert len(job.log_tail) == 5 and job.log_path.endswith("dflash-ops-fixture.log")
    assert job.log_next_offset > 0
    follow = replay("logs_follow").containers["dflash-fixture"]
    # Read from offset 0, at most 400 bytes, cut after the last whole line.
    assert 0 < follow.log_next_offset <= 400
    assert follow.log_tail and sum(len(line) + 1 for line in follow.log_tail) == follow.log_next_offset


def test_the_log_read_is_recognised_by_its_module_not_by_the_tasks_name():
    collector = EventCollector()
    for event in load("logs")["events"]:
        data = event["event_data"]
        collector({**event, "event_data": {**data, "task": "Anything", "name": "Anything"}})
    assert collector.containers["dflash-fixture"].log_tail[-1].startswith("step 40 ")


def test_replay_stop_reports_the_stopped_unit_and_its_exit_status():
    result = replay("stop")
    job = result.containers["dflash-fixture"]
    assert result.ok and job.action == "stopped" and job.unit_state == "inactive"
    assert job.exit_status == 0 and job.pid is None and job.state == "stopped"
    assert result.message == "stop ok: dflash-fixture stopped, exit status 0"
    crashed = replay("stop_after_failure").containers["dflash-fixture"]
    assert crashed.state == "failed" and crashed.exit_status == 2


def test_results_serialise_to_json():
    data = json.loads(json.dumps(replay("deploy_health_failed").to_dict()))
    assert data["ok"] is False and data["message"].startswith("deploy failed: task")
    assert data["failures"][0]["headline"] in data["message"]
    assert data["containers"]["dflash-fixture"]["failure"]["task"] == "job : Assert that the trainer trains"


def test_progress_renders_tasks_hosts_and_failures():
    buffer = io.StringIO()
    replay("deploy_health_failed", handler=RichProgress(Console(file=buffer, width=300)))
    replay("status_unreachable", handler=RichProgress(Console(file=buffer, width=300)))
    text = buffer.getvalue()
    assert "PLAY Deploy the training job" in text
    assert "changed dflash-fixture  job : Launch the trainer unit" in text
    assert "FAILED dflash-fixture  job : Assert that the trainer trains: unit: unit failed: exit status 2" in text
    assert "UNREACHABLE dflash-gone  job : Read the job's health" in text
    assert "dflash-fixture: ok=" in text and "failed=1" in text


def test_ignored_and_rescued_failures_do_not_fail_the_operation():
    collector = EventCollector()
    ignored = {"event": "runner_on_failed", "event_data": {"host": "a", "task": "t", "ignore_errors": True,
                                                            "res": {"msg": "boom"}}}
    rescued = {"event": "runner_on_failed", "event_data": {"host": "b", "task": "t", "res": {"msg": "boom"}}}
    stats = {"event": "playbook_on_stats", "event_data": {"ok": {"a": 1, "b": 2}, "failures": {}, "dark": {},
                                                          "rescued": {"b": 1}}}
    for event in (ignored, rescued, stats):
        collector.add(event)
    result = collector.result("status", "playbooks/status.yml", "inv", "successful", 0)
    assert result.ok and result.failures == []


def test_module_names_and_states():
    assert module_name({"resolved_action": "ansible.legacy.dflash_health"}) == "dflash_health"
    assert module_name({"task_action": "dflash_unit"}) == "dflash_unit"
    job = replay("deploy_success").containers["dflash-fixture"]
    job.healthy, job.unit_state = None, "failed"
    assert derive_state(job) == "failed"


def test_replay_status_of_a_systemd_unit_recorded_in_an_lxc_container():
    result = replay("status_lxc_systemd")  # recorded against inventories/local after `make train`
    assert result.ok
    job = result.containers["dflash-local"]
    assert job.state == "training" and job.backend == "systemd"
    assert job.unit_state == "active" and job.sub_state == "running" and job.pid > 1
    assert job.step > 0 and job.tokens_per_s > 0 and job.tau > 1 and len(job.log_tail) == 10


def test_replay_gpu_memory_per_gpu_recorded_on_a_gpu_machine():
    # Recorded on an NVIDIA H200 machine: `record_events.py --gpu` (the tiny run on GPU 0).
    deployed = replay("deploy_gpu").containers["dflash-fixture"]
    # This recording predates the progress invariant: its heartbeat stayed at step 1 with the same time through
    # the 20 s check, which the health module now reports as no progress (test_ansible_health.py,
    # test_fresh_heartbeat_that_does_not_advance_is_not_progress). Only its GPU data is asserted here.
    assert deployed.health_state is None and deployed.pid == 2201
    [gpu] = deployed.gpus
    assert gpu.index == 0 and gpu.name == "NVIDIA H200" and gpu.total_mib > 100_000
    assert gpu.used_mib >= 256  # the health check's gpu_min_memory_mib: the model is on the GPU
    status = replay("status_gpu")
    assert status.containers["dflash-fixture"].gpus[0].used_mib == gpu.used_mib


def test_replay_a_stop_that_ended_in_sigkill_is_reported_failed_not_stopped():
    """The GPU recording's stop: its trainer (of that time) did not reach a step boundary within the 30 s stop
    timeout and was SIGKILLed (exit 137). That is no clean stop, and the result must not read as one."""
    stopped = replay("stop_gpu").containers["dflash-fixture"]
    assert stopped.action == "stopped" and stopped.exit_status == 137
    assert stopped.state == "failed" and stopped.state != "stopped"
    clean = replay("stop").containers["dflash-fixture"]  # a clean stop: SIGTERM honoured, exit 0
    assert clean.state == "stopped" and clean.exit_status == 0


def test_replay_train_yml_recorded_in_an_lxc_container():
    # train.yml (provision + deploy) from tests/ops/test_ops_lxc.py: the code had changed, so a restart.
    doc = load("train_lxc_systemd")
    plays = [e["event_data"]["play"] for e in doc["events"] if e["event"] == "playbook_on_play_start"]
    assert plays == ["Create and start the training containers", "Prepare the training environment inside the containers",
                     "Deploy the training job"]
    result = replay("train_lxc_systemd")
    assert result.ok and list(result.containers) == ["dflash-local"]  # delegated host tasks count for the container
    job = result.containers["dflash-local"]
    assert job.state == "training" and job.backend == "systemd" and job.action == "restarted"
    assert job.unit_state == "active" and job.pid > 1 and job.step > 0
    assert result.message.startswith("train ok: dflash-local training, step ")


def test_failure_messages_prefer_the_specific_part():
    loop = {"failed": True, "msg": "One or more items failed",
            "results": [{"failed": False, "item": "a"}, {"failed": True, "item": "b", "msg": "b is missing"}]}
    assert failure_message(loop) == "b is missing"
    command = {"failed": True, "msg": "non-zero return code", "rc": 2, "stderr": "dflash: error: data.train_path: no file"}
    assert failure_message(command) == "non-zero return code: dflash: error: data.train_path: no file"
    assert failure_message({"failed": True}) == "failed without a message"
    crash = {"failed": True, "msg": "MODULE FAILURE\nSee stdout/stderr for the exact error",
             "module_stderr": "Traceback (most recent call last):\n  File \"x\", line 1\nOSError: disk full\n"}
    assert failure_message(crash) == "MODULE FAILURE: OSError: disk full"


def test_raise_for_failure():
    ok = replay("deploy_success")
    assert ok.raise_for_failure() is ok
    failed = replay("deploy_health_failed")
    with pytest.raises(OpsFailed, match="task 'job : Assert that the trainer trains' failed on dflash-fixture") as exc:
        failed.raise_for_failure()
    assert exc.value.result is failed
