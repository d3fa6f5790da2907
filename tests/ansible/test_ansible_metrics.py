"""The job's state as Prometheus metrics (module_utils/dflash_metrics.py) with the real tools of Debian's packages
(scripts/host-setup.sh installs them): node_exporter serves the file the writer wrote while the job goes
training -> hung, promtool checks and tests the shipped alert rules, and a real Prometheus scrapes node_exporter
on loopback and loads the rules. The writer runs as the job role's timer runs it: the system's Python, isolated,
with only the copied module_utils."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
from ansible.module_utils.dflash_health import STATES
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_metrics import render, samples, snapshot, write_textfile
from conftest import ROOT

RULES = ROOT / "roles" / "job" / "files" / "prometheus" / "dflash-alerts.yml"
RULES_TEST = ROOT / "tests" / "ansible" / "fixtures" / "prometheus" / "dflash-alerts-test.yml"
DASHBOARD = ROOT / "roles" / "job" / "files" / "grafana" / "dflash-jobs.json"


def binary(name):
    found = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if not found:
        pytest.fail(f"{name} is not installed: run scripts/host-setup.sh (Debian packages prometheus, "
                    "prometheus-node-exporter)")
    return found


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def until(predicate, timeout=30.0, interval=0.2):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except OSError:
            value = None
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


class Server:
    """A real server on a free loopback port, stopped (SIGTERM, then SIGKILL) by the test."""

    def __init__(self, args, port, tmp_path, name):
        self.port = port
        self.log = open(tmp_path / f"{name}.log", "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def node_exporter(tmp_path):
    textfiles = tmp_path / "textfiles"
    textfiles.mkdir()
    port = free_port()
    server = Server([binary("prometheus-node-exporter"), "--collector.disable-defaults", "--collector.textfile",
                     f"--collector.textfile.directory={textfiles}", f"--web.listen-address=127.0.0.1:{port}"],
                    port, tmp_path, "node-exporter")  # fmt: skip
    server.textfiles = textfiles
    server.url = f"http://127.0.0.1:{port}/metrics"
    assert until(lambda: get(server.url)), (tmp_path / "node-exporter.log").read_text()
    yield server
    server.stop()


def write_heartbeat(path, step, age, status="training"):
    data = {"step": step, "epoch": 0, "time": time.time() - age, "pid": os.getpid(), "status": status, "loss": 2.5,
            "tau": 3.25, "tokens_per_s": 1234.5}  # fmt: skip
    path.write_text(json.dumps(data))


def job(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    (tmp_path / "job.log").write_text("step 1\n")
    return {"name": "dflash-train", "log_path": str(tmp_path / "job.log"), "heartbeat_path": str(run / "heartbeat.json"),
            "gpu_ids": [], "gpu_min_memory_mib": 1024, "progress_window": 30, "start_window": 0}  # fmt: skip


def running(restarts=0):
    """The unit: this test process, launched a minute ago."""
    return {"load_state": "loaded", "active_state": "active", "sub_state": "running", "main_pid": os.getpid(),
            "exit_status": None, "result": None, "backend": "systemd", "started_at": time.time() - 60,
            "restarts": restarts, "watchdog_kills": 0, "failure_class": None}  # fmt: skip


def exported(params, status):
    state, failures, obs = snapshot(LocalHost(), params, lambda: dict(status))
    return state, render(samples(params, state, failures, obs))


def test_node_exporter_serves_a_job_going_from_training_to_hung(tmp_path, node_exporter):
    params = job(tmp_path)
    heartbeat = tmp_path / "run" / "heartbeat.json"
    write_heartbeat(heartbeat, 120, age=1)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step-100\n")
    state, text = exported(params, running(restarts=2))
    assert state == "training"
    write_textfile(LocalHost(), str(node_exporter.textfiles), params["name"], text)
    out = get(node_exporter.url)
    assert "node_textfile_scrape_error 0" in out
    assert 'dflash_job_state{dflash_job="dflash-train",state="training"} 1' in out
    assert 'dflash_job_state{dflash_job="dflash-train",state="hung"} 0' in out
    assert sum(f'state="{s}"' in out for s in STATES) == len(STATES)
    for line in ('dflash_job_step{dflash_job="dflash-train"} 120', 'dflash_job_tau{dflash_job="dflash-train"} 3.25',
                 'dflash_job_tokens_per_second{dflash_job="dflash-train"} 1234.5',
                 'dflash_job_checkpoint_step{dflash_job="dflash-train"} 100',
                 'dflash_job_restarts{dflash_job="dflash-train"} 2', 'dflash_job_healthy{dflash_job="dflash-train"} 1'):
        assert line in out, line
    age = float(next(x for x in out.splitlines() if x.startswith("dflash_job_last_step_age_seconds{")).split()[-1])
    assert 0.5 < age < 30

    # the trainer stops stepping: its heartbeat ages past the progress window
    write_heartbeat(heartbeat, 120, age=45)
    state, text = exported(params, running(restarts=2))
    assert state == "hung"
    write_textfile(LocalHost(), str(node_exporter.textfiles), params["name"], text)
    out = get(node_exporter.url)
    assert 'dflash_job_state{dflash_job="dflash-train",state="hung"} 1' in out
    assert 'dflash_job_state{dflash_job="dflash-train",state="training"} 0' in out
    assert 'dflash_job_tokens_per_second{dflash_job="dflash-train"} 0' in out
    assert 'dflash_job_healthy{dflash_job="dflash-train"} 0' in out
    assert not [p for p in os.listdir(node_exporter.textfiles) if p != "dflash-dflash-train.prom"]  # no temp left


def test_a_crashed_job_exports_its_failure_class(tmp_path):
    params = job(tmp_path)
    write_heartbeat(tmp_path / "run" / "heartbeat.json", 50, age=5, status="failed")
    data = json.loads((tmp_path / "run" / "heartbeat.json").read_text())
    data["failure_class"] = "oom"
    (tmp_path / "run" / "heartbeat.json").write_text(json.dumps(data))
    status = {**running(), "active_state": "failed", "sub_state": "failed", "main_pid": None, "exit_status": 1,
              "result": "exit-code"}
    state, text = exported(params, status)
    assert state == "crashed"
    assert 'dflash_job_state{dflash_job="dflash-train",state="crashed"} 1' in text
    assert 'dflash_job_failure{dflash_job="dflash-train",class="oom"} 1' in text


def test_the_writer_reads_a_hostile_run_directory_safely(tmp_path):
    """A trainer's link to a root-only file and a FIFO at checkpoints/latest: nothing followed, never blocked."""
    params = job(tmp_path)
    secret = tmp_path / "root-only"
    secret.write_text('{"step": 999, "time": 0, "status": "training"}')
    os.symlink(secret, tmp_path / "run" / "heartbeat.json")
    os.mkfifo(tmp_path / "run" / "checkpoints" / "latest")
    started = time.monotonic()
    state, text = exported(params, running())
    assert time.monotonic() - started < 10
    assert "999" not in text
    assert "last_checkpoint_age_seconds" not in text and "dflash_job_step{" not in text
    assert state in ("starting", "hung")


def test_the_timer_command_runs_the_zip_application_the_role_builds(tmp_path):
    """As the role installs it: files/dflash-metrics-pyz.py builds one zip of the listed module_utils (the same bytes
    twice: an unchanged writer copies as unchanged), the system's Python runs it isolated (no ansible installed
    there); a job never launched reads as stopped."""
    import yaml

    names = yaml.safe_load((ROOT / "roles" / "job" / "vars" / "main.yml").read_text())["_dflash_job_metrics_module_utils"]
    builder = ROOT / "roles" / "job" / "files" / "dflash-metrics-pyz.py"
    for out in ("a.pyz", "b.pyz"):
        subprocess.run([sys.executable, str(builder), str(tmp_path / out), str(ROOT / "module_utils"), *names],
                       check=True, timeout=60)  # fmt: skip
    assert (tmp_path / "a.pyz").read_bytes() == (tmp_path / "b.pyz").read_bytes()
    params = {**job(tmp_path), "backend": "daemon", "state_dir": str(tmp_path / "state"),
              "textfile_dir": str(tmp_path / "textfiles"), "node_heartbeat_path": None, "node_rank": 0}
    config = tmp_path / "metrics.json"
    config.write_text(json.dumps(params))
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    proc = subprocess.run([python, "-I", str(tmp_path / "a.pyz"), str(config)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "textfiles" / "dflash-dflash-train.prom").read_text()
    assert 'dflash_job_state{dflash_job="dflash-train",state="stopped"} 1' in text
    assert "# TYPE dflash_job_state gauge" in text


def test_promtool_checks_and_tests_the_shipped_alert_rules():
    promtool = binary("promtool")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 7 rules found" in check.stdout
    test = subprocess.run([promtool, "test", "rules", str(RULES_TEST)], capture_output=True, text=True, timeout=60)
    assert test.returncode == 0, test.stdout + test.stderr


def test_the_dashboard_queries_the_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    assert exprs
    names = {"dflash_job_" + m for m in __import__("ansible.module_utils.dflash_metrics", fromlist=["METRICS"]).METRICS}
    used = {word for e in exprs for word in names if word in e}
    assert {"dflash_job_state", "dflash_job_step", "dflash_job_tau", "dflash_job_tokens_per_second",
            "dflash_job_gpu_memory_mib", "dflash_job_restarts"} <= used


def test_a_real_prometheus_scrapes_node_exporter_and_loads_the_rules(tmp_path, node_exporter):
    params = job(tmp_path)
    write_heartbeat(tmp_path / "run" / "heartbeat.json", 7, age=45)
    state, text = exported(params, running())
    assert state == "hung"
    write_textfile(LocalHost(), str(node_exporter.textfiles), params["name"], text)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "node", "static_configs": [{"targets": [f"127.0.0.1:{node_exporter.port}"]}]}],
    }))  # fmt: skip
    server = Server([binary("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                     f"--web.listen-address=127.0.0.1:{port}"], port, tmp_path, "prometheus")  # fmt: skip
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        query = urllib.parse.quote('dflash_job_state{state="hung"} == 1')
        result = until(lambda: json.loads(get(f"{api}/query?query={query}"))["data"]["result"], timeout=60)
        log = (tmp_path / "prometheus.log").read_text()
        assert result, log
        assert result[0]["metric"]["dflash_job"] == "dflash-train" and result[0]["metric"]["job"] == "node"
        rules = json.loads(get(f"{api}/rules"))["data"]["groups"]
        assert [g["name"] for g in rules] == ["dflash-jobs"]
        assert all(r["health"] == "ok" for r in rules[0]["rules"])
        # the hung job's alert is pending (it fires after 10 minutes)
        pending = until(lambda: [a for a in json.loads(get(f"{api}/alerts"))["data"]["alerts"]
                                 if a["labels"]["alertname"] == "DflashJobHung"], timeout=30)  # fmt: skip
        assert pending and pending[0]["state"] == "pending"
        # every query of the dashboard runs (its variables: all jobs, all instances); its state row reads 5, hung
        dashboard = json.loads(DASHBOARD.read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$dflash_job", ".*").replace("$instance", ".*")
                answer = json.loads(get(f"{api}/query?query={urllib.parse.quote(expr)}"))
                assert answer["status"] == "success", (panel["title"], expr, answer)
                if panel["title"] == "Job state":
                    assert [float(r["value"][1]) for r in answer["data"]["result"]] == [5.0]
                    assert panel["fieldConfig"]["defaults"]["mappings"][4]["options"]["5"]["text"] == "hung"
    finally:
        server.stop()
