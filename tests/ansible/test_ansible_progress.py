"""The operator sees progress (issue 32 item 4): a hung job's diagnosis says when the watchdog acts, `make status`
shows the last checkpoint in every state (training too), and a failed health check's diagnosis is printed once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml
from ansible.module_utils.dflash_health import check_health
from ansible.module_utils.dflash_host import LocalHost
from test_ansible_health import ACTIVE, Trainer, params, write_heartbeat

from dflash.ops.results import ContainerStatus, _describe

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "roles" / "job" / "tasks"


def hung(tmp_path, heartbeat_age=100.0, **kw):
    """A snapshot of a job whose step 7 is `heartbeat_age` seconds old (hung for a 30 s window)."""
    (tmp_path / "job.log").write_text("step 7\n")
    os.utime(tmp_path / "job.log", (time.time() - 100, time.time() - 100))
    write_heartbeat(tmp_path / "heartbeat.json", 7, age=heartbeat_age)
    result = check_health(LocalHost(), params(tmp_path, timeout=0, progress_window=30, **kw), lambda: dict(ACTIVE))
    assert result["state"] == "hung"
    return result


def watchdog_lines(result):
    return [line for line in result["diagnosis"].splitlines() if line.startswith("watchdog: ")]


def test_a_hung_jobs_diagnosis_says_when_the_watchdog_acts(tmp_path):
    result = hung(tmp_path, watchdog=600)
    [line] = watchdog_lines(result)
    # 600 s after the last step's ping, which was 100 s (and a little) ago
    assert line.startswith("watchdog: it acts in about ") and "(600s after the last step's ping, step 7 " in line
    remaining = int(line.removeprefix("watchdog: it acts in about ").split("s ", 1)[0])
    assert 495 <= remaining <= 500
    assert line in result["hint"] and result["hint"].startswith("restart it with -e dflash_job_state=restarted")
    # the lines before it stay: the restart command, then the hang evidence
    lines = result["diagnosis"].splitlines()
    restart = next(i for i, text in enumerate(lines) if text.startswith("the job is hung: "))
    stacks = next(i for i, text in enumerate(lines) if text.startswith("stacks: "))
    assert restart < stacks < lines.index(line)


def test_without_a_watchdog_a_hung_job_stays_hung_until_restarted(tmp_path):
    for kw in ({}, {"watchdog": 0}):
        [line] = watchdog_lines(hung(tmp_path, **kw))
        assert line == "watchdog: none (dflash_job_watchdog 0): it stays hung until restarted"


def test_a_watchdog_whose_interval_ran_out_acts_now(tmp_path):
    [line] = watchdog_lines(hung(tmp_path, heartbeat_age=100, watchdog=60))
    assert line.startswith("watchdog: its 60s after the last step's ping (step 7) ran out ")
    assert "it acts now" in line


def test_before_the_first_step_the_watchdog_is_the_start_up_interval(tmp_path):
    (tmp_path / "job.log").write_text("loading\n")
    os.utime(tmp_path / "job.log", (time.time() - 100, time.time() - 100))
    write_heartbeat(tmp_path / "heartbeat.json", 0, status="training", age=100)
    result = check_health(LocalHost(), params(tmp_path, timeout=0, progress_window=30, watchdog=600),
                          lambda: dict(ACTIVE))  # fmt: skip
    assert result["state"] == "hung"
    [line] = watchdog_lines(result)
    assert "dflash_job_watchdog_start" in line


def test_a_training_job_has_no_watchdog_line(tmp_path):
    trainer = Trainer(tmp_path)
    trainer.start()
    try:
        result = check_health(LocalHost(), params(tmp_path, watchdog=600), lambda: dict(ACTIVE))
    finally:
        trainer.running = False
    assert result["state"] == "training" and not watchdog_lines(result) and result["hint"] is None


@pytest.mark.parametrize("state", ["training", "starting", "hung", "stopped", "crashed"])
def test_make_status_shows_the_last_checkpoint_in_every_state(state):
    """`make status` is `dflash ops status`: one line per job, the checkpoint in it whatever the state."""
    line = _describe(ContainerStatus(host="c1", state=state, step=40, tokens_per_s=1234.0 if state == "training" else None,
                                     checkpoint="step-00000040"))  # fmt: skip
    assert "checkpoint step-00000040" in line


def test_status_yml_shows_the_last_checkpoint_and_the_watchdog(tmp_path):
    """roles/job/templates/status.txt.j2 (playbooks/status.yml), rendered as Ansible renders it (trim_blocks)."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters.update(dirname=os.path.dirname, bool=bool)
    template = env.from_string((ROOT / "roles" / "job" / "templates" / "status.txt.j2").read_text())
    result = hung(tmp_path, watchdog=600)
    health = {**result, "checkpoint": "step-00000040"}
    variables = {"inventory_hostname": "c1", "dflash_job_name": "job", "_dflash_job_multinode": False,
                 "_dflash_job_gpu_ids": [], "dflash_job_log_path": "/log"}  # fmt: skip
    lines = template.render(dflash_job_health=health, **variables).splitlines()
    assert "checkpoint step-00000040" in lines
    assert any(line.strip().startswith("restart it with") and "watchdog: it acts in about " in line for line in lines)
    training = {**health, "state": "training", "ok": True, "failures": [], "hint": None}
    assert "checkpoint step-00000040" in template.render(dflash_job_health=training, **variables).splitlines()


def _tasks(path):
    """Every task of a tasks file, blocks flattened, the job's health check as it runs (_as_run)."""
    out = []
    for task in yaml.safe_load(path.read_text()) or []:
        out.append(task)
        out.extend(t for t in task.get("block", []) + task.get("rescue", []) + task.get("always", []))
    return [_as_run(t) for t in out]


def _as_run(task):
    """A task that imports roles/job/tasks/health.yml (the role's one dflash_health call) as Ansible runs it: the
    shared task with the caller's `when` and the caller's choices (its name, its timeout, in the background or not);
    any other task as it is."""
    if task.get("ansible.builtin.import_tasks") != "health.yml":
        return task
    [shared] = yaml.safe_load((TASKS / "health.yml").read_text())
    chosen = task.get("vars") or {}
    check = {key: value for key, value in shared.items() if key not in ("async", "poll")}
    check.update(name=chosen["_dflash_job_health_task"], when=task.get("when"))
    check["dflash_health"] = {**shared["dflash_health"],
                              "timeout": chosen.get("_dflash_job_health_timeout", shared["dflash_health"]["timeout"])}
    if chosen.get("_dflash_job_health_background") is True:  # else async 0: an ordinary task
        check.update({"async": shared["async"], "poll": shared["poll"]})
    return check


def _prints_a_diagnosis(task):
    printer = task.get("ansible.builtin.fail") or task.get("ansible.builtin.debug") or {}
    msg = str(printer.get("msg", ""))
    return ".diagnosis" in msg or "diagnoses.txt.j2" in msg


def test_a_failed_health_checks_diagnosis_is_printed_once():
    """A failed task prints its message twice (the error and the result): the health checks only report, one debug
    task prints the diagnosis, and the failure that follows is a summary (unhealthy.txt.j2, rollback.txt.j2)."""
    for path, printers_expected in (("verify.yml", 1), ("launch.yml", 2)):
        tasks = _tasks(TASKS / path)
        assert all(t["dflash_health"].get("fail_on_unhealthy") is False for t in tasks if "dflash_health" in t)
        printers = [t for t in tasks if _prints_a_diagnosis(t)]
        assert len(printers) == printers_expected and all("ansible.builtin.debug" in t for t in printers), path
        for fail in [t for t in tasks if "ansible.builtin.fail" in t]:
            assert "diagnosis" not in fail["ansible.builtin.fail"]["msg"].replace("diagnosis is above", ""), fail["name"]
    for name in ("unhealthy.txt.j2", "rollback.txt.j2", "summary.txt.j2"):
        assert "{{ h.diagnosis" not in (ROOT / "roles" / "job" / "templates" / name).read_text(), name
        assert "diagnosis }}" not in (ROOT / "roles" / "job" / "templates" / name).read_text(), name
    launch = _tasks(TASKS / "launch.yml")
    no_rollback, rollback = [t for t in launch if _prints_a_diagnosis(t)]
    assert "not _dflash_job_rolling_back | bool" in no_rollback["when"]
    [block] = [t for t in yaml.safe_load((TASKS / "launch.yml").read_text()) if rollback in t.get("block", [])]
    assert block["when"] == "_dflash_job_rolling_back | bool"


def test_a_job_that_does_not_train_prints_its_diagnosis_once_and_fails_with_a_summary(tmp_path):
    """roles/job/tasks/verify.yml on this machine (daemon backend) for a job whose trainer is gone."""
    name = f"progress-gone-{os.getpid()}"
    (tmp_path / "job.log").write_text("loading the target\ndflash: error: data.train_path /x does not exist\n")
    variables = {"dflash_job_name": name, "dflash_job_backend": "daemon", "dflash_job_log_path": str(tmp_path / "job.log"),
                 "dflash_job_run_dir": str(tmp_path / "run"), "dflash_job_health_timeout": 2,
                 "dflash_job_health_poll_interval": 1, "_dflash_job_unit_state_dir": str(tmp_path / "unit")}  # fmt: skip
    proc = run_play(tmp_path, [{"name": "Verify", "ansible.builtin.include_role": {"name": "job", "tasks_from": "verify.yml"},
                                "vars": variables}], ANSIBLE_ROLES_PATH=str(ROOT / "roles"))  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count(f"dflash job '{name}' is NOT healthy") == 1, out  # the diagnosis' head, once
    assert out.count("  | loading the target") == 1, out  # its log tail, once
    [summary] = [line for line in out.splitlines() if line.startswith("[ERROR]: Task failed: Action failed: dflash job ")]
    assert f"dflash job {name} on localhost does not train (" in summary and "The diagnosis is above." in summary
    assert "dflash: error: data.train_path /x does not exist" in summary


FAKE_BUILD = """#!/bin/sh
# dflash-build-rootfs's contract: CACHE SUITE MIRROR PACKAGES; the marker last; `built rootfs cache` on stdout
set -eu
cache="$1"
[ "$2" = bookworm ] && [ "$4" = "systemd,python3" ] || { echo "bad arguments: $*" >&2; exit 2; }
echo "I: Retrieving InRelease" > "$cache.log"
sleep "${FAKE_BUILD_SECONDS:-0}"
echo "I: Extracting libc6..." >> "$cache.log"
sleep "${FAKE_BUILD_SECONDS:-0}"
[ -z "${FAKE_BUILD_FAIL:-}" ] || { echo "debootstrap: E: Failed getting release file" >&2; exit 1; }
mkdir -p "$cache" && echo "$4" > "$cache/.dflash-rootfs-complete"
echo "built rootfs cache $cache"
"""


def run_rootfs_build(tmp_path, *args, **env):
    """roles/container/tasks/lxc/rootfs.yml on localhost (its apt task left out), with a fake debootstrap script."""
    import subprocess
    import sys

    role = tmp_path / "roles" / "container"
    (role / "tasks").mkdir(parents=True, exist_ok=True)
    (role / "files").mkdir(exist_ok=True)
    tasks = yaml.safe_load((ROOT / "roles" / "container" / "tasks" / "lxc" / "rootfs.yml").read_text())
    assert tasks[0]["name"] == "Install the LXC host tools"
    (role / "tasks" / "rootfs.yml").write_text(yaml.safe_dump(tasks[1:], sort_keys=False))
    (role / "files" / "dflash-build-rootfs").write_text(FAKE_BUILD)
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "Build", "hosts": "localhost", "connection": "local", "gather_facts": False,
        "vars": {"dflash_container_rootfs_cache": str(tmp_path / "cache" / "bookworm"),
                 "dflash_container_debian_suite": "bookworm", "dflash_container_debian_mirror": "http://mirror",
                 "dflash_container_rootfs_packages": ["systemd", "python3"]},
        "tasks": [{"name": "Rootfs", "ansible.builtin.include_role": {"name": "container", "tasks_from": "rootfs.yml"}}],
    }]))  # fmt: skip
    environ = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_ROLES_PATH": str(tmp_path / "roles"),
               "ANSIBLE_PYTHON_INTERPRETER": sys.executable, "ANSIBLE_ASYNC_DIR": str(tmp_path / "async"),
               "ANSIBLE_NOCOLOR": "1", **env}  # fmt: skip
    return subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", *args, str(playbook)],
                          cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300)  # fmt: skip


def test_the_rootfs_build_prints_what_it_waits_for_every_10_s_until_it_is_built(tmp_path):
    proc = run_rootfs_build(tmp_path, FAKE_BUILD_SECONDS="12")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    waits = [line for line in proc.stdout.splitlines() if line.startswith("[localhost] ")]
    # 24 s: a line at 10 s (the first log line) and one at 20 s (the second): what it waits for, the log's newest line
    assert len(waits) >= 2, proc.stdout
    assert all(" waiting for the rootfs build (debootstrap bookworm): log " in line for line in waits), waits
    assert waits[0].endswith(": I: Retrieving InRelease") and waits[-1].endswith(": I: Extracting libc6..."), waits
    assert (tmp_path / "cache" / "bookworm" / ".dflash-rootfs-complete").read_text() == "systemd,python3\n"
    assert "changed: [localhost]" in proc.stdout.split("Wait for the rootfs build")[-1]
    again = run_rootfs_build(tmp_path)  # built: the build and its wait are skipped
    assert again.returncode == 0 and "changed=0" in again.stdout and "skipped=4" in again.stdout, again.stdout


def test_a_failed_rootfs_build_fails_the_wait_with_its_error(tmp_path):
    proc = run_rootfs_build(tmp_path, FAKE_BUILD_FAIL="1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "debootstrap: E: Failed getting release file" in proc.stdout
    assert not (tmp_path / "cache" / "bookworm" / ".dflash-rootfs-complete").exists()


def test_check_mode_builds_no_rootfs(tmp_path):
    proc = run_rootfs_build(tmp_path, "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "cache").exists()


# --- dflash_wait (playbooks/action_plugins): a background task's wait that says what it waits for ----------------


def _load_wait_plugin():
    import importlib.util

    path = ROOT / "playbooks" / "action_plugins" / "dflash_wait.py"
    spec = importlib.util.spec_from_file_location("_test_dflash_wait", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_play(tmp_path, tasks, *args, **env):
    """A play of `tasks` on localhost with the repository's ansible.cfg (its action_plugins)."""
    import subprocess
    import sys

    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{"name": "Play", "hosts": "localhost", "connection": "local",
                                         "gather_facts": False, "tasks": tasks}], sort_keys=False))  # fmt: skip
    environ = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
               "ANSIBLE_ASYNC_DIR": str(tmp_path / "async"), "ANSIBLE_NOCOLOR": "1",
               "ANSIBLE_LOCAL_TEMP": str(tmp_path / ".ansible-tmp"), **env}  # fmt: skip
    return subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", *args, str(playbook)],
                          cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300)  # fmt: skip


def wait_lines(stdout, host="localhost"):
    return [line for line in stdout.splitlines() if line.startswith(f"[{host}] ")]


# A trainer's first steps: one log line and one heartbeat every 4 s, the heartbeat written atomically.
FAKE_STEPS = """set -eu
for step in 1 2 3 4 5 6; do
  echo "step $step epoch 0 loss 3.2100" >> "$LOG"
  printf '{"step": %d, "status": "training"}' "$step" > "$HB.tmp" && mv "$HB.tmp" "$HB"
  sleep 4
done
echo "trained"
"""


def _background(cmd, register="job", **env):
    return {"name": "Start it", "ansible.builtin.shell": cmd, "environment": env, "async": 120, "poll": 0,
            "register": register}  # fmt: skip


def test_the_wait_prints_the_step_and_the_logs_growth_every_10_s_until_the_task_ends(tmp_path):
    log, beat = tmp_path / "job.log", tmp_path / "heartbeat.json"
    proc = run_play(tmp_path, [
        _background(FAKE_STEPS, LOG=str(log), HB=str(beat)),
        {"name": "Wait", "dflash_wait": {"jid": "{{ job.ansible_job_id }}", "what": "proof of training",
                                         "log": str(log), "heartbeat": str(beat)}, "register": "waited"},
        {"name": "Show", "ansible.builtin.debug": {"msg": "RESULT {{ waited.finished }} {{ waited.stdout }}"}},
    ])  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = wait_lines(proc.stdout)
    assert len(lines) >= 2, proc.stdout  # the task runs 24 s: lines while it runs, none after it ended
    for line in lines:
        assert " waiting for proof of training: heartbeat step " in line, line
        # the heartbeat's step and the log's newest line are read together: the same step or the next one
        step = int(line.split("heartbeat step ")[1].split()[0])
        assert "(training); log " in line and line.split(": step ")[1].split()[0] in (str(step), str(step + 1)), line
    assert ", +" in lines[-1]  # the log grew since the line before
    assert "RESULT True trained" in proc.stdout  # the task's own result is the wait's
    assert proc.stdout.count("Wait] ***") == 1


def test_a_failed_background_task_fails_the_wait_once_with_its_message(tmp_path):
    proc = run_play(tmp_path, [_background("printf 'dflash: error: %s\\n' 'no such file' >&2; exit 2"),
                               {"name": "Wait", "dflash_wait": {"jid": "{{ job.ansible_job_id }}", "what": "it"}}])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.count("dflash: error: no such file") == 1, proc.stdout
    assert "rc: 2" in proc.stdout


def test_the_wait_gives_up_after_its_timeout_naming_what_and_the_job(tmp_path):
    proc = run_play(tmp_path, [_background("sleep 30"),
                               {"name": "Wait", "dflash_wait": {"jid": "{{ job.ansible_job_id }}",
                                                                "what": "the slow thing", "timeout": 1}}])  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gave up waiting for the slow thing after 1s; it goes on in the background on localhost" in proc.stdout


def test_the_wait_reads_the_results_file_while_the_task_runs_and_async_status_once_it_ended(tmp_path):
    """A check while the task runs is one `cat` of its results file (a few ms on the target), not a module run
    (about 0.2 s of CPU each, every 1-3 s of every wait); async_status gives the ended task's result, once."""
    # 12 s: room for at least three checks while it runs even when the wait starts seconds late on a loaded machine
    proc = run_play(tmp_path, [_background("sleep 12; echo slept"),
                               {"name": "Wait", "dflash_wait": {"jid": "{{ job.ansible_job_id }}", "what": "it"},
                                "register": "waited"},
                               {"name": "Show", "ansible.builtin.debug": {"msg": "RESULT {{ waited.finished }} {{ waited.stdout }}"}}],
                    "-vvv")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reads = [line for line in proc.stdout.splitlines() if "EXEC" in line and "cat " in line and str(tmp_path / "async") in line]
    assert len(reads) >= 3, proc.stdout  # checked at once, 1 s and 3 s later, then every 3 s while it ran
    assert proc.stdout.count("modules/async_status.py") == 1, proc.stdout  # "Using module file ...": one run
    assert "RESULT True slept" in proc.stdout


def test_only_the_async_wrappers_running_mark_reads_as_running():
    plugin = _load_wait_plugin()
    assert plugin.still_running('{"started": true, "finished": false, "ansible_job_id": "j1"}')
    assert plugin.still_running('{"started": 1, "finished": 0, "ansible_job_id": "j1"}')
    # a finished task's file holds its module's result; a half-read or missing file is async_status's to judge
    for text in ('{"changed": true, "rc": 0, "stdout": "x"}', '{"started": 1, "finished": 1}', "", '{"started": 1',
                 "[1]", "cat: /root/.ansible_async/j1: No such file or directory"):
        assert not plugin.still_running(text), text


def test_a_line_names_a_log_and_a_heartbeat_that_are_not_there_yet():
    plugin = _load_wait_plugin()
    progress = plugin.parse_progress({"size": None, "line": None, "heartbeat": None, "heartbeat_error": "missing"})
    assert progress == plugin.NO_PROGRESS | {"heartbeat_error": "missing"}
    assert plugin.describe(progress, None, True, True) == "no heartbeat yet; no log yet"
    assert plugin.parse_progress({"failed": True, "msg": "boom"}) == plugin.NO_PROGRESS  # a failed read: nothing yet
    # what the target's reader refused or found invalid is said, never shown raw
    refused = plugin.parse_progress({"heartbeat_error": "heartbeat file h is not a regular file (fifo): not read",
                                     "log_error": "is a symbolic link (to /dev/zero), which root does not follow"})
    assert plugin.describe(refused, None, True, True) == ("heartbeat not read (not a plain file of the trainer's); log is a "
                                                          "symbolic link (to /dev/zero), which root does not follow: not read")
    invalid = plugin.parse_progress({"heartbeat": {"step": "7"}, "heartbeat_error": "h: invalid heartbeat: it is ..."})
    assert plugin.describe(invalid, None, False, True) == "invalid heartbeat"
    assert plugin.describe(plugin.parse_progress({"size": 3, "line": "a\x1b[2Jb\n"}), None, True, False) == \
        "log 3 B: a\\x1b[2Jb\\x0a"  # the controller's own guard


def test_a_line_shows_pips_newest_line_without_its_timestamp_and_the_growth():
    plugin = _load_wait_plugin()
    line = "2026-12-04T01:10:00,123   Downloading tokenizers-0.22.1-cp39-abi3-manylinux.whl (3.3 MB)"
    progress = plugin.parse_progress({"size": 2048, "line": line, "heartbeat": None})
    assert progress["size"] == 2048
    text = plugin.describe(progress, 1024, True, False)
    assert text == "log 2.0 kB, +1.0 kB: Downloading tokenizers-0.22.1-cp39-abi3-manylinux.whl (3.3 MB)"


def test_the_progress_reader_reads_the_newest_matching_line(tmp_path):
    from ansible.module_utils.dflash_untrusted import newest_line

    log = tmp_path / "pip's log"  # a path with a quote and a space
    log.write_text("2026-12-04T01:10:00,1 Collecting a\n2026-12-04T01:10:01,1 Created temporary directory\n"
                   "2026-12-04T01:10:02,1   Downloading a-1.whl (1 kB)\r 50%\n2026-12-04T01:10:03,1 Looking up b\n")
    pattern = r"^\S+ +(Collecting|Downloading)"
    assert newest_line(str(log), pattern) == (log.stat().st_size, "2026-12-04T01:10:02,1   Downloading a-1.whl (1 kB)")
    assert newest_line(str(tmp_path / "missing.log"), pattern) == (None, None)
    assert newest_line(str(log), "^nothing") == (log.stat().st_size, None)


# --- the roles' long tasks run in the background, each waited for by dflash_wait ---------------------------------


def _all_tasks(path):
    out = []

    def walk(tasks):
        for task in tasks or []:
            out.append(task)
            for key in ("block", "rescue", "always"):
                walk(task.get(key))

    walk(yaml.safe_load(path.read_text()))
    return [_as_run(t) for t in out]


@pytest.mark.parametrize("path, module", [
    ("roles/container/tasks/lxc/rootfs.yml", None),
    ("roles/venv/tasks/venv.yml", "ansible.builtin.pip"),
    ("roles/kernels/tasks/fla.yml", "ansible.builtin.pip"),
    ("roles/kernels/tasks/causal_conv1d.yml", None),
    ("roles/job/tasks/launch.yml", "dflash_health"),
    ("roles/job/tasks/verify.yml", "dflash_health"),
])  # fmt: skip
def test_every_long_task_runs_in_the_background_and_its_wait_says_what_it_waits_for(path, module):
    tasks = _all_tasks(ROOT / path)
    started = [t for t in tasks if t.get("poll") == 0]
    assert started and all(t.get("register") and t.get("async") for t in started), path
    waits = [t for t in tasks if "dflash_wait" in t]
    assert len(waits) == len(started), path
    for start in started:
        # its wait: the first one after it (the job's health checks share one register, _dflash_job_health)
        after = next(i for i, t in enumerate(tasks) if t is start)
        wait = next(w for w in tasks[after:] if "dflash_wait" in w)
        assert wait["dflash_wait"]["jid"] == "{{ " + start["register"] + ".ansible_job_id }}", (path, wait["name"])
        assert wait["dflash_wait"]["what"] and wait.get("when") == start.get("when"), (path, wait["name"])
        assert wait["dflash_wait"].get("log"), (path, wait["name"])  # it says what is happening, not only that it waits
    # no pip install and no health window left in the foreground (a task that prints nothing for minutes); the
    # health snapshot (timeout 0) and the install of a built wheel (--no-deps, seconds) are quick
    long_ones = [t["name"] for t in tasks if module and module in t and t.get("poll") != 0
                 and t[module].get("timeout") != 0 and "--no-deps" not in str(t[module].get("extra_args"))]
    assert not long_ones, long_ones


def test_the_health_windows_waits_show_the_jobs_step_and_log():
    for path in ("launch.yml", "verify.yml"):
        for task in [t for t in _all_tasks(TASKS / path) if "dflash_wait" in t]:
            wait = task["dflash_wait"]
            assert "heartbeat" in wait and "log" in wait and "trains" in wait["what"], task["name"]


def test_dflash_ops_reads_a_background_health_check_from_its_wait_and_a_failure_from_the_summary():
    """A health check run in the background reports through its wait (dflash_wait); the deploy's failure is then
    a one-line summary (a `fail` task) whose diagnosis is that check's."""
    from dflash.ops.results import EventCollector

    diagnosis = "dflash job 'j' is NOT healthy (crashed) after 3s:\n  - unit: unit failed: exit status 2\nlog x (last 1 lines):\n  | dflash: error: boom"
    health = {"healthy": False, "state": "crashed", "diagnosis": diagnosis, "failures": [], "step": 4,
              "checkpoint": "step-00000004", "unit": {"backend": "systemd", "active_state": "failed", "exit_status": 2},
              "finished": True, "ansible_job_id": "j1.2", "started": True}  # fmt: skip
    collector = EventCollector()
    collector.add({"event": "runner_on_ok", "event_data": {"host": "c1", "task": "Start asserting that the trainer trains",
                   "role": "job", "task_action": "dflash_health", "res": {"ansible_job_id": "j1.2", "started": 1, "finished": 0}}})  # fmt: skip
    collector.add({"event": "runner_on_ok", "event_data": {"host": "c1", "task": "Wait for proof that the trainer trains",
                   "role": "job", "resolved_action": "dflash_wait", "res": health}})  # fmt: skip
    collector.add({"event": "runner_on_failed", "event_data": {"host": "c1", "task": "Assert that the trainer trains", "role": "job",
                   "task_action": "ansible.builtin.fail",
                   "res": {"failed": True, "msg": "dflash job j on c1 does not train (crashed): unit failed: exit status 2. The diagnosis is above."}}})  # fmt: skip
    result = collector.result("train", "train.yml", "inv", "failed", 2)
    container = result.containers["c1"]
    assert container.state == "crashed" and container.checkpoint == "step-00000004" and container.exit_status == 2
    [failure] = result.failures
    assert failure.task == "job : Assert that the trainer trains" and failure.diagnosis == diagnosis
    assert "unit: unit failed: exit status 2" in failure.headline
