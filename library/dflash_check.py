#!/usr/bin/python
# Copyright: dflash authors
# Apache-2.0

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_check
short_description: Run the trainer's check of a run config and its data as the job's user, before the config is written
description:
  - Runs O(command) (the trainer's C(--check --check-data); C(%s) is the config) as O(user), the account that will run the
    trainer, in the job's working directory and environment - so a file the trainer cannot read is refused here, before
    anything is touched, not at the start of the new release.
  - The environment comes from O(environment_file) (root's, read as the unit reads it) and O(environment) (a module
    argument - Ansible passes it on the module's standard input or in a root-only file, never on a command line; it is
    never shown). The check runs in it on top of a fixed PATH and the user's HOME, and nothing else of root's.
  - With O(content), the config to be written to O(dest) is checked in a temp file beside O(dest) (root's, 0644, removed
    after); when O(dest) already holds exactly that and O(force) is false there is nothing to check (RV(checked) false).
    With O(path), that file is checked.
  - Before the check, every O(data_paths) must be readable by O(user) - else it fails with RV(failure_class)
    C(data_error) (exit 3, the trainer's class for a data file it cannot use).
  - A failed check fails the task with the trainer's own error (its C(dflash - error - ...) line), RV(rc) and
    RV(failure_class) (C(bad_input) for exit 2, C(data_error) for 3).
version_added: "0.4.0"
author: dflash authors
options:
  command:
    description: The check's argument list; C(%s) in an argument is replaced by the config's path.
    type: list
    elements: str
    required: true
  content:
    description: The config to check (the text that will be written to O(dest)). One of O(content) and O(path).
    type: str
  dest:
    description: Where O(content) will be written; the temp file goes beside it.
    type: path
  path:
    description: An existing config file to check (readable by O(user)).
    type: path
  force:
    description: Check O(content) even when O(dest) holds it already (new code, a restart).
    type: bool
    default: false
  user:
    description: The account that runs the check (the job's). Empty - the module's own.
    type: str
    default: ""
  working_directory:
    description: The check's working directory (the job's run directory).
    type: path
  environment_file:
    description: A root-owned KEY=VALUE file (systemd's EnvironmentFile= syntax) of the job's environment; a missing one is empty.
    type: path
  environment:
    description: The job's environment on top of O(environment_file). Never logged.
    type: dict
    default: {}
  data_paths:
    description: Data files the check must be able to read as O(user) before it runs.
    type: list
    elements: path
    default: []
  timeout:
    description: Seconds the check may take; it is killed after that.
    type: int
    default: 3600
attributes:
  check_mode:
    support: full
    description: Runs nothing in check mode (RV(checked) false), as the copy it stands before writes nothing.
  diff_mode:
    support: none
    description: No diff (the copy that writes the config shows it).
"""

EXAMPLES = r"""
- name: Validate the run config and its data as the job's user
  dflash_check:
    command: [/opt/dflash/venv/bin/python, -m, dflash, train, "%s", --check, --check-data]
    content: "{{ rendered_config }}"
    dest: /etc/dflash/dflash-train.yaml
    user: dflash
    working_directory: /var/lib/dflash/runs/dflash-train
    environment_file: /etc/dflash/dflash-train.env
    environment: "{{ job_environment }}"
    data_paths: [/data/train.jsonl]
"""

RETURN = r"""
checked:
  description: Whether the check ran (false - O(dest) holds O(content) already and not O(force), or check mode).
  returned: always
  type: bool
rc:
  description: The check's exit status (3 - a data path the user cannot read).
  returned: when checked
  type: int
stdout:
  description: The check's output.
  returned: when checked
  type: str
stderr:
  description: The check's error output (the trainer's C(dflash - error - ...) line).
  returned: when checked
  type: str
failure_class:
  description: The class of a failed check (C(bad_input), C(data_error), C(unknown), ...), null when it passed.
  returned: always
  type: str
"""

import json
import os
import pwd
import signal
import subprocess
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.dflash_failures import EXIT_CODES, class_of_exit
from ansible.module_utils.dflash_host import read_text, read_text_checked
from ansible.module_utils.dflash_unit_spec import parse_environment_file

ARGUMENT_SPEC = {
    "command": {"type": "list", "elements": "str", "required": True},
    "content": {"type": "str"},
    "dest": {"type": "path"},
    "path": {"type": "path"},
    "force": {"type": "bool", "default": False},
    "user": {"type": "str", "default": ""},
    "working_directory": {"type": "path"},
    "environment_file": {"type": "path"},
    "environment": {"type": "dict", "default": {}, "no_log": True},
    "data_paths": {"type": "list", "elements": "path", "default": []},
    "timeout": {"type": "int", "default": 3600},
}
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def account(user):
    """``(pwd entry, groups, drop)``: who runs the check, and whether this (root) process changes to it."""
    entry = pwd.getpwnam(user) if user else pwd.getpwuid(os.getuid())
    drop = os.getuid() == 0 and entry.pw_uid != 0
    groups = os.getgrouplist(entry.pw_name, entry.pw_gid) if drop else None
    return entry, groups, drop


def unreadable(entry, groups, drop, paths):
    """``[(path, why)]`` of the ``paths`` the account cannot read (a directory: list and enter), found in a child
    process that is that account."""
    if not paths:
        return []
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the account, then one open per path
        try:
            os.close(read_fd)
            if drop:
                os.setgroups(groups)
                os.setgid(entry.pw_gid)
                os.setuid(entry.pw_uid)
            bad = []
            for path in paths:
                try:
                    if os.path.isdir(path):
                        if not os.access(path, os.R_OK | os.X_OK):
                            raise PermissionError(13, "Permission denied")
                    else:
                        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
                except OSError as exc:
                    bad.append([path, exc.strerror or str(exc)])
            os.write(write_fd, json.dumps(bad).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks = []
    while True:
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_fd)
    os.waitpid(pid, 0)
    return [tuple(item) for item in json.loads(b"".join(chunks) or b"[]")]


def check_environment(entry, environment_file, environment):
    """The check's environment: a fixed PATH, the account's HOME and names, the job's file and values on top."""
    env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "HOME": entry.pw_dir, "USER": entry.pw_name, "LOGNAME": entry.pw_name,
           "SHELL": entry.pw_shell or "/bin/sh"}  # fmt: skip
    if environment_file:
        env.update(parse_environment_file(read_text(environment_file, "", follow=True)))
    env.update({str(k): str(v) for k, v in (environment or {}).items()})
    return env


def run_check(argv, entry, groups, drop, env, cwd, timeout):
    """``(rc, stdout, stderr)`` of ``argv`` run as the account; killed (its whole session) after ``timeout``."""
    kwargs = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": groups} if drop else {}
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=cwd or entry.pw_dir or "/", start_new_session=True, text=True, errors="replace",
                            close_fds=True, **kwargs)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\ndflash_check: the check did not end within {timeout}s and was killed"
    return proc.returncode, out, err


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True,
                           required_one_of=[("content", "path")], mutually_exclusive=[("content", "path")],
                           required_by={"content": ("dest",)})  # fmt: skip
    p = module.params
    result = {"changed": False, "checked": False, "failure_class": None}
    if p["content"] is not None and not p["force"]:
        current, _unsafe = read_text_checked(p["dest"], limit=16 << 20, follow=True)
        if current == p["content"]:
            module.exit_json(**result)  # the config there already passed when it was written; nothing new
    if module.check_mode:
        module.exit_json(**result)
    try:
        entry, groups, drop = account(p["user"])
    except KeyError:
        module.fail_json(msg=f"user {p['user']!r} does not exist on this host: create it (the venv role does) or change user")
    who = entry.pw_name
    bad = unreadable(entry, groups, drop, p["data_paths"])
    if bad:
        module.fail_json(msg="; ".join(f"data file {path} cannot be read by the job's user {who} ({why})" for path, why in bad)
                         + f": the trainer runs as {who} - make it readable by {who} (chmod, chown) or change "
                           "data.train_path / data.eval_path",
                         rc=EXIT_CODES["data_error"], failure_class="data_error", checked=False)  # fmt: skip
    tmp = None
    try:
        if p["content"] is not None:
            directory = os.path.dirname(p["dest"]) or "."
            fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(p["dest"]) + ".check-", suffix=".yaml", dir=directory)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                os.fchmod(handle.fileno(), 0o644)  # the config is no secret (0644 where it goes); the user reads it
                handle.write(p["content"])
            config = tmp
        else:
            config = p["path"]
        argv = [word.replace("%s", config) for word in p["command"]]
        env = check_environment(entry, p["environment_file"], p["environment"])
        try:
            rc, out, err = run_check(argv, entry, groups, drop, env, p["working_directory"], p["timeout"])
        except OSError as exc:
            module.fail_json(msg=f"cannot run the check {argv[0]} as {who}: {exc}", checked=False)
    finally:
        if tmp and os.path.lexists(tmp):
            os.unlink(tmp)
    result.update(checked=True, rc=rc, stdout=out, stderr=err)
    if rc != 0:
        cls = class_of_exit(rc) or "unknown"
        lines = [line for line in err.strip().splitlines() if line.strip()]
        said = next((line for line in reversed(lines) if line.startswith("dflash: error:")), lines[-1] if lines else "")
        module.fail_json(msg=f"the trainer's check (as {who}) refused the config (exit {rc}, {cls}): {said}",
                         **{**result, "failure_class": cls})  # fmt: skip
    module.exit_json(**result)


if __name__ == "__main__":
    main()
