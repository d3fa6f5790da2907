# Copyright: dflash authors
# Apache-2.0
"""What a launch is: the job's name and paths checked, its environment file, the identity hash that decides
a restart, the launch record that --diff shows, and the plan (start, restart, stop, remove, nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
import re

# Root's own: outside the trainer account's home (/var/lib/dflash), which that account could rewrite.
DEFAULT_STATE_ROOT = "/var/lib/dflash-units"


# Job names become unit names, file names and systemd words: nothing a shell or systemd would interpret.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


# Paths that go into unit properties: no spaces, quotes, '$', '%', ';', '`' or newlines.
PATH_PATTERN = re.compile(r"^/[A-Za-z0-9_./+:@-]*$")


ENV_KEY_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


ACTIONS = ("none", "started", "restarted", "stopped", "removed")


class UnitError(Exception):
    pass


def check_name(name):
    """A job name is letters, digits, '-' and '_' (at most 64, starting with a letter or digit)."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise UnitError(
            f"name {name!r} is not a valid job name: use 1-64 letters, digits, '-' or '_', starting with a letter or digit"
        )
    return name


def check_path(what, path):
    """An absolute path of plain characters (it is written into unit properties)."""
    if path is None:
        return None
    if not PATH_PATTERN.match(path) or "/../" in path + "/" or "\n" in path:
        raise UnitError(
            f"{what} {path!r} must be an absolute path of letters, digits and '_./+:@-' "
            "(no spaces, quotes, '$', '%' or '..'): choose another path"
        )
    return path


def check_spec(spec):
    """Names and paths that end up in unit properties and file names: strict, or one readable error."""
    check_name(spec["name"])
    for key in ("state_dir", "log_path", "environment_file", "working_directory"):
        check_path(key, spec.get(key))
    for word in spec.get("on_failure") or []:
        if "\n" in word or "\0" in word:
            raise UnitError("on_failure: an argument holds a newline or NUL; give the command as plain words")


def unit_name(name):
    return name if name.endswith(".service") else name + ".service"


def default_state_dir(name):
    return os.path.join(DEFAULT_STATE_ROOT, name)


def quote_env_value(value):
    """``value`` as a double-quoted EnvironmentFile= value that systemd and parse_environment_file read back
    unchanged. A newline cannot be written safely: refuse it."""
    value = str(value)
    if "\n" in value or "\r" in value or "\0" in value:
        raise UnitError("environment values must be one line (no newline or NUL)")
    return '"' + re.sub(r'([\\"$`])', r"\\\1", value) + '"'


def environment_file_text(environment):
    lines = []
    for key, value in sorted((environment or {}).items()):
        if not ENV_KEY_PATTERN.match(key):
            raise UnitError(f"environment variable name {key!r} is not valid: use letters, digits and '_'")
        try:
            lines.append(f"{key}={quote_env_value(value)}")
        except UnitError:
            raise UnitError(f"environment variable {key}: the value must be one line (no newline or NUL)") from None
    return "".join(line + "\n" for line in lines)


def parse_environment_file(text):
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them (comments, quotes)."""
    env = {}
    for raw in (text or "").splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        key, sep, value = line.partition("=")
        if not sep:
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = re.sub(r'\\([\\"$`])', r"\1", value[1:-1])  # the escapes systemd reads in double quotes
        elif len(value) >= 2 and value[0] == value[-1] == "'":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def unit_environment(spec):
    """What the job gets on top of its environment file (the module's `environment` and the watchdog's)."""
    env = {k: str(v) for k, v in (spec.get("environment") or {}).items()}
    watchdog = spec.get("watchdog") or {}
    if watchdog.get("interval"):
        env["DFLASH_WATCHDOG_SEC"] = str(int(watchdog["interval"]))
        env["DFLASH_WATCHDOG_START_SEC"] = str(max(int(watchdog.get("start_interval") or 0), int(watchdog["interval"])))
    return env


def config_hash(command, environment=None, environment_file_text=None, config_text=None, working_directory=None, user=None,
                supervision=None):
    """Identity of a launch: what the process would see and how it is supervised. Same hash + running = leave it alone."""
    document = {
        "command": list(command or []),
        "environment": dict(sorted((environment or {}).items())),
        "environment_file": environment_file_text,
        "config": config_text,
        "working_directory": working_directory,
        "user": user,
    }
    if supervision:  # absent = the hash of earlier releases, so an upgrade alone restarts nothing
        document["supervision"] = supervision
    blob = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def plan_action(state, running, present, current_hash, previous_hash):
    """What to do for ``state`` given the observed unit. Returns one of ACTIONS.

    started:   running with the same hash -> none; running with another hash -> restarted;
               not running -> started (through the same stop/release/clear sequence).
    restarted: always the sequence (restarted if it was running, else started).
    stopped:   running -> stopped, else none.
    absent:    anything left (running unit, failed unit, state) -> removed, else none.
    """
    if state == "started":
        if running:
            return "none" if current_hash == previous_hash else "restarted"
        return "started"
    if state == "restarted":
        return "restarted" if running else "started"
    if state == "stopped":
        return "stopped" if running else "none"
    if state == "absent":
        return "removed" if (running or present) else "none"
    raise UnitError(f"unknown state {state!r}: use started, restarted, stopped or absent")


def launch_record(command, environment=None, environment_file=None, environment_file_text=None, config_path=None,
                  config_text=None, working_directory=None, user=None, supervision=None):
    """What --diff shows of a launch: the command, user, workdir and config, the environment's *keys* only.

    Values of the environment (and of the environment file) may be secrets: they enter only as one digest, which
    tells a changed value apart without showing it; the record lives in the root-only state directory."""
    secret = json.dumps([sorted((environment or {}).items()), environment_file_text], separators=(",", ":"))
    return {
        "command": list(command or []),
        "user": user,
        "working_directory": working_directory,
        "environment_keys": sorted(environment or {}),
        "environment_file": environment_file,
        "environment_file_keys": sorted(parse_environment_file(environment_file_text)),
        "environment_values": hashlib.sha256(secret.encode()).hexdigest(),
        "config_path": config_path,
        "config": config_text,
        "supervision": dict(sorted((supervision or {}).items())),
    }


def describe_launch(record, other=None):
    """``record`` as diff text: one line per field, the config's own lines; ``other`` (the launch it is compared
    with) marks a change of the environment's values, which are never shown."""
    if not record:
        return "launch: none recorded\n"
    lines = [
        "command: " + " ".join(record.get("command") or []),
        f"user: {record.get('user') or '-'}",
        f"working_directory: {record.get('working_directory') or '-'}",
        "environment keys: " + (", ".join(record.get("environment_keys") or []) or "-"),
        f"environment_file: {record.get('environment_file') or '-'}",
        "environment_file keys: " + (", ".join(record.get("environment_file_keys") or []) or "-"),
    ]
    values_changed = other is not None and other.get("environment_values") != record.get("environment_values")
    lines.append("environment values: " + ("changed (not shown)" if values_changed else "not shown"))
    for key, value in sorted((record.get("supervision") or {}).items()):
        lines.append(f"{key}: {value}")
    lines.append(f"config_path: {record.get('config_path') or '-'}")
    lines += ["config: |"] + ["  " + line for line in (record.get("config") or "").splitlines()]
    return "".join(line + "\n" for line in lines)
