"""`dflash ops ...`: arguments, exit codes (0 ok, 1 failed, 2 bad input), messages, JSON output."""

from __future__ import annotations

import json

import pytest
from ops_replay import INVENTORY, replay

from dflash import cli
from dflash.errors import BadInput
from dflash.ops import api
from dflash.ops import cli as ops_cli
from dflash.ops.cli import parse_extravars


def test_extravars_are_parsed_like_ansible_playbook(tmp_path):
    extra = tmp_path / "vars.yml"
    extra.write_text("dflash_job_config: {optim: {lr: 0.001}}\n")
    assert parse_extravars(["dflash_job_state=restarted", "n=3", "ids=[0, 1]", "flag=true", "empty=",
                            '{"x": {"y": 1}}', f"@{extra}"]) == {
        "dflash_job_state": "restarted", "n": 3, "ids": [0, 1], "flag": True, "empty": "",
        "x": {"y": 1}, "dflash_job_config": {"optim": {"lr": 0.001}}}


@pytest.mark.parametrize("item, fragment", [
    ("novalue", "expected KEY=VALUE"),
    ("=3", "expected KEY=VALUE"),
    ("bad key=1", "not a valid variable name"),
    ("x=[1, 2", "the value is not valid YAML"),
    ("{oops", "not a valid YAML/JSON mapping"),
    ("@/nonexistent/vars.yml", "cannot read"),
])
def test_malformed_extravars_are_bad_input(item, fragment):
    with pytest.raises(BadInput, match=fragment):
        parse_extravars([item])


def test_missing_inventory_exits_2_with_one_line(capsys, tmp_path):
    rc = cli.main(["ops", "status", "-i", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"dflash ops: error: inventory {tmp_path / 'nowhere'}: no such file or directory")
    assert "-i inventories/local" in err


def test_malformed_extravar_exits_2(capsys):
    assert cli.main(["ops", "train", "-i", str(INVENTORY), "-e", "dflash_job_state"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["ops", "status"])  # no -i
    assert exc.value.code == 2
    assert "-i/--inventory" in capsys.readouterr().err


@pytest.fixture
def replayed(monkeypatch):
    """`api.run` answers with a recorded run; returns the calls it got."""
    calls = []

    def use(name):
        def fake_run(operation, inventory, **kwargs):
            calls.append((operation, inventory, kwargs))
            return replay(name)

        monkeypatch.setattr(api, "run", fake_run)
        return calls

    return use


def test_success_prints_the_table_and_exits_0(replayed, capsys):
    calls = replayed("deploy_success")
    rc = cli.main(["ops", "deploy", "-i", "inv", "-e", "dflash_job_state=restarted", "-l", "dflash-fixture", "-q"])
    out = capsys.readouterr().out
    assert rc == 0
    assert calls == [("deploy", "inv", {"extravars": {"dflash_job_state": "restarted"}, "limit": "dflash-fixture",
                                        "progress": False})]
    assert "dflash-fixture" in out and "training" in out and "active/running (started)" in out
    assert "deploy ok: dflash-fixture training, step" in out


def test_a_failed_health_check_exits_1_naming_task_host_and_diagnosis(replayed, capsys):
    replayed("deploy_health_failed")
    rc = ops_cli.main(["train", "-i", "inv"])
    captured = capsys.readouterr()
    assert rc == 1
    assert ("dflash ops: error: deploy failed: task 'job : Assert that the trainer trains' failed on dflash-fixture: "
            "unit: unit failed: exit status 2") in captured.err
    assert "health diagnosis:" in captured.out and "dflash: error: optim.lr" in captured.out


def test_an_unreachable_host_exits_1(replayed, capsys):
    replayed("status_unreachable")
    assert ops_cli.main(["status", "-i", "inv"]) == 1
    captured = capsys.readouterr()
    assert "dflash ops: error: status failed: dflash-gone is unreachable (task 'job : Read the job's health')" in captured.err
    assert "unreachable" in captured.out and "step " in captured.out  # the reachable job's log tail


def test_json_output(replayed, capsys):
    replayed("status_unreachable")
    assert ops_cli.main(["status", "-i", "inv", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["containers"]["dflash-gone"]["state"] == "unreachable"
    assert data["containers"]["dflash-fixture"]["state"] == "training"
    assert data["failures"][0]["unreachable"] is True


def test_logs_follow_prints_new_lines_per_host(monkeypatch, capsys):
    first, second = replay("logs"), replay("logs_follow")
    runs = iter([first, second])
    seen = []

    def fake_run(operation, inventory, extravars=None, **kwargs):
        seen.append(extravars)
        return next(runs)

    monkeypatch.setattr(api, "run", fake_run)
    lines = []
    api.logs("inv", 5, follow=True, interval=0, on_lines=lambda host, new: lines.extend((host, n) for n in new),
             until=lambda: len(seen) >= 2)
    assert seen[0] == {"dflash_ops_log_lines": 5}
    assert seen[1]["dflash_ops_log_offsets"] == {"dflash-fixture": first.containers["dflash-fixture"].log_next_offset}
    tail = first.containers["dflash-fixture"].log_tail + second.containers["dflash-fixture"].log_tail
    assert lines == [("dflash-fixture", line) for line in tail]


def test_status_can_require_every_job_to_train(replayed, capsys):
    replayed("stop")  # a read that succeeded, of a job that is not training
    assert ops_cli.main(["status", "-i", "inv", "-q"]) == 0
    assert ops_cli.main(["status", "-i", "inv", "-q", "--require-training"]) == 1
    assert "dflash ops: error: not training: dflash-fixture is stopped" in capsys.readouterr().err
    replayed("status_lxc_systemd")
    assert ops_cli.main(["status", "-i", "inv", "-q", "--require-training"]) == 0


def test_logs_prints_host_and_line_only(replayed, capsys):
    replayed("logs")
    assert ops_cli.main(["logs", "-i", "inv", "-n", "5", "-q"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and all(line.startswith("dflash-fixture | ") for line in out)
