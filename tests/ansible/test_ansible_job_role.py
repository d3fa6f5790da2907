"""The job role end to end on this machine (daemon backend, local connection) with a stand-in trainer that
follows the runtime contract (log lines, heartbeat.json, `dflash: error:` + exit 2): the second run changes
nothing, a config change restarts, a config the trainer's check rejects leaves the config file, the code and
the running job as they were, a new release whose trainer exits at its start is rolled back to the job that
trained (code, config file, unit) and fails naming the trainer's error, a trainer that exits at once with no
job to go back to fails the play with its own error, and a job stopped on purpose reads `stopped`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_unit_daemon import DaemonBackend
from conftest import ROOT, tool

pytestmark = pytest.mark.slow

# Stands in for `VENV/bin/python -m dflash train CONFIG [--check]`.
FAKE_PYTHON = textwrap.dedent(f"""\
    #!{sys.executable}
    import json, os, signal, sys, time
    import yaml
    if sys.argv[1:4] != ["-m", "dflash", "train"]:
        os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])
    config = yaml.safe_load(open(sys.argv[4]))
    if "--check" in sys.argv:
        if config.get("fake_reject"):
            print("dflash: error: " + config["fake_reject"], file=sys.stderr)
            sys.exit(2)
        print("config OK")
        sys.exit(0)
    if config.get("fake_error"):
        print("dflash: error: " + config["fake_error"], file=sys.stderr)
        sys.exit(2)
    out = config["output_dir"]
    os.makedirs(out, exist_ok=True)
    step = 0
    def beat(status):
        data = dict(step=step, epoch=0, time=time.time(), pid=os.getpid(), status=status, loss=3.21, tau=1.05, tokens_per_s=1234.0)
        with open(out + "/heartbeat.json.tmp", "w") as f:
            json.dump(data, f)
        os.replace(out + "/heartbeat.json.tmp", out + "/heartbeat.json")
    def stop(signum, frame):  # as the trainer: SIGTERM = checkpoint, heartbeat `stopped`, exit 0
        beat("stopped")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    # While OUT/fake-starting exists the job reads `starting` (a target still loading); a new start removes it.
    flag = out + "/fake-starting"
    if os.path.exists(flag):
        os.unlink(flag)
    while True:
        if os.path.exists(flag):
            beat("starting")
        else:
            step += 1
            print(f"step {{step}} epoch 0 loss 3.2100 acc@1 0.120 tau 1.05 tok/s 1234 lr 6.00e-04 mem 0.10GiB", flush=True)
            beat("training")
        time.sleep(0.2)
""")


def _include(**variables):
    return {"name": "Deploy", "ansible.builtin.include_role": {"name": "job"}, "vars": variables}


def _keep(name):
    return {"name": f"Keep {name}", "ansible.builtin.set_fact": {name: "{{ dflash_job_unit }}"}}


@pytest.fixture(scope="module")
def role_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jobrole")
    repo = tmp / "repo"
    (repo / "dflash").mkdir(parents=True)
    (repo / "dflash" / "__init__.py").write_text("")
    (repo / "configs").mkdir()
    (repo / "configs" / "fake.yaml").write_text("output_dir: runs/fake\nseed: 0\nlogging:\n  interval: 1\n")
    (repo / "pyproject.toml").write_text("[project]\nname = 'fake'\n")
    (tmp / "venv" / "bin").mkdir(parents=True)
    (tmp / "venv" / "bin" / "python").write_text(FAKE_PYTHON)
    os.chmod(tmp / "venv" / "bin" / "python", 0o755)
    (tmp / "etc").mkdir()
    (tmp / "etc" / "job.env").write_text("OMP_NUM_THREADS=1\n")
    host = {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
        "dflash_job_name": "fakejob", "dflash_job_backend": "daemon", "dflash_job_source_dir": str(repo),
        "dflash_job_base_config": "fake.yaml", "dflash_job_venv": str(tmp / "venv"), "dflash_job_user": "root",
        "dflash_job_root": str(tmp / "opt"), "dflash_job_run_dir": str(tmp / "run"), "dflash_job_config_path": str(tmp / "etc" / "job.yaml"),
        "dflash_job_log_path": str(tmp / "log" / "job.log"), "dflash_job_env_file": str(tmp / "etc" / "job.env"),
        "dflash_job_stop_timeout": 5,
        "dflash_job_health_timeout": 300, "dflash_job_health_progress_window": 120, "dflash_job_health_poll_interval": 1,
        # a watchdog that never fires here (the stand-in does not ping): the unit must still be given it
        "dflash_job_watchdog": 700, "dflash_job_watchdog_start": 1700,
    }  # fmt: skip
    inventory = {"all": {"children": {"dflash_containers": {"hosts": {"here": host}}}}}
    # The unit state lives under /var/lib/dflash-units/NAME: use a name of this run.
    name = host["dflash_job_name"] = f"fakejob-{os.getpid()}"
    (tmp / "hosts.yml").write_text(yaml.safe_dump(inventory))
    tasks = [
        _include(dflash_job_config={"seed": 0}), _keep("first"),
        {"name": "Read the supervisor's options of the first launch", "ansible.builtin.slurp": {
            "src": f"/var/lib/dflash-units/{name}/supervisor.json"}, "register": "supervisor_first", "no_log": True},
        _include(dflash_job_config={"seed": 0}), _keep("second"),
        _include(dflash_job_config={"seed": 1}), _keep("changed"),
        {"name": "Reject", "block": [_include(dflash_job_config={"seed": 2, "fake_reject": "data.jsonl:7: malformed JSON"})],
         "rescue": [{"name": "Keep the rejection", "ansible.builtin.set_fact": {"rejected": "{{ ansible_failed_result }}"}}]},
        {"name": "Status after the rejection", "ansible.builtin.include_role": {"name": "job", "tasks_from": "status.yml"}},
        {"name": "Keep it", "ansible.builtin.set_fact": {"after_reject": "{{ dflash_job_health }}"}},
        {"name": "Read the config after the rejection", "ansible.builtin.slurp": {"src": str(tmp / "etc" / "job.yaml")},
         "register": "config_after_reject"},
        {"name": "Read the code release before the failing one", "ansible.builtin.stat": {"path": str(tmp / "opt" / "current")},
         "register": "current_before"},
        # A new release (code and config) whose trainer passes the checks but exits 2 at its start: rolled back.
        {"name": "Change the code", "ansible.builtin.copy": {"dest": str(repo / "dflash" / "__init__.py"), "content": "# v2\n",
                                                              "mode": "0644"}},
        {"name": "Crash", "block": [_include(dflash_job_config={"fake_error": "data.train_path /x does not exist; fix data.train_path"},
                                             dflash_job_validate_config=False)],
         "rescue": [{"name": "Keep the failure", "ansible.builtin.set_fact": {"crash": "{{ ansible_failed_result }}"}}]},
        {"name": "Status after the rollback", "ansible.builtin.include_role": {"name": "job", "tasks_from": "status.yml"}},
        {"name": "Keep the status", "ansible.builtin.set_fact": {"after_rollback": "{{ dflash_job_health }}"}},
        {"name": "Read the config after the rollback", "ansible.builtin.slurp": {"src": str(tmp / "etc" / "job.yaml")},
         "register": "config_after_rollback"},
        {"name": "Read the code release after the rollback", "ansible.builtin.stat": {"path": str(tmp / "opt" / "current")},
         "register": "current_after_rollback"},
        _include(dflash_job_config={"seed": 1}), _keep("recovered"),
        # The job is `starting` (not yet training) when a release that fails at its start is deployed: rolled back.
        {"name": "Make the job read starting", "ansible.builtin.copy": {"dest": str(tmp / "run" / "fake-starting"),
                                                                        "content": "", "mode": "0644"}},
        {"name": "Wait for its starting heartbeat", "ansible.builtin.wait_for": {
            "path": str(tmp / "run" / "heartbeat.json"), "search_regex": '"status": "starting"', "timeout": 300}},
        {"name": "Crash while starting", "block": [_include(dflash_job_config={"fake_error": "data.train_path /z does not exist"},
                                                            dflash_job_validate_config=False)],
         "rescue": [{"name": "Keep the failure while starting", "ansible.builtin.set_fact": {"crash_starting": "{{ ansible_failed_result }}"}}]},
        {"name": "Status after the rollback of a starting job", "ansible.builtin.include_role": {"name": "job", "tasks_from": "status.yml"}},
        {"name": "Keep that status", "ansible.builtin.set_fact": {"after_starting_rollback": "{{ dflash_job_health }}"}},
        {"name": "Stop on purpose", "ansible.builtin.include_role": {"name": "job", "tasks_from": "stop.yml"}},
        {"name": "Status of the stopped job", "ansible.builtin.include_role": {"name": "job", "tasks_from": "status.yml"}},
        {"name": "Keep that", "ansible.builtin.set_fact": {"stopped": "{{ dflash_job_health }}"}},
        # Nothing trained before this deploy: nothing to go back to, it fails with the launch's diagnosis.
        {"name": "Crash while stopped", "block": [_include(dflash_job_config={"fake_error": "data.train_path /y does not exist"},
                                                           dflash_job_validate_config=False)],
         "rescue": [{"name": "Keep that failure", "ansible.builtin.set_fact": {"crash_stopped": "{{ ansible_failed_result }}"}}]},
        {"name": "Stop", "ansible.builtin.include_role": {"name": "job", "tasks_from": "stop.yml"}, "vars": {"dflash_job_stop_state": "absent"}},
        {"name": "Dump", "ansible.builtin.copy": {"dest": str(tmp / "results.json"), "mode": "0644",
                                                   "content": "{{ {'first': first, 'second': second, 'changed': changed, 'crash': crash | default(none),"
                                                              " 'rejected': rejected | default(none), 'after_reject': after_reject,"
                                                              " 'config_after_reject': config_after_reject.content | b64decode,"
                                                              " 'recovered': recovered, 'stopped': stopped,"
                                                              " 'crash_stopped': crash_stopped | default(none), 'after_rollback': after_rollback,"
                                                              " 'config_after_rollback': config_after_rollback.content | b64decode,"
                                                              " 'current_before': current_before.stat.lnk_source,"
                                                              " 'current_after_rollback': current_after_rollback.stat.lnk_source,"
                                                              " 'watchdog_first': (supervisor_first.content | b64decode | from_json).watchdog,"
                                                              " 'crash_starting': crash_starting | default(none),"
                                                              " 'after_starting_rollback': after_starting_rollback} | to_json }}"}},
    ]  # fmt: skip
    (tmp / "play.yml").write_text(yaml.safe_dump([{"name": "Job role", "hosts": "dflash_containers", "gather_facts": False, "tasks": tasks}], sort_keys=False))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": str(tmp / ".ansible-tmp")}
    try:
        proc = subprocess.run([tool("ansible-playbook"), "-i", str(tmp / "hosts.yml"), str(tmp / "play.yml")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    finally:  # never leave the stand-in trainer running, whatever happened to the play
        spec = {"name": name, "state_dir": f"/var/lib/dflash-units/{name}", "stop_timeout": 1}
        DaemonBackend(LocalHost()).stop(spec)
        shutil.rmtree(spec["state_dir"], ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    results = json.loads((tmp / "results.json").read_text())
    results["_stdout"], results["_tmp"] = proc.stdout, tmp
    return results


def test_the_unit_gets_the_watchdog_the_inventory_asks_for(role_run):
    """The role hands `dflash_job_watchdog`/`_start` to the unit it launches (the module's own tests cannot see a
    role that drops the argument: the unit would then run with no watchdog, and a hung trainer would never be
    killed)."""
    assert role_run["watchdog_first"] == {"interval": 700, "start_interval": 1700}


def test_first_run_starts_and_second_changes_nothing(role_run):
    assert role_run["first"]["action"] == "started" and role_run["first"]["active_state"] == "active"
    assert role_run["second"]["action"] == "none" and not role_run["second"]["changed"]
    assert role_run["second"]["main_pid"] == role_run["first"]["main_pid"]
    assert "already running with this code and config" in role_run["_stdout"]


def test_config_change_restarts(role_run):
    changed = role_run["changed"]
    assert changed["action"] == "restarted" and changed["previous_hash"] == role_run["first"]["config_hash"]
    assert changed["main_pid"] != role_run["first"]["main_pid"]
    rendered = yaml.safe_load((role_run["_tmp"] / "etc" / "job.yaml").read_text())
    assert rendered["output_dir"] == str(role_run["_tmp"] / "run")  # forced to the run dir


def test_trainer_that_exits_at_once_fails_with_its_error(role_run):
    crash = role_run["crash_stopped"]
    assert crash is not None, "the crash deploy did not fail"
    assert "unit failed: exit status 2" in crash["msg"]
    assert "dflash: error: data.train_path /y does not exist" in crash["msg"]
    assert "ROLLED BACK" not in crash["msg"]  # the job did not train before: nothing to go back to


def test_new_release_that_fails_at_start_is_rolled_back(role_run):
    """Code and config that pass the checks but whose trainer exits 2 at its start: the previous release, config
    file (byte for byte) and unit train again, and the deploy fails naming the trainer's error."""
    crash, after = role_run["crash"], role_run["after_rollback"]
    assert crash is not None, "the deploy of a release that fails at start did not fail"
    head = crash["msg"].splitlines()[0]
    assert head.startswith("deploy of fakejob-")
    assert head.endswith(" ROLLED BACK: the new release did not train on here (unit failed: exit status 2): "
                         "dflash: error: data.train_path /x does not exist; fix data.train_path"), head
    assert "restored byte for byte" in crash["msg"] and "relaunched with the previous launch" in crash["msg"]
    assert "the previous job trains again: step" in crash["msg"]
    assert "dflash: error: data.train_path /x does not exist" in role_run["_stdout"]
    # the job of the accepted config runs again: a new process of the previous launch, its config file as it was
    assert after["state"] == "training" and after["unit"]["main_pid"] != role_run["changed"]["main_pid"]
    assert role_run["config_after_rollback"] == role_run["config_after_reject"]
    assert "fake_error" not in role_run["config_after_rollback"]
    assert role_run["current_after_rollback"] == role_run["current_before"]  # the previous code release
    assert (role_run["_tmp"] / "etc" / "job.yaml.previous").stat().st_mode & 0o777 == 0o644
    assert (role_run["_tmp"] / "etc" / "job.yaml.launch.json").stat().st_mode & 0o777 == 0o600


def test_a_release_failing_at_start_is_rolled_back_when_the_job_was_still_starting(role_run):
    """A job deployed over while it loads (`starting`: no step yet) is a job to go back to, as a training one is."""
    crash = role_run["crash_starting"]
    assert crash is not None, "the deploy of a release that fails at start did not fail"
    head = crash["msg"].splitlines()[0]
    assert " ROLLED BACK: the new release did not train on here (unit failed: exit status 2): " in head, head
    assert head.endswith("dflash: error: data.train_path /z does not exist"), head
    assert role_run["after_starting_rollback"]["state"] == "training"


def test_rejected_config_leaves_config_code_and_job_as_they_were(role_run):
    rejected, after = role_run["rejected"], role_run["after_reject"]
    assert rejected is not None, "the deploy of a config the trainer rejects did not fail"
    # the headline (the failed task's msg) names the file, the line and the fix, not only its stderr
    assert "dflash: error: data.jsonl:7: malformed JSON" in rejected["msg"]
    # The job of the config change runs on, untouched, and its config file is still the accepted one.
    assert after["state"] == "training" and after["unit"]["main_pid"] == role_run["changed"]["main_pid"]
    assert "fake_reject" not in role_run["config_after_reject"] and "seed: 1" in role_run["config_after_reject"]
    assert not (role_run["_tmp"] / "etc" / "job.yaml.tmp").exists()
    assert role_run["recovered"]["action"] in ("started", "restarted")  # after the crash, the good config starts again


def test_job_stopped_on_purpose_reads_stopped_and_ok(role_run):
    stopped = role_run["stopped"]
    assert stopped["state"] == "stopped" and stopped["ok"] and stopped["unit"]["active_state"] != "active"
