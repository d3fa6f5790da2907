"""Root never follows the trainer's paths: the trainer account owns its run directory and can put a FIFO, a
device or a symbolic link where root expects its heartbeat or log. Root's readers answer at once with a
reason, read nothing outside, and never hang; the files root writes keep the mode it asks for."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
from ansible.module_utils.dflash_health import check_health
from ansible.module_utils.dflash_host import LocalHost, read_text, read_text_checked, tail_lines
from ansible.module_utils.dflash_unit_daemon import DaemonBackend
from ansible.module_utils.dflash_unit_spec import UnitError
from conftest import ROOT, tool, wait_for

# The unit is this test process, launched an hour ago (as in test_ansible_health).
ACTIVE = {"load_state": "loaded", "active_state": "active", "sub_state": "running", "main_pid": os.getpid(),
          "exit_status": None, "result": None, "backend": "daemon", "started_at": time.time() - 3600}  # fmt: skip
SECRET_STEP = 424242


def _run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.log").write_text("step 1 epoch 0 loss 3.2100\n")
    return run


def _secret(tmp_path):
    """A root-only heartbeat-shaped file outside the run directory."""
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    path = secret / "heartbeat.json"
    path.write_text(json.dumps({"step": SECRET_STEP, "time": time.time(), "pid": os.getpid(), "status": "training"}))
    os.chmod(path, 0o600)
    return path


def _status(run):
    """One status snapshot (what playbooks/status.yml asks: timeout 0) in a thread: (finished?, result)."""
    params = {"name": "job", "log_path": str(run / "job.log"), "heartbeat_path": str(run / "heartbeat.json"),
              "gpu_ids": [], "gpu_min_memory_mib": 1024, "timeout": 0, "progress_window": 60, "poll_interval": 1,
              "log_lines": 5}  # fmt: skip
    result = {}
    worker = threading.Thread(target=lambda: result.update(check_health(LocalHost(), params, lambda: dict(ACTIVE))),
                              daemon=True)  # fmt: skip
    worker.start()
    worker.join(5)
    return not worker.is_alive(), result


def _release_fifo(path):
    """Unblock a reader stuck in open() of a FIFO (the old code): open the write end and close it."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.mark.parametrize("name", ["heartbeat.json", "job.log"])
def test_a_fifo_in_the_run_directory_is_reported_not_waited_on(tmp_path, name):
    run = _run_dir(tmp_path)
    if name == "job.log":
        (run / name).unlink()
    os.mkfifo(run / name)
    try:
        answered, result = _status(run)
    finally:
        _release_fifo(run / name)
    assert answered, f"status did not answer with {name} a FIFO"
    assert result["heartbeat"] is None
    if name == "heartbeat.json":
        assert f"heartbeat file {run / name} is not a regular file (fifo)" in result["diagnosis"]
    else:
        assert f"log {run / name} is not a regular file (fifo): not read" in result["diagnosis"]


def test_a_heartbeat_linked_to_dev_zero_is_refused_unread(tmp_path):
    run = _run_dir(tmp_path)
    os.symlink("/dev/zero", run / "heartbeat.json")
    answered, result = _status(run)
    assert answered, "status did not answer with heartbeat.json -> /dev/zero"
    assert result["heartbeat"] is None
    assert f"heartbeat file {run / 'heartbeat.json'} is a symbolic link" in result["diagnosis"]


def test_a_heartbeat_linked_to_a_root_only_file_is_not_read(tmp_path):
    run = _run_dir(tmp_path)
    os.symlink(_secret(tmp_path), run / "heartbeat.json")
    answered, result = _status(run)
    assert answered
    assert result["heartbeat"] is None and result["step"] is None
    assert str(SECRET_STEP) not in json.dumps(result, default=str)
    assert f"heartbeat file {run / 'heartbeat.json'} is a symbolic link" in result["diagnosis"]


def test_a_run_directory_replaced_by_the_trainers_link_is_not_followed(tmp_path):
    secret = _secret(tmp_path)
    (tmp_path / "job.log").write_text("step 1\n")
    run = tmp_path / "run"
    os.symlink(secret.parent, run)
    os.lchown(run, 4242, 4242)  # the trainer's link, in a directory the trainer owns
    answered, result = _status(run)
    assert answered
    assert result["heartbeat"] is None and str(SECRET_STEP) not in json.dumps(result, default=str)
    assert f"is under {run}, a symbolic link owned by uid 4242, which root does not follow" in result["diagnosis"]


def test_root_owned_links_are_followed_and_missing_files_keep_the_default(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("hello\n")
    os.symlink(tmp_path / "real", tmp_path / "link")  # root's own link in a path: followed
    assert read_text(str(tmp_path / "link" / "f")) == "hello\n"
    assert read_text(str(tmp_path / "missing"), "dflt") == "dflt"
    assert read_text_checked(str(tmp_path / "missing")) == (None, None)
    assert read_text(f"/proc/{os.getpid()}/stat").startswith(f"{os.getpid()} (")  # /proc: size 0, still read


def test_readers_cap_the_size_they_read(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as handle:
        handle.truncate(8 << 20)  # sparse: 8 MiB of zeros
    text, reason = read_text_checked(str(big))
    assert text is None and "larger than 1 MiB" in reason
    assert read_text(str(big), "dflt") == "dflt"
    (tmp_path / "log").write_text("a\n" * 10 + "last\n")
    assert tail_lines(str(tmp_path / "log"), 2) == ["a", "last"]


def test_a_hard_link_is_not_read(tmp_path):
    """Another name of a file (where the kernel does not protect hard links, the trainer may link a root-only file
    into its run directory): refused, the file's content unread."""
    secret = _secret(tmp_path)
    run = _run_dir(tmp_path)
    os.link(secret, run / "heartbeat.json")
    text, reason = read_text_checked(str(run / "heartbeat.json"))
    assert text is None and reason == "has 2 hard links, which root does not read"
    answered, result = _status(run)
    assert answered and result["heartbeat"] is None and str(SECRET_STEP) not in json.dumps(result, default=str)


@pytest.mark.parametrize("beat", [
    {"step": 5, "time": "x"}, {"step": [1]}, {"step": 5, "pid": "1"}, {"step": True}, {"step": 5, "loss": "nan?"},
    [1], "step", None, "[" * 200_000 + "]" * 200_000, "[" * 20_000 + "]" * 20_000, '{"step": 5, "time": NaN}',
])  # fmt: skip
def test_a_heartbeat_of_the_wrong_shape_is_an_invalid_heartbeat_not_a_crash(tmp_path, beat):
    run = _run_dir(tmp_path)
    (run / "heartbeat.json").write_text(beat if isinstance(beat, str) else json.dumps(beat))
    answered, result = _status(run)
    assert answered and "diagnosis" in result, result
    assert result["heartbeat"] is None
    assert f"heartbeat file {run / 'heartbeat.json'}: invalid heartbeat: it is " in result["diagnosis"], result["diagnosis"]


def test_a_directory_or_device_is_unreadable_with_its_kind(tmp_path):
    assert read_text_checked(str(tmp_path))[1] == "is not a regular file (directory)"
    text, reason = read_text_checked("/dev/null", follow=True)
    assert text is None and reason == "is not a regular file (character device)"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_the_log_reader_never_follows_the_trainers_link(tmp_path):
    from ansible.module_utils.dflash_logs import read_log

    log = tmp_path / "job.log"
    os.symlink(_secret(tmp_path), log)
    with pytest.raises(OSError, match="is a symbolic link .*which root does not follow") as err:
        read_log(str(log))
    assert str(SECRET_STEP) not in str(err.value)


@pytest.fixture
def module_host(tmp_path, monkeypatch):
    """A ModuleHost around a real AnsibleModule (its atomic_move), built in this process."""
    from ansible.module_utils import basic
    from ansible.module_utils.dflash_host import ModuleHost

    args = {"ANSIBLE_MODULE_ARGS": {"_ansible_tmpdir": str(tmp_path), "_ansible_remote_tmp": str(tmp_path)}}
    monkeypatch.setattr(basic, "_ANSIBLE_ARGS", json.dumps(args).encode())
    monkeypatch.setattr(basic, "_ANSIBLE_PROFILE", "legacy")
    return ModuleHost(basic.AnsibleModule(argument_spec={}))


def test_the_environment_file_is_0600_through_ansibles_atomic_move(tmp_path, module_host):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    env_file = state / "environment"
    module_host.atomic_write(str(env_file), 'HF_TOKEN="secret"\n', mode=0o600)  # new file
    assert env_file.stat().st_mode & 0o7777 == 0o600
    os.chmod(env_file, 0o644)  # as an earlier release left it
    module_host.atomic_write(str(env_file), 'HF_TOKEN="other"\n', mode=0o600)
    assert env_file.stat().st_mode & 0o7777 == 0o600 and env_file.read_text() == 'HF_TOKEN="other"\n'
    module_host.atomic_write(str(state / "hook.sh"), "#!/bin/sh\n", mode=0o755)  # wider than the umask allows
    assert (state / "hook.sh").stat().st_mode & 0o7777 == 0o755
    module_host.atomic_write(str(state / "plain"), "x\n")
    assert (state / "plain").stat().st_mode & 0o7777 == 0o644
    assert sorted(p.name for p in state.iterdir()) == ["environment", "hook.sh", "plain"]  # no temp file left



def test_the_one_atomic_writer_never_follows_a_link_at_its_temp_name_or_its_target(tmp_path):
    """dflash_host.write_atomic (the module_utils' one writer): a link planted at the temp name is replaced, not
    written through; a link at the target is replaced by the file; the mode is set before the data is written."""
    from ansible.module_utils.dflash_host import open_directory_nofollow, write_atomic

    outside = tmp_path / "outside"
    outside.write_text("keep\n")
    directory = tmp_path / "dir"
    directory.mkdir()
    os.symlink(outside, directory / ".probe.tmp")
    os.symlink(outside, directory / "probe")
    fd, _ = open_directory_nofollow(str(directory))
    try:
        write_atomic("probe", "token\n", 0o640, tmp_name=".probe.tmp", dir_fd=fd)
    finally:
        os.close(fd)
    assert outside.read_text() == "keep\n"
    assert not (directory / "probe").is_symlink() and (directory / "probe").read_text() == "token\n"
    assert (directory / "probe").stat().st_mode & 0o7777 == 0o640
    write_atomic(str(directory / "unit"), b"[Unit]\n", 0o600)
    assert (directory / "unit").stat().st_mode & 0o7777 == 0o600
    assert sorted(p.name for p in directory.iterdir()) == ["probe", "unit"]  # no temp file left

# --- the daemon backend: the watchdog channel and the failure hook --------------------------------------------

LOOP = [sys.executable, "-u", "-c", "import time\nprint('up', flush=True)\nwhile True:\n    time.sleep(0.1)"]
HOOK_SECRET = "hooks.example/T0KEN-d0-not-show"


@pytest.fixture
def daemon(tmp_path):
    backend = DaemonBackend(LocalHost())
    specs = []

    def make(command, **kw):
        spec = {"name": "rootpaths-" + tmp_path.name[-20:], "command": command, "log_path": str(tmp_path / "job.log"),
                "state_dir": str(tmp_path / "state"), "stop_timeout": 5, "working_directory": str(tmp_path), **kw}  # fmt: skip
        specs.append(spec)
        return spec

    yield backend, make
    for spec in specs:  # never leave a process behind
        backend.stop({**spec, "stop_timeout": 1})


def _notify_as(uid, address, message):
    """Send one sd_notify datagram to an abstract ``@address`` from a child process running as ``uid``."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if uid:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(message, "\0" + address[1:])
            code = 0
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0


def _notify_socket(pid):
    with open(f"/proc/{pid}/environ", "rb") as handle:
        env = dict(item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item)
    return env[b"NOTIFY_SOCKET"].decode()


def test_the_watchdog_hears_only_root_and_the_jobs_user(daemon):
    backend, make = daemon
    spec = make(LOOP, watchdog={"interval": 600, "start_interval": 600}, restart={"policy": "no"})
    backend.start(spec)
    first = wait_for(lambda: backend.status(spec)["main_pid"])
    address = _notify_socket(first)
    # Another account (nobody) asks for an instant watchdog expiry: dropped, said once in the job's log.
    _notify_as(65534, address, b"WATCHDOG_USEC=1\nWATCHDOG=1\n")
    refused = "dflash-unit: ignored a watchdog message from uid 65534"
    wait_for(lambda: refused in open(spec["log_path"]).read() or backend.status(spec)["main_pid"] != first)
    status = backend.status(spec)
    assert status["main_pid"] == first and status["watchdog_kills"] == 0, status
    assert refused in open(spec["log_path"]).read()
    # root (the job's user here) is heard: the same message ends the job by its watchdog.
    _notify_as(0, address, b"WATCHDOG_USEC=1\nWATCHDOG=1\n")
    status = wait_for(lambda: (s := backend.status(spec))["watchdog_kills"] and s)
    assert status and status["last_exit_reason"] == "watchdog (killed KILL)"


def test_the_failure_hooks_arguments_are_in_no_command_line_or_readable_file(daemon, tmp_path):
    backend, make = daemon
    hook = ["/bin/sh", "-c", f"echo https://{HOOK_SECRET} >/dev/null"]
    spec = make(LOOP, on_failure=hook, restart={"policy": "on-failure", "delay": 1, "burst": 3, "interval": 60})
    backend.start(spec)
    assert wait_for(lambda: backend.status(spec)["main_pid"])
    supervisor = json.loads(open(os.path.join(spec["state_dir"], "pid")).read())["supervisor_pid"]
    with open(f"/proc/{supervisor}/cmdline", "rb") as handle:
        argv = handle.read().decode(errors="replace")
    assert spec["state_dir"] in argv  # it is the supervisor's command line
    assert HOOK_SECRET not in argv
    for path in tmp_path.rglob("*"):  # where it is written, only root can read it
        if path.is_file() and HOOK_SECRET in path.read_text(errors="replace"):
            assert path.stat().st_mode & 0o077 == 0, path
            assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700


def test_the_daemon_never_appends_its_log_through_a_link(daemon, tmp_path):
    backend, make = daemon
    target = tmp_path / "root-file"
    target.write_text("root's\n")
    os.symlink(target, tmp_path / "job.log")
    spec = make(LOOP)
    with pytest.raises(UnitError, match=r"log_path .*job.log is not a regular file \(symbolic link\)"):
        backend.start(spec)
    assert target.read_text() == "root's\n"


# --- hostile job names and paths: refused by the first task of every playbook ---------------------------------

HOSTILE_NAMES = ["../../../tmp/evil", "x; touch /tmp/pwned", "two words\nand a line"]
# What the deploy of these names wrote before the check moved to the first task (and what a shell would).
WOULD_BE_WRITTEN = ["/tmp/evil.env", "/tmp/evil.yaml", "/var/tmp/evil", "/tmp/pwned", "/var/lib/dflash-units/x; touch "
                    "/tmp/pwned", "/etc/dflash/two words\nand a line.env"]  # fmt: skip


def _run_playbook(tmp_path, playbook, extra, raw_extra=None):
    # Nothing may run in the "container": only the first task, delegated to the controller, can run at all.
    inventory = {"all": {"children": {"dflash_hosts": {"hosts": {}}, "dflash_containers": {"hosts": {"evil-box": {
        "ansible_connection": "local", "ansible_python_interpreter": str(tmp_path / "no-python-here")}}}}}}
    (tmp_path / "hosts.yml").write_text(json.dumps(inventory))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / ".ansible-tmp"), "ANSIBLE_REMOTE_TEMP": str(tmp_path / ".ansible-remote")}  # fmt: skip
    return subprocess.run([tool("ansible-playbook"), "-i", str(tmp_path / "hosts.yml"), str(ROOT / "playbooks" / playbook),
                           "-e", raw_extra or json.dumps(extra)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip


def _assert_refused_first(proc, message):
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    tasks = [line for line in proc.stdout.splitlines() if line.startswith("TASK [")]
    assert tasks and "Refuse unknown dflash_* variables and invalid job names and paths" in tasks[-1], tasks
    assert len([t for t in tasks if "included" not in t and "Refuse unknown" not in t]) == 0, tasks
    assert "invalid job name or path on evil-box" in out and message in out, out[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_job_names_are_refused_by_the_first_task_of_train(tmp_path, name):
    before = {p: os.path.lexists(p) for p in WOULD_BE_WRITTEN}
    proc = _run_playbook(tmp_path, "train.yml", {"dflash_job_name": name})
    _assert_refused_first(proc, "is not a valid job name")
    assert {p: os.path.lexists(p) for p in WOULD_BE_WRITTEN} == before


@pytest.mark.slow
@pytest.mark.parametrize("playbook", ["provision.yml", "deploy.yml", "status.yml", "stop.yml"])
def test_every_playbook_refuses_a_hostile_name_first(tmp_path, playbook):
    before = {p: os.path.lexists(p) for p in WOULD_BE_WRITTEN}
    proc = _run_playbook(tmp_path, playbook, {"dflash_job_name": HOSTILE_NAMES[0]})
    _assert_refused_first(proc, "is not a valid job name")
    assert {p: os.path.lexists(p) for p in WOULD_BE_WRITTEN} == before


@pytest.mark.slow
def test_a_key_value_extra_var_split_at_a_space_is_refused_first(tmp_path):
    """-e "dflash_job_name=a b": Ansible sets dflash_job_name=a and keeps `b` as _raw_params; deployed, a job `a` would
    start beside the inventory's. Refused by the first task, naming the stray word and the two fixes."""
    proc = _run_playbook(tmp_path, "train.yml", None, raw_extra="dflash_job_name=a b")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    tasks = [line for line in proc.stdout.splitlines() if line.startswith("TASK [")]
    assert tasks and "Refuse unknown dflash_* variables and invalid job names and paths" in tasks[-1], tasks
    assert "-e left 'b' without a variable name: Ansible splits -e KEY=VALUE at spaces" in out, out[-4000:]


@pytest.mark.slow
def test_a_run_directory_outside_by_dot_dot_is_refused_first(tmp_path):
    proc = _run_playbook(tmp_path, "train.yml", {"dflash_job_run_dir": "/var/lib/dflash/runs/../../../tmp/evil"})
    _assert_refused_first(proc, "dflash_job_run_dir '/var/lib/dflash/runs/../../../tmp/evil' must be an absolute path")


# --- the job role: root never follows a link the trainer put at its run directory -----------------------------


@pytest.mark.slow
def test_a_deploy_refuses_a_run_directory_linked_to_a_root_directory(tmp_path):
    repo = tmp_path / "repo"
    (repo / "dflash").mkdir(parents=True)
    (repo / "dflash" / "__init__.py").write_text("")
    (repo / "configs").mkdir()
    (repo / "configs" / "fake.yaml").write_text("output_dir: runs/fake\nseed: 0\n")
    (repo / "pyproject.toml").write_text("[project]\nname = 'fake'\n")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, tmp_path / "venv" / "bin" / "python")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "job.env").write_text("OMP_NUM_THREADS=1\n")
    # root's private directories, and the trainer's (uid 4242) links to them
    targets = {}
    for which in ("run", "parent"):
        target = targets[which] = tmp_path / f"root-only-{which}"
        target.mkdir(mode=0o700)
        (target / "job").mkdir(mode=0o700)
        (target / "secret").write_text("root's\n")
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, 4242, 4242)
    os.symlink(targets["run"], home / "run")  # the run directory itself is the trainer's link
    os.lchown(home / "run", 4242, 4242)
    os.symlink(targets["parent"], home / "runs")  # a parent of the run directory is the trainer's link
    os.lchown(home / "runs", 4242, 4242)
    before = {k: (os.stat(t), sorted(os.listdir(t))) for k, t in targets.items()}

    name = f"rootpaths-{os.getpid()}"
    host = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, "dflash_job_name": name,
            "dflash_job_backend": "daemon", "dflash_job_source_dir": str(repo), "dflash_job_base_config": "fake.yaml",
            "dflash_job_venv": str(tmp_path / "venv"), "dflash_job_user": "root", "dflash_job_root": str(tmp_path / "opt"),
            "dflash_job_config_path": str(tmp_path / "etc" / "job.yaml"), "dflash_job_log_path": str(tmp_path / "log" / "job.log"),
            "dflash_job_env_file": str(tmp_path / "etc" / "job.env"), "dflash_job_validate_config": False,
            "dflash_job_stop_timeout": 2, "dflash_job_health_timeout": 5}  # fmt: skip
    (tmp_path / "hosts.yml").write_text(json.dumps({"all": {"children": {"dflash_containers": {"hosts": {"here": host}}}}}))

    def deploy(run_dir, key):
        return {"name": f"Deploy into {key}", "block": [
            {"name": "Deploy", "ansible.builtin.include_role": {"name": "job"}, "vars": {"dflash_job_run_dir": run_dir}}],
            "rescue": [{"name": "Keep the failure", "ansible.builtin.set_fact": {key: (
                "{{ (ansible_failed_result.results | default([ansible_failed_result]))"
                " | map(attribute='msg', default='') | select | join('; ') }}")}}]}

    play = [{"name": "Deploy", "hosts": "dflash_containers", "gather_facts": False, "tasks": [
        deploy(str(home / "run"), "run_link"), deploy(str(home / "runs" / "job"), "parent_link"),
        {"name": "Dump", "ansible.builtin.copy": {"dest": str(tmp_path / "results.json"), "mode": "0644",
                                                   "content": "{{ {'run_link': run_link | default(none), 'parent_link': parent_link | default(none)} | to_json }}"}},
    ]}]  # fmt: skip
    (tmp_path / "play.yml").write_text(json.dumps(play))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / ".ansible-tmp")}  # fmt: skip
    try:
        proc = subprocess.run([tool("ansible-playbook"), "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    finally:  # the old code went on and launched a job: never leave it running
        spec = {"name": name, "state_dir": f"/var/lib/dflash-units/{name}", "stop_timeout": 1}
        DaemonBackend(LocalHost()).stop(spec)
        subprocess.run(["rm", "-rf", spec["state_dir"]], check=False)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for which, key, link in (("run", "run_link", home / "run"), ("parent", "parent_link", home / "runs")):
        st, entries = before[which]
        after = os.stat(targets[which])
        assert (after.st_uid, after.st_gid, stat.S_IMODE(after.st_mode)) == (st.st_uid, st.st_gid, 0o700), which
        assert sorted(os.listdir(targets[which])) == entries, which
        assert os.stat(targets[which] / "job").st_mode & 0o777 == 0o700
        message = results[key] or ""
        assert f"{link} is a symbolic link owned by uid 4242" in message and "root does not follow it" in message, message


@pytest.mark.parametrize("made_by_the_other", ["directory", "trainers link"])
def test_a_component_made_between_the_check_and_mkdir_is_taken_as_found(tmp_path, monkeypatch, made_by_the_other):
    """Two nodes of a multi-node job create the run directory on shared storage at once: the one whose mkdir comes
    second finds it made (EEXIST) and goes on with it as with any existing component - a directory is opened, a
    link of another account is still refused."""
    from ansible.module_utils import dflash_host

    shared, target = tmp_path / "shared", tmp_path / "elsewhere"
    shared.mkdir()
    target.mkdir()
    real_mkdir = os.mkdir

    def other_node_first(name, mode=0o777, *, dir_fd=None):
        if name == "run":  # the other node's mkdir lands between this one's stat and mkdir
            if made_by_the_other == "directory":
                real_mkdir(name, mode, dir_fd=dir_fd)
            else:
                os.symlink(str(target), name, dir_fd=dir_fd)
                os.chown(name, 65534, 65534, dir_fd=dir_fd, follow_symlinks=False)
        return real_mkdir(name, mode, dir_fd=dir_fd)

    monkeypatch.setattr(dflash_host.os, "mkdir", other_node_first)
    if made_by_the_other == "directory":
        fd, created = dflash_host.open_directory_nofollow(str(shared / "run" / "logs"), create=True)
        try:
            assert os.path.samefile(f"/proc/self/fd/{fd}", shared / "run" / "logs") and created
        finally:
            os.close(fd)
    else:
        with pytest.raises(dflash_host.UnsafeFile, match=r"run is a symbolic link owned by"):
            dflash_host.open_directory_nofollow(str(shared / "run" / "logs"), create=True)
        assert not (target / "logs").exists()


# --- what runs as root on the job's behalf runs in root's environment -----------------------------------------

ROOT_VARIABLES = {"PATH", "HOME", "LANG", "PWD", "SHLVL", "_"}  # what a shell adds of its own: PWD, SHLVL, _


def _trainers_home(tmp_path):
    """A home of the trainer's with a Python .pth in its user site and a ~/.curlrc, both writing a marker when read."""
    home = tmp_path / "trainer-home"
    site = home / ".local" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    site.mkdir(parents=True)
    (site / "evil.pth").write_text(f"import os; open({str(tmp_path / 'PWNED-pth')!r}, 'w').close()\n")
    (home / ".curlrc").write_text(f'output = "{tmp_path / "PWNED-curl"}"\n')
    return home


@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="needs the system's python3 (a user site)")
def test_the_daemons_failure_hook_and_supervisor_run_in_roots_environment(daemon, tmp_path):
    """The job's environment (its HOME the trainer's, a PATH and PYTHONPATH of its choice) is the job's only: the
    supervisor and the failure hook (exit 3, data_error: never restarted, the hook runs at once) get root's, so a
    trainer-planted .pth or ~/.curlrc does nothing as root."""
    backend, make = daemon
    home = _trainers_home(tmp_path)
    (tmp_path / "bin").mkdir()
    hook = ["/bin/sh", "-c", "curl -s file:///dev/null; /usr/bin/python3 -c 'import os; print(\"HOOK-ENV\", sorted(os.environ))'"]
    spec = make(["/bin/sh", "-c", "sleep 0.5; exit 3"], on_failure=hook,
                environment={"HOME": str(home), "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "MARKER": "job-env",
                             "PYTHONPATH": str(tmp_path)},
                restart={"policy": "on-failure", "delay": 1, "burst": 3, "interval": 60})  # fmt: skip
    backend.start(spec)
    supervisor = json.loads(open(os.path.join(spec["state_dir"], "pid")).read())["supervisor_pid"]
    with open(f"/proc/{supervisor}/environ", "rb") as handle:
        env = dict(item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item)
    assert set(env) == {b"PATH", b"HOME", b"LANG"} and env[b"HOME"] != str(home).encode(), env
    assert wait_for(lambda: "HOOK-ENV" in open(spec["log_path"]).read(), timeout=60), open(spec["log_path"]).read()
    line = next(line for line in open(spec["log_path"]).read().splitlines() if line.startswith("HOOK-ENV"))
    assert set(eval(line.split(" ", 1)[1])) <= ROOT_VARIABLES | {"DFLASH_JOB", "DFLASH_REASON", "DFLASH_FAILURE_CLASS"}
    assert not (tmp_path / "PWNED-pth").exists() and not (tmp_path / "PWNED-curl").exists()


def test_the_systemd_recorder_and_hook_run_in_roots_environment(tmp_path):
    """ExecStopPost= runs in the unit's environment (the job's): the recorder runs its script again under env -i in
    root's, every command by its absolute path, so a PATH of the trainer's (a `date` there) runs nothing."""
    import shlex

    from ansible.module_utils.dflash_unit_systemd import hook_unit_text, record_dropin_text

    state, evil = tmp_path / "state", tmp_path / "evil-bin"
    state.mkdir()
    evil.mkdir()
    for name in ("date", "grep", "systemctl", "env", "sh"):
        (evil / name).write_text(f"#!/bin/sh\ntouch {tmp_path / 'PWNED'}-{name}\n")
        (evil / name).chmod(0o755)
    spec = {"name": "j", "command": ["/bin/true"], "log_path": str(tmp_path / "j.log"), "state_dir": str(state),
            "restart": {"policy": "on-failure"}, "on_failure": ["/usr/local/bin/notify"]}  # fmt: skip
    argv = shlex.split(record_dropin_text(spec).splitlines()[-1].removeprefix("ExecStopPost=-+").replace("%%", "%"))
    job_env = {"PATH": str(evil), "HOME": str(_trainers_home(tmp_path)), "MARKER": "job-env", "EXIT_CODE": "exited",
               "EXIT_STATUS": "4", "SERVICE_RESULT": "exit-code"}  # fmt: skip
    subprocess.run(argv, env=job_env, check=True, timeout=60, capture_output=True)
    assert (state / "exit_status").read_text() == "exited 4\n"
    assert (state / "events").read_text().split()[1:] == ["exit-code", "exited", "4"]  # the date by /bin/date
    assert not list(tmp_path.glob("PWNED*")), list(tmp_path.glob("PWNED*"))
    # what the script sees: root's environment and systemd's three variables, nothing of the job's
    probe = argv[:6] + [f'env > "{tmp_path}/env"']
    subprocess.run(probe, env=job_env, check=True, timeout=60)
    seen = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines())
    assert set(seen) <= ROOT_VARIABLES | {"EXIT_CODE", "EXIT_STATUS", "SERVICE_RESULT"}, seen
    assert seen["PATH"] == "/usr/sbin:/usr/bin:/sbin:/bin" and seen["HOME"] == "/root"
    # the hook unit: root's environment stated, the documented DFLASH_* variables, no environment file of the job's
    hook = hook_unit_text(spec)
    assert "Environment=PATH=/usr/sbin:/usr/bin:/sbin:/bin\nEnvironment=HOME=/root\n" in hook
    assert [line for line in hook.splitlines() if line.startswith("EnvironmentFile=")] == [f"EnvironmentFile=-{state}/reason.env"]


@pytest.mark.parametrize("backend", ["daemon", "systemd"])
def test_a_log_another_account_could_replace_is_refused_by_both_backends(tmp_path, fake_host, backend):
    """Root's unit appends the job's output to its log (systemd's append: follows a link): a log directory of another
    account's or writable by others, or a log with another name (a hard link), is refused before anything starts."""
    from ansible.module_utils.dflash_unit_systemd import SystemdBackend

    logs = tmp_path / "logs"
    logs.mkdir()
    spec = {"name": "j", "command": ["/bin/true"], "log_path": str(logs / "job.log"), "state_dir": str(tmp_path / "state")}
    start = (DaemonBackend(LocalHost()) if backend == "daemon" else SystemdBackend(fake_host())).start
    os.chown(logs, 4242, 4242)
    with pytest.raises(UnitError, match=f"its directory {logs} is owned by uid 4242: another account"):
        start(spec)
    os.chown(logs, 0, 0)
    logs.chmod(0o777)
    with pytest.raises(UnitError, match=f"its directory {logs} is writable by other accounts \\(mode 777\\)"):
        start(spec)
    logs.chmod(0o755)
    os.link(_secret(tmp_path), logs / "job.log")
    with pytest.raises(UnitError, match="job.log has 2 hard links"):
        start(spec)
    assert not (tmp_path / "state").exists()  # nothing started, nothing written
