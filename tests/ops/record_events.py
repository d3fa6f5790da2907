"""Record the real ansible-runner event streams that tests/ops replays.

Runs the project's real playbooks (deploy, status, logs, stop) through
dflash.ops against tests/ops/inventory: the "container" is this machine (local
connection, daemon backend, the real tiny CPU trainer, every path under ROOT),
and dflash-gone is an ssh host on a closed port. Events are trimmed (module
arguments, diffs and console text dropped) and written to tests/ops/events/.

    .venv/bin/python tests/ops/record_events.py [ROOT]
    .venv/bin/python tests/ops/record_events.py --lxc   # status of inventories/local (read-only)
    .venv/bin/python tests/ops/record_events.py --logs [ROOT]   # only the log reads (logs, logs_follow)
    python3 tests/ops/record_events.py --gpu ROOT       # on a GPU machine: the tiny run on GPU 0
    .venv/bin/python tests/ops/record_events.py --artifacts DIR NAME   # keep a past run's job_events/

Writes only under ROOT (default /tmp/dflash-ops-fixture)
and ~/.cache/dflash. Takes about two minutes.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from dflash.ops.results import module_name
from dflash.ops.runner import start

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
INVENTORY = HERE / "inventory"
EVENTS = HERE / "events"
KINDS = {"playbook_on_play_start", "playbook_on_task_start", "playbook_on_no_hosts_matched", "playbook_on_stats",
         "runner_on_ok", "runner_on_failed", "runner_on_unreachable", "runner_on_skipped"}
EVENT_DATA_KEYS = ("play", "task", "role", "host", "task_action", "resolved_action", "ignore_errors", "res",
                   "name", "changed", "ok", "failures", "dark", "skipped", "rescued", "ignored", "processed")
RES_DROP = ("invocation", "diff", "_ansible_no_log", "_ansible_verbose_always", "_ansible_verbose_override")


def trim(event: dict[str, Any]) -> dict[str, Any] | None:
    if event.get("event") not in KINDS:
        return None
    data = {key: event["event_data"][key] for key in EVENT_DATA_KEYS if key in event.get("event_data", {})}
    if isinstance(data.get("res"), dict):
        # Gathered facts are large and no result reads them; dflash_gpu_facts' facts are kept.
        drop = RES_DROP + (("ansible_facts",) if module_name(data) in ("setup", "gather_facts") else ())
        data["res"] = {key: value for key, value in data["res"].items() if key not in drop}
    return {"event": event["event"], "event_data": data}


def record(name: str, operation: str, extravars: dict[str, Any], limit: str | None = None,
           inventory: Path = INVENTORY) -> None:
    events: list[dict[str, Any]] = []
    result = start(operation, inventory, extravars=extravars, limit=limit, event_handler=events.append).wait()
    trimmed = [t for t in map(trim, events) if t is not None]
    document = {
        "recorded_with": f"tests/ops/record_events.py: playbooks/{operation}.yml -i {inventory.relative_to(ROOT)}"
                         + (f" --limit {limit}" if limit else ""),
        "operation": operation,
        "runner": {"status": result.status, "rc": result.rc},
        "events": trimmed,
    }
    EVENTS.mkdir(exist_ok=True)
    (EVENTS / f"{name}.json").write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"{name}: {result.message}", flush=True)


def from_artifacts(artifact_dir: Path, name: str) -> None:
    """Save the events of a run that already happened (e.g. tests/ops/test_ops_lxc.py's train)."""
    paths = sorted((artifact_dir / "job_events").glob("*.json"), key=lambda p: int(p.name.split("-", 1)[0]))
    events = [json.loads(p.read_text()) for p in paths]
    status = (artifact_dir / "status").read_text().strip()
    rc = int((artifact_dir / "rc").read_text())
    operation = artifact_dir.name.rsplit("-", 1)[-1]
    document = {
        "recorded_with": f"tests/ops/record_events.py --artifacts {artifact_dir.name} {name}",
        "operation": operation,
        "runner": {"status": status, "rc": rc},
        "events": [t for t in map(trim, events) if t is not None],
    }
    (EVENTS / f"{name}.json").write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"{name}: {len(document['events'])} events from {artifact_dir}")


def fresh(root: Path) -> dict[str, Any]:
    """An empty fixture root; the extra vars that point the fixture job into it."""
    if root.exists():
        shutil.rmtree(root)
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "dflash-ops-fixture.env").write_text("")
    return {"ops_fixture_root": str(root), "_dflash_job_unit_state_dir": str(root / "unit")}


def record_gpu(root: Path) -> None:
    """The same tiny run on GPU 0: the health check and status read real nvidia-smi rows."""
    gpu = {**fresh(root), "dflash_job_target_gpu_ids": [0], "dflash_job_health_gpu_min_memory_mib": 256,
           "dflash_job_config": {"logging": {"interval": 1, "eval_interval": 0}, "optim": {"max_steps": 100000},
                                 "checkpoint": {"interval": 20}, "runtime": {"device": "cuda"}}}
    one = "dflash-fixture"
    record("deploy_gpu", "deploy", gpu, limit=one)
    record("status_gpu", "status", gpu, limit=one)
    record("stop_gpu", "stop", gpu, limit=one)


def record_logs(root: Path) -> None:
    """The log reads alone, over a log file of trainer lines (no job needed: the reader only reads the file)."""
    base = fresh(root)
    (root / "log").mkdir()
    lines = [f"step {n} loss {4 - n / 100:.3f} acc@1 0.{n:02d} tau 1.{n:02d} tokens/s 812" for n in range(1, 41)]
    (root / "log" / "dflash-ops-fixture.log").write_text("\n".join(lines) + "\npartial line being writ")
    one = "dflash-fixture"
    record("logs", "logs", {**base, "dflash_ops_log_lines": 5}, limit=one)
    record("logs_follow", "logs", {**base, "dflash_ops_log_offsets": {one: 0}, "dflash_ops_log_max_bytes": 400},
           limit=one)


def main(root: Path) -> None:
    base = fresh(root)
    one = "dflash-fixture"
    # A launch that trains, its status (with an unreachable second container), its logs, its stop.
    record("deploy_success", "deploy", base, limit=one)
    record("status_unreachable", "status", base)
    record("logs", "logs", {**base, "dflash_ops_log_lines": 5}, limit=one)
    record("logs_follow", "logs", {**base, "dflash_ops_log_offsets": {one: 0}, "dflash_ops_log_max_bytes": 400},
           limit=one)
    record("stop", "stop", base, limit=one)
    # A launch whose trainer dies at once (a config value it rejects): the health check fails.
    broken = {**base, "dflash_job_validate_config": False,
              "dflash_job_config": {"logging": {"interval": 1}, "optim": {"lr": "fast"}}}
    record("deploy_health_failed", "deploy", broken, limit=one)
    record("stop_after_failure", "stop", base, limit=one)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--artifacts"]:
        from_artifacts(Path(sys.argv[2]), sys.argv[3])
    elif sys.argv[1:2] == ["--gpu"]:
        record_gpu(Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/tmp/dflash-ops-fixture"))
    elif sys.argv[1:2] == ["--logs"]:
        record_logs(Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/tmp/dflash-ops-fixture"))
    elif sys.argv[1:] == ["--lxc"]:
        # The systemd backend in a real LXC container, with a job `make train` started.
        record("status_lxc_systemd", "status", {}, inventory=ROOT / "inventories" / "local")
    else:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/dflash-ops-fixture"))
