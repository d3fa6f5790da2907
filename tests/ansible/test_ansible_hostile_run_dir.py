"""Root never trusts what the trainer wrote, as a property of the suite: a run directory with, at every path the
trainer can write and root reads (tests/ansible/hostile.py), a FIFO, links to /dev/zero and to a root-only file, a
1 TiB sparse file, a hard link, JSON of the wrong types or nested 200,000 deep, and ESC sequences with a forged line.
Every root entry point this machine can run - the modules, the wait plugin, `dflash ops status` and `logs` - runs
under a memory limit (address space) and a time limit, answers, shows nothing of the root-only file and prints no
raw control character."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, tool
from hostile import FORGED, KINDS, LAYOUTS, SECRET, SECRET_STEP, plant, raw_controls

# Address space of every process of an entry point (an Ansible run measured about 0.4 GiB): /dev/zero or a 1 TiB file
# streamed into memory ends in a MemoryError long before the machine notices.
MEMORY_LIMIT = 1 << 30
# One entry point's answer, at most (a FIFO would block forever).
ANSWER_S = 20


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _run(args, timeout, **kw):
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, preexec_fn=_limited, **kw)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        pytest.fail(f"{args[0]} did not answer within {timeout}s (a FIFO waited on?); its output:\n{out[-3000:]}")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    planted = {kind: plant(base, kind) for kind in KINDS}
    planted.update({name: plant(base, name, kinds) for name, kinds in LAYOUTS.items()})
    secret = base / "root-only" / "secret.json"
    before = (secret.read_bytes(), secret.stat().st_mtime_ns, sorted(os.listdir(base / "root-only")))
    yield base, planted
    # nothing was written outside the run directories: the root-only file and its directory are as they were
    assert (secret.read_bytes(), secret.stat().st_mtime_ns, sorted(os.listdir(base / "root-only"))) == before


def _leaks(text):
    return [marker for marker in (SECRET, str(SECRET_STEP)) if marker in text]


def test_every_root_module_answers_a_hostile_run_directory(hostile):
    base, planted = hostile
    args = {"root": str(ROOT), "planted": {kind: planted[kind] for kind in KINDS}, "unit_pid": os.getpid(),
            "limit_s": ANSWER_S}
    proc = _run([sys.executable, str(ROOT / "tests" / "ansible" / "hostile.py"), json.dumps(args)],
                timeout=ANSWER_S * 8 * len(KINDS))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert sorted(results) == sorted(KINDS)
    for kind, entries in results.items():
        for name, entry in entries.items():
            where = f"{name} on {kind}"
            assert "error" not in entry, f"{where}: {entry.get('error')}"
            text = json.dumps(entry["result"], ensure_ascii=False)
            assert not _leaks(text), f"{where} read the root-only file: {text[:2000]}"
            strings = _strings(entry["result"])
            for value in strings:  # a diagnosis has its lines; none of them comes raw from the trainer
                assert not raw_controls(value), f"{where}: raw {raw_controls(value)} in {value[:500]!r}"
                assert f"\n{FORGED}" not in value, f"{where}: a forged line in {value[:2000]!r}"
        health = entries["dflash_health (running)"]["result"]
        if kind in ("wrong-types", "deep", "deep-small"):
            assert "invalid heartbeat" in health["diagnosis"], health["diagnosis"]
        if kind == "escapes":  # shown, escaped
            assert "boom\\x1b[2J\\x1b[H\\x0ahealth: OK" in health["diagnosis"], health["diagnosis"]
            progress = entries["dflash_progress"]["result"]
            assert progress["heartbeat"] == {"step": 3, "status": "failed"} and "\\x1b" in progress["line"], progress


def _strings(value):
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in list(value.values()) + list(value) for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


@pytest.mark.slow
def test_the_wait_answers_a_hostile_run_directory(hostile, tmp_path):
    """The deploy's wait (playbooks/action_plugins/dflash_wait.py), one host per layout (LAYOUTS), in one play."""
    _base, planted = hostile
    hosts = {name: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                    "run": planted[name]["run"], "log": planted[name]["log"]} for name in LAYOUTS}  # fmt: skip
    (tmp_path / "hosts.yml").write_text(json.dumps({"all": {"hosts": hosts}}))
    # strategy free: each host waits right after its own start (its task runs long enough for a line or more)
    play = [{"name": "Wait", "hosts": "all", "gather_facts": False, "strategy": "free", "tasks": [
        {"name": "Start", "ansible.builtin.command": "sleep 5", "async": 60, "poll": 0, "register": "job"},
        {"name": "Wait", "dflash_wait": {"jid": "{{ job.ansible_job_id }}", "what": "proof", "log": "{{ log }}",
                                         "heartbeat": "{{ run }}/heartbeat.json", "interval": 1, "timeout": 30}},
    ]}]  # fmt: skip
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_ASYNC_DIR": str(tmp_path / "async"), "ANSIBLE_LOCAL_TEMP": str(tmp_path / ".ansible-tmp")}  # fmt: skip
    proc = _run([tool("ansible-playbook"), "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml")],
                timeout=ANSWER_S * 4, cwd=tmp_path, env=env)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert not _leaks(out), out[-4000:]
    assert not raw_controls(out), f"raw {raw_controls(out)} in the output:\n{out[-4000:]}"
    lines = {name: [line for line in proc.stdout.splitlines() if line.startswith(f"[{name}] ")] for name in LAYOUTS}
    assert all(lines.values()), f"no progress line for {[n for n, found in lines.items() if not found]}:\n{out[-3000:]}"
    assert "heartbeat not read (not a plain file of the trainer's); log 87 B" in lines["mixed-1"][-1], lines
    assert "\\x1b]0;title\\x07done\\x1b[31m" in lines["mixed-1"][-1], lines
    assert "heartbeat step 3 (failed); log is not a regular file (fifo): not read" in lines["mixed-2"][-1], lines
    assert "invalid heartbeat; log 1099.5 GB" in lines["mixed-3"][-1], lines
    assert "log is a symbolic link (to " in lines["mixed-4"][-1] and "log has " in lines["mixed-5"][-1], lines


# `status` prints the diagnoses (a FIFO, ESC sequences, links there); `logs` prints log lines (ESC sequences, a link).
OPS = {"status": ["mixed-1", "mixed-2", "mixed-4"], "logs": ["mixed-1", "mixed-4"]}


@pytest.mark.slow
@pytest.mark.parametrize("operation", list(OPS))
def test_dflash_ops_status_and_logs_answer_a_hostile_run_directory(hostile, tmp_path, operation):
    """`dflash ops status` and `logs` (playbooks/status.yml, logs.yml through ansible-runner, and what the CLI prints),
    one container per layout."""
    _base, planted = hostile
    hosts = {}
    for kind in OPS[operation]:
        paths = planted[kind]
        job = tmp_path / kind
        (job / "etc").mkdir(parents=True)
        (job / "etc" / "job.env").write_text("")
        (job / "opt" / "unit").mkdir(mode=0o700, parents=True)
        (job / "opt" / "unit" / "exit_status").write_text("1\n")  # it failed: status prints its diagnosis
        hosts[kind] = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                       "dflash_job_name": "hostile", "dflash_job_backend": "daemon", "dflash_job_user": "root",
                       "dflash_job_venv": str(ROOT / ".venv"), "dflash_job_root": str(job / "opt"),
                       "dflash_job_run_dir": paths["run"], "dflash_job_log_path": paths["log"],
                       "dflash_job_config_path": str(job / "etc" / "job.yaml"), "dflash_job_env_file": str(job / "etc" / "job.env"),
                       "dflash_job_status_log_lines": 10}  # fmt: skip
    (tmp_path / "hosts.yml").write_text(json.dumps({"all": {"children": {"dflash_containers": {"hosts": hosts}}}}))
    env = {key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")}
    env.update(DFLASH_CACHE_DIR=str(tmp_path / "cache"), ANSIBLE_LOCAL_TEMP=str(tmp_path / ".ansible-tmp"))
    # the unit's state directory of each container (a role variable: only an extra variable overrides it)
    state_dir = "-e_dflash_job_unit_state_dir='{{ dflash_job_root }}/unit'"
    proc = _run([sys.executable, "-m", "dflash", "ops", operation, "-i", str(tmp_path / "hosts.yml"), "-q", state_dir],
                timeout=ANSWER_S * 6, cwd=ROOT, env=env)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1), out[-4000:]  # 1: the jobs read as crashed or failed to start
    assert "Traceback" not in out, out[-4000:]
    assert not _leaks(out), out[-4000:]
    assert not raw_controls(out), f"raw {raw_controls(out)} in the output:\n{out[-4000:]}"
    if operation == "logs":
        assert "mixed-1 | \\x1b]0;title\\x07done\\x1b[31m" in proc.stdout, proc.stdout[-3000:]
    else:
        for name in OPS[operation]:
            assert name in proc.stdout, proc.stdout[-3000:]
        assert "failure_class=data_error\\x1b[2J\\x1b[H" in proc.stdout, proc.stdout[-3000:]  # mixed-2's heartbeat
