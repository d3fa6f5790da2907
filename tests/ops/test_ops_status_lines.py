"""`make status` / `dflash ops status` print the report lines status.yml prints for each job (the state, each failed
invariant with its reason, the hint, the restarts line with the crash loop), from the same dflash_health result."""

from __future__ import annotations

import io
import os
from pathlib import Path

import jinja2
import pytest
from rich.console import Console

from dflash.ops.cli import render
from dflash.ops.results import EventCollector, report_lines

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "roles" / "job" / "templates" / "status.txt.j2"


def _health(state, ok, failures, restarts=0, crash_loop=False, last=None, hint=None):
    unit = {"backend": "systemd", "active_state": "active" if state in ("starting", "training") else "failed",
            "sub_state": "running" if state in ("starting", "training") else "failed", "main_pid": 4242,
            "exit_status": None if state in ("starting", "training") else 1, "restarts": restarts,
            "watchdog_kills": 0, "last_exit_reason": last, "crash_loop": crash_loop}  # fmt: skip
    return {"healthy": not failures, "ok": ok, "state": state, "failures": failures,
            "failed_invariants": [f["invariant"] for f in failures], "hint": hint, "unit": unit, "job": "dflash-tiny",
            "step": None, "epoch": None, "loss": None, "tokens_per_s": None, "tau": None, "heartbeat": None,
            "heartbeat_current": False, "checkpoint": None, "log_tail": ["loading the target"], "gpus": [],
            "diagnosis": "the diagnosis", "finished": False, "gpu_table": None, "stacks": []}  # fmt: skip


CASES = {
    # within its progress window, no heartbeat yet: status.yml says why, and so must `make status`
    "starting": _health("starting", True, [
        {"invariant": "progress", "reason": "no progress yet: no heartbeat: /var/lib/dflash/runs/dflash-tiny/"
                                            "heartbeat.json does not exist"}]),  # fmt: skip
    "crash_loop": _health("crashed", False, [{"invariant": "unit", "reason": "unit failed: exit status 1"}],
                          restarts=3, crash_loop=True, last="exit-code (exited 1)"),  # fmt: skip
}


def _template_lines(res):
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=False, undefined=jinja2.StrictUndefined)
    env.filters["dirname"] = os.path.dirname
    env.filters["bool"] = bool
    text = env.from_string(TEMPLATE.read_text()).render(
        dflash_job_health=res, inventory_hostname="dflash-local", dflash_job_name="dflash-tiny",
        _dflash_job_multinode=False, _dflash_job_gpu_ids=[], dflash_job_log_path="/var/log/dflash/dflash-tiny.log")
    return text.splitlines()


def _collected(res):
    collector = EventCollector()
    collector.add({"event": "runner_on_ok", "event_data": {"host": "dflash-local", "res": res,
                                                           "resolved_action": "dflash_health", "task": "Health"}})
    return collector.result("status", "status.yml", "inventories/local", "successful", 0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_cli_prints_status_ymls_report_lines(case):
    res = CASES[case]
    ours = report_lines(_collected(res).containers["dflash-local"])
    theirs = _template_lines(res)
    # status.yml's report: the header and reason lines first, the restarts line among the unit's lines
    assert ours[:-1] == [line for line in theirs if not line.startswith(("unit ", "pid ", "exit ", "restarts ", "step ",
                         "checkpoint ", "tokens/s ", "tau ", "loss ", "GPUs ", "log ", "  | "))], theirs  # fmt: skip
    assert ours[-1] in theirs, (ours[-1], theirs)
    out = io.StringIO()
    render(_collected(res), Console(file=out, width=300, highlight=False), show_logs=True)
    printed = out.getvalue().splitlines()
    for line in ours:
        assert line in printed, (line, printed)


def test_the_lines_say_why_a_starting_job_has_no_heartbeat_and_name_the_crash_loop():
    starting = report_lines(_collected(CASES["starting"]).containers["dflash-local"])
    assert starting[0] == "dflash-local / dflash-tiny: starting"
    assert "  - progress: no progress yet: no heartbeat: " in starting[1]
    looping = report_lines(_collected(CASES["crash_loop"]).containers["dflash-local"])
    assert looping[0] == "dflash-local / dflash-tiny: crashed (NOT HEALTHY)"
    assert looping[-1] == ("restarts   3 (watchdog kills 0), last failure exit-code (exited 1) - crash loop: restarts "
                           "exhausted, the unit stays failed")
