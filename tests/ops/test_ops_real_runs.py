"""dflash.ops through the real ansible-runner and the real playbooks on this machine.

The fixture inventory's container is this machine (local connection, daemon
backend, the real tiny CPU trainer, every path under a temp dir); dflash-gone is
an ssh host on a closed port.
"""

from __future__ import annotations

import getpass
import json
import shutil
from pathlib import Path

import pytest
from ops_replay import INVENTORY

from dflash import ops
from dflash.ops import cli as ops_cli

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs an ssh client for the unreachable host")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "runner" / "artifacts"


@pytest.fixture
def job_vars(tmp_path):
    root = tmp_path / "job"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "dflash-ops-fixture.env").write_text("")
    return {"ops_fixture_root": str(root), "_dflash_job_unit_state_dir": str(root / "unit"),
            "dflash_job_user": getpass.getuser()}


def test_an_unreachable_host_through_the_runner(cache, job_vars, capsys):
    result = ops.status(INVENTORY, limit="dflash-gone", progress=False, extravars=job_vars)
    assert not result.ok and result.failures[0].unreachable
    assert result.containers["dflash-gone"].state == "unreachable"
    # The run's events stay in its artifact directory, under the cache dir.
    artifact = Path(result.artifact_dir)
    assert artifact.parent == cache and any((artifact / "job_events").iterdir())
    rc = ops_cli.main(["status", "-i", str(INVENTORY), "-l", "dflash-gone", "-q", "--json"]
                      + [f"-e{key}={value}" for key, value in job_vars.items()])
    assert rc == 1
    assert json.loads(capsys.readouterr().out)["failures"][0]["host"] == "dflash-gone"


def test_no_matching_container_is_bad_input_and_artifacts_rotate(cache, capsys):
    for _ in range(3):
        result = ops.run("status", INVENTORY, limit="nope", progress=False, keep_artifacts=2)
        assert not result.ok and result.bad_input
        assert "has no hosts in group dflash_containers matching --limit 'nope'" in result.message
    assert len(list(cache.iterdir())) == 2
    assert ops_cli.main(["status", "-i", str(INVENTORY), "-l", "nope", "-q"]) == 2


@pytest.mark.slow
def test_deploy_status_logs_stop_on_this_machine(cache, job_vars):
    one = "dflash-fixture"
    # The inventory's job with 200 synthetic conversations instead of 2000: the trainer regenerates their answers
    # before its first step, and nothing here needs more data. Its length is the inventory's (the config's 600
    # steps and periodic evals are the demo's).
    job_vars = {**job_vars, "dflash_job_config": {"logging": {"interval": 1, "eval_interval": 0},
                                                  "optim": {"max_steps": 100000}, "checkpoint": {"interval": 20},
                                                  "data": {"synthetic": {"num_samples": 200}},
                                                  "runtime": {"num_threads": 1, "step_pause_s": 0.2}}}
    try:
        deployed = ops.deploy(INVENTORY, limit=one, progress=False, extravars=job_vars)
        assert deployed.ok, deployed.message
        job = deployed.containers[one]
        assert job.state == "training" and job.action == "started" and job.pid

        status = ops.status(INVENTORY, limit=one, progress=False, extravars=job_vars)
        assert status.ok and status.containers[one].pid == job.pid
        assert status.containers[one].step >= job.step

        logs = ops.logs(INVENTORY, 3, limit=one, extravars=job_vars)
        assert logs.ok and len(logs.containers[one].log_tail) == 3
        followed = []
        ops.logs(INVENTORY, 3, follow=True, limit=one, extravars=job_vars, interval=1,
                 on_lines=lambda host, lines: followed.extend(lines), until=lambda: len(followed) > 3)
        steps = [int(line.split()[1]) for line in followed if line.startswith("step ")]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)  # new lines, in order, none twice
    finally:
        stopped = ops.stop(INVENTORY, limit=one, progress=False, extravars=job_vars)
    assert stopped.ok, stopped.message
    job = stopped.containers[one]
    assert job.state == "stopped" and job.exit_status == 0 and job.unit_state == "inactive"
    # A job stopped on purpose is not a failure: status reads it `stopped` and exits 0.
    assert ops_cli.main(["status", "-i", str(INVENTORY), "-l", one, "-q"]
                        + [f"-e{key}={value}" for key, value in job_vars.items()]) == 0


def test_a_typo_in_a_variable_is_bad_input_naming_the_closest_one(cache, job_vars, capsys):
    typo = {**job_vars, "dflash_job_confg": {"seed": 1}}
    result = ops.deploy(INVENTORY, limit="dflash-fixture", progress=False, extravars=typo)
    assert not result.ok and result.bad_input
    assert "dflash_job_confg (did you mean dflash_job_config?)" in result.message
    assert result.containers["dflash-fixture"].action is None  # nothing was deployed
    rc = ops_cli.main(["status", "-i", str(INVENTORY), "-l", "dflash-fixture", "-q"]
                      + [f"-e{key}={value}" for key, value in {**job_vars, "dflash_job_confg": 1}.items()])
    assert rc == 2 and "did you mean dflash_job_config?" in capsys.readouterr().err


def test_a_canceled_run(cache, job_vars):
    run = ops.start("status", INVENTORY, limit="dflash-gone", extravars=job_vars)
    run.cancel()
    result = run.wait(120)
    assert result is not None and run.done
    assert not result.ok and result.status == "canceled" and "canceled" in result.message


def test_a_playbook_that_ansible_rejects_reports_ansibles_error(cache, tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "playbooks").mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[2] / "ansible.cfg", project)
    (project / "playbooks" / "status.yml").write_text(
        "- name: Broken\n  hosts: dflash_containers\n  tasks:\n    - name: A typo\n      no_such_module_xyz: {}\n")
    monkeypatch.setenv("DFLASH_PROJECT_DIR", str(project))
    result = ops.status(INVENTORY, limit="dflash-fixture", progress=False)
    assert not result.ok and not result.bad_input and result.containers == {}
    assert "couldn't resolve module/action 'no_such_module_xyz'" in result.message


@pytest.mark.slow
def test_a_trainer_that_dies_at_once_fails_the_deploy_with_its_error(cache, job_vars):
    broken = {**job_vars, "dflash_job_validate_config": False,
              "dflash_job_config": {"logging": {"interval": 1}, "optim": {"lr": "fast"}}}
    try:
        result = ops.deploy(INVENTORY, limit="dflash-fixture", progress=False, extravars=broken)
    finally:
        ops.stop(INVENTORY, limit="dflash-fixture", progress=False, extravars=job_vars)
    assert not result.ok
    [failure] = result.failures
    # The launch's health check ran under the deploy's lock (launch.yml); with nothing to roll back to, the deploy
    # fails with its diagnosis.
    assert failure.host == "dflash-fixture" and failure.task.startswith("job : Fail the deploy")
    assert "dflash: error: optim.lr: expected a number, got 'fast'" in failure.diagnosis
    assert result.message.startswith("deploy failed: task 'job : Fail the deploy with the new launch's diagnosis")
    assert "unit failed" in result.message and "dflash: error: optim.lr" in result.message
    job = result.containers["dflash-fixture"]
    assert job.state == "failed-to-start" and job.exit_status == 2
