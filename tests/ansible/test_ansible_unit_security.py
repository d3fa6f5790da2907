"""Regression tests of the unit module's security review: names and paths that reach systemd or a shell,
root's state outside what the trainer can write, pid identity before a signal, no environment value on a
command line or in Ansible's output, environment files that a value cannot extend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from ansible.module_utils.dflash_host import LocalHost
from ansible.module_utils.dflash_unit_daemon import DaemonBackend
from ansible.module_utils.dflash_unit_procs import job_processes, proc_stat
from ansible.module_utils.dflash_unit_records import check_root_owned
from ansible.module_utils.dflash_unit_spec import (
    DEFAULT_STATE_ROOT,
    UnitError,
    check_name,
    environment_file_text,
    parse_environment_file,
)
from ansible.module_utils.dflash_unit_systemd import (
    CLEAN_RECORDER,
    RECORD_EXIT_SCRIPT,
    SystemdBackend,
    record_dropin_text,
    systemd_run_args,
)
from conftest import ROOT, tool

# Values systemd itself read back unchanged from these lines (checked with systemd 252 in a container:
# `systemd-run --wait -p EnvironmentFile=FILE /usr/bin/env`).
NASTY = {"A": 'a"b', "B": "$HOME x", "C": "back`tick`", "D": "sl\\ash\\", "E": "semi;colon # hash", "F": "it's",
         "G": "${PATH}"}  # fmt: skip


@pytest.mark.parametrize("name", ["a;b", "a`id`", "a>b", "a b", "../x", ".x", "", "x/y", "a$b", "a%n", "a\nb", "x" * 65])
def test_job_names_outside_the_strict_pattern_are_refused(name):
    with pytest.raises(UnitError, match="not a valid job name"):
        check_name(name)


def test_plain_job_names_pass():
    assert check_name("dflash-train_2") == "dflash-train_2"


def test_the_exit_recorder_is_a_fixed_script_and_the_directory_only_its_argument(tmp_path):
    spec = {"name": "j", "command": ["/bin/true"], "log_path": "/var/log/j.log", "state_dir": str(tmp_path / "state")}
    post = next(line for line in record_dropin_text(spec).splitlines() if line.startswith("ExecStopPost="))
    script, clean = (text.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))
                     for text in (RECORD_EXIT_SCRIPT.replace("%", "%%"), CLEAN_RECORDER))
    # the state directory, the unit's name and the exit codes restarted at most once (none: no restarts) as arguments
    assert post == f'ExecStopPost=-+/bin/sh -c "{clean}" "{tmp_path}/state" "j.service" "" "{script}"'
    # the script run the way systemd runs it: the directory is data ($0), whatever it holds
    odd = tmp_path / "we;ird $(touch pwned)"
    odd.mkdir()
    env = {"EXIT_CODE": "killed", "EXIT_STATUS": "KILL", "SERVICE_RESULT": "signal", "PATH": "/usr/bin:/bin"}
    subprocess.run(["/bin/sh", "-c", RECORD_EXIT_SCRIPT, str(odd)], env=env, check=True, cwd=tmp_path)
    assert (odd / "exit_status").read_text() == "killed KILL\n"
    assert (odd / "events").read_text().split()[1:] == ["signal", "killed", "KILL"]
    assert parse_environment_file((odd / "reason.env").read_text()) == {"DFLASH_REASON": "signal: killed KILL",
                                                                     "DFLASH_FAILURE_CLASS": "signal"}
    assert not (tmp_path / "pwned").exists()


def test_dollar_in_the_command_is_not_expanded_by_systemd():
    spec = {"name": "j", "command": ["/bin/echo", "$HOME", "a$$b"], "log_path": "/l", "state_dir": "/var/lib/dflash-units/j"}
    assert systemd_run_args(spec)[-3:] == ["/bin/echo", "$$HOME", "a$$$$b"]


def test_environment_values_never_reach_the_command_line(tmp_path, fake_host):
    host = fake_host()
    host.atomic_write = LocalHost().atomic_write  # real files and modes; systemctl and systemd-run stay fake
    spec = {"name": "j", "command": ["/bin/true"], "log_path": str(tmp_path / "j.log"), "state_dir": str(tmp_path / "state"),
            "environment": {"HF_TOKEN": "hf_secret_value", **NASTY}}  # fmt: skip
    SystemdBackend(host).start(spec)
    run = next(c for c in host.calls if c[0] == "systemd-run")
    assert not any("hf_secret_value" in word for word in run)
    env_file = tmp_path / "state" / "environment"
    assert f"EnvironmentFile={env_file}" in run
    assert env_file.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
    assert parse_environment_file(env_file.read_text()) == {"HF_TOKEN": "hf_secret_value", **NASTY}


def test_environment_values_with_a_newline_are_refused_naming_the_key():
    with pytest.raises(UnitError, match="environment variable X: the value must be one line"):
        environment_file_text({"X": "a\nINJECTED=1"})
    with pytest.raises(UnitError, match="name 'A B' is not valid"):
        environment_file_text({"A B": "x"})


def test_the_env_roles_lines_read_back_unchanged_and_refuse_newlines():
    sys.path.insert(0, str(ROOT / "roles" / "env" / "filter_plugins"))
    try:
        from dflash_env import env_line
    finally:
        sys.path.pop(0)
    from ansible.errors import AnsibleFilterError

    text = "".join(env_line(k, v) + "\n" for k, v in NASTY.items())
    assert parse_environment_file(text) == NASTY
    assert text == environment_file_text(NASTY)  # the role and the module write the same syntax
    with pytest.raises(AnsibleFilterError, match="HF_TOKEN: the value holds a newline") as err:
        env_line("HF_TOKEN", "secret\nLD_PRELOAD=/tmp/x.so")
    assert "secret" not in str(err.value)


def test_state_root_is_outside_the_trainer_accounts_home():
    home = (ROOT / "roles" / "venv" / "defaults" / "main.yml").read_text()
    assert "dflash_venv_home: /var/lib/dflash\n" in home
    assert not (DEFAULT_STATE_ROOT + "/").startswith("/var/lib/dflash/")
    assert "/var/lib/dflash-units/" in (ROOT / "roles" / "job" / "vars" / "main.yml").read_text()


def test_a_state_dir_another_account_could_replace_is_refused(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, 4242, 4242)  # the trainer's home
    with pytest.raises(UnitError, match="owned by uid 4242"):
        check_root_owned(str(home / "units" / "j"))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # writable by all, not sticky
    with pytest.raises(UnitError, match="only root may write it"):
        check_root_owned(str(shared / "j"))
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(UnitError, match="symbolic link"):
        check_root_owned(str(tmp_path / "link" / "j"))
    check_root_owned(str(tmp_path / "ok" / "j"))  # root's own (tmp_path's parents: root or sticky /tmp)


def test_start_refuses_a_state_dir_in_the_trainers_home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, 4242, 4242)
    spec = {"name": "j", "command": ["/bin/true"], "log_path": str(tmp_path / "j.log"), "state_dir": str(home / "units" / "j")}
    with pytest.raises(UnitError, match="owned by uid 4242"):
        DaemonBackend(LocalHost()).start(spec)
    assert not (home / "units").exists()


def test_a_forged_pidfile_never_gets_a_process_signalled(tmp_path):
    victim = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.2)
        state = tmp_path / "state"
        state.mkdir(mode=0o700)
        record = {"pid": victim.pid, "pgid": victim.pid, "supervisor_pid": None, "token": "f" * 32,
                  "starttime": proc_stat(victim.pid)[2]}  # right pid and start time, but not the job
        (state / "pid").write_text(json.dumps(record))
        spec = {"name": "j", "state_dir": str(state), "stop_timeout": 1}
        assert job_processes(record) == []
        DaemonBackend(LocalHost()).stop(spec)
        assert victim.poll() is None  # still alive: never signalled
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.slow
def test_the_module_keeps_environment_values_out_of_its_output(tmp_path):
    play = tmp_path / "play.yml"
    play.write_text(json.dumps([{"hosts": "localhost", "gather_facts": False, "tasks": [
        {"dflash_unit": {"name": "nolog-job", "backend": "daemon", "command": [sys.executable, "-c", "import time; time.sleep(30)"],
                         "log_path": str(tmp_path / "job.log"), "state_dir": str(tmp_path / "state"),
                         "environment": {"HF_TOKEN": "hf_do_not_print"}, "restart": "no"}},
        {"dflash_unit": {"name": "nolog-job", "state": "absent", "backend": "daemon", "state_dir": str(tmp_path / "state")}},
    ]}]))  # fmt: skip
    env = {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1", "PATH": f"{sys.prefix}/bin:/usr/bin:/bin",
           "HOME": str(tmp_path), "ANSIBLE_LOCAL_TEMP": str(tmp_path / ".ansible-tmp")}  # fmt: skip
    out = subprocess.run([tool("ansible-playbook"), "-vvv", "-i", "localhost,", "-c", "local", "-e",
                          f"ansible_python_interpreter={sys.executable}", str(play)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "hf_do_not_print" not in out.stdout + out.stderr
    assert "VALUE_SPECIFIED_IN_NO_LOG_PARAMETER" in out.stdout
