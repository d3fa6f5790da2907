# Copyright: dflash authors
# Apache-2.0
"""What root reads of the files the trainer account writes: the one way every root reader takes.

The trainer owns its run directory (heartbeat.json, nodes/node-R.json, checkpoints/latest, stacks/rank-R.txt) and
can put anything at those paths; root's log of the job is appended by the unit but lies in a directory the trainer
may reach too. Every root reader of them (the health module, the wait plugin's progress module, the logs module, the
unit module's crash report, the stacks reader) reads them through here and dflash_host:

* the file: ``dflash_host.open_nofollow`` - no link another account made is followed, ``O_NONBLOCK`` (a FIFO never
  blocks), regular files only, one hard link only, at most a size cap read (a 1 TiB sparse file or ``/dev/zero``
  streams nothing);
* JSON: parsed, then its fields checked against a schema (``HEARTBEAT_FIELDS``, ``NODE_FIELDS``): a wrong type, a
  nesting deeper than the parser allows, anything but an object is "invalid heartbeat", a state, never an exception;
  fields the schema does not name are dropped;
* text: every string shown (a field, a log line, a stack frame) has its control characters escaped
  (``dflash_host.printable``) and is cut at a length.

Standard library only: Ansible ships it to the managed host.
"""

from __future__ import annotations

import json
import math
import os
import re

from ansible.module_utils.dflash_host import READ_LIMIT, _read_fd, open_nofollow, printable, read_text_checked

# A state of the heartbeat (a diagnosis says it): a file that is there but not a heartbeat the trainer writes.
INVALID = "invalid heartbeat"
# The longest string of the trainer's kept (a heartbeat's `error` is one line of an exception).
MAX_TEXT = 1000
# JSON of the trainer's, at most this much (a heartbeat is a few hundred bytes).
JSON_LIMIT = 64 * 1024
# Nesting of the JSON, at most (the node file's `nodes` and `missing` are one level down).
MAX_DEPTH = 8

INT, NUMBER, TEXT, BOOL, INT_LIST, TEXT_MAP = "int", "number", "text", "bool", "int list", "text map"

# The heartbeat (dflash/runtime/observability.py): field -> kind; `step` is required, the others may be missing or null.
HEARTBEAT_FIELDS = {
    "step": INT, "epoch": INT, "time": NUMBER, "pid": INT, "status": TEXT, "loss": NUMBER, "tau": NUMBER,
    "tokens_per_s": NUMBER, "error": TEXT, "failure_class": TEXT, "eval_step": INT, "eval_tau": NUMBER,
    "eval_acceptance_length": NUMBER,
}  # fmt: skip
# A node file of a multi-node job (dflash/runtime/multinode.py).
NODE_FIELDS = {
    "step": INT, "time": NUMBER, "pid": INT, "status": TEXT, "error": TEXT, "node_rank": INT, "nnodes": INT,
    "node": TEXT, "run_id": TEXT, "joined": BOOL, "all_joined": BOOL, "world_size": INT, "missing": INT_LIST,
    "lost_node": INT, "lost_node_name": TEXT, "nodes": TEXT_MAP, "joined_at": NUMBER, "all_joined_at": NUMBER,
}  # fmt: skip


class Invalid(ValueError):
    """A file that is not what the trainer writes; the message completes ``FILE is ...``."""


def text(value, limit=MAX_TEXT):
    """A string of the trainer's as it may be shown: control characters escaped, at most ``limit`` characters."""
    value = printable(str(value))
    return value if len(value) <= limit else value[:limit] + "..."


def _depth(data, limit):
    """Whether ``data`` (JSON text) nests deeper than ``limit``: a scan of its brackets outside strings, so that
    a 200,000-deep list is refused before the parser recurses into it."""
    depth, in_string, escaped = 0, False, False
    for char in data:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def _check(name, value, kind):
    """``value`` of field ``name`` as the schema's ``kind`` wants it (None stays None), or ``Invalid``."""
    if value is None:
        return None
    if kind == INT and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == NUMBER and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return value
    if kind == TEXT and isinstance(value, str):
        return text(value)
    if kind == BOOL and isinstance(value, bool):
        return value
    if kind == INT_LIST and isinstance(value, list) and len(value) <= 4096 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    if kind == TEXT_MAP and isinstance(value, dict) and len(value) <= 4096 and all(
            isinstance(v, str) for v in value.values()):
        return {text(k, 64): text(v, 256) for k, v in value.items()}
    raise Invalid(f"'{text(name, 64)}' is {_kind(value)}, not {'an' if kind == INT else 'a'} {kind}")


def _kind(value):
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value}"
    return {int: "an int", float: "a number", str: "a string", list: "a list", dict: "an object"}.get(type(value), "null")


def validate(data, fields, required=("step",)):
    """The fields of ``data`` (parsed JSON) the schema ``fields`` names, each of its kind; ``Invalid`` otherwise."""
    if not isinstance(data, dict):
        raise Invalid(f"{_kind(data)}, not an object")
    for name in required:
        if data.get(name) is None:
            raise Invalid(f"without '{name}'")
    return {name: _check(name, data[name], kind) for name, kind in fields.items() if name in data}


def parse_json(data, fields, required=("step",)):
    """``data`` (text) parsed and validated (``validate``); ``Invalid`` says what is wrong with it."""
    if _depth(data, MAX_DEPTH):
        raise Invalid(f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        parsed = json.loads(data)
    except RecursionError:  # pragma: no cover - _depth refuses it first
        raise Invalid("JSON nested too deep") from None
    except ValueError as exc:
        raise Invalid(f"not JSON ({text(exc, 200)})") from None
    return validate(parsed, fields, required)


def read_json(path, fields, required=("step",), what="heartbeat file"):
    """``(dict, None)``: the file's fields of the schema; ``(None, reason)`` when it is missing, not read
    (``dflash_host.read_text_checked``: a link, FIFO, device, hard link, too large) or invalid. ``reason`` is one
    line that starts ``WHAT PATH``; an invalid one has ``INVALID`` in it."""
    data, unsafe = read_text_checked(path, limit=min(JSON_LIMIT, READ_LIMIT))
    if unsafe and unsafe.startswith("is larger than"):  # a plain file, but no heartbeat is that large
        return None, f"{what} {path}: {INVALID}: it {unsafe}"
    if unsafe:
        return None, f"{what} {path} {unsafe}: not read (the trainer writes it as a plain file)"
    if data is None:
        return None, f"{what} {path} does not exist"
    try:
        return parse_json(data, fields, required), None
    except Invalid as exc:
        return None, f"{what} {path}: {INVALID}: it is {exc}"


def read_heartbeat(path):
    """The trainer's heartbeat (``HEARTBEAT_FIELDS``), or ``(None, reason)``."""
    return read_json(path, HEARTBEAT_FIELDS)


def read_node_file(path):
    """A node file of a multi-node job (``NODE_FIELDS``), or ``(None, reason)``."""
    return read_json(path, NODE_FIELDS, what="node file")


def read_word(path, limit=4096):
    """The first line of a small file of the trainer's (``checkpoints/latest``), stripped and escaped, or None."""
    data, _unsafe = read_text_checked(path, limit=limit)
    if not data:
        return None
    return text(data.strip().split("\n", 1)[0], 255) or None


def newest_line(path, pattern=r"\S", tail_bytes=65536):
    """``(size, line)`` of a log: its size and the newest line of its last ``tail_bytes`` that matches ``pattern``
    (a regular expression; a carriage return ends a line too: each state of a progress bar is one), escaped, or
    None. ``(None, None)`` when it is missing; a link, FIFO, device or hard link raises ``dflash_host.UnsafeFile``
    (``open_nofollow``)."""
    try:
        fd = open_nofollow(path)
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - tail_bytes), os.SEEK_SET)
        data = _read_fd(fd, min(tail_bytes, size), strict=False)
    finally:
        os.close(fd)
    match = re.compile(pattern).search
    for line in reversed(data.decode("utf-8", errors="replace").replace("\r", "\n").split("\n")):
        if match(line):
            return size, text(line.strip(), 400)
    return size, None


def modified_at(path):
    """The modification time of a file of the trainer's (``checkpoints/latest``: when the last checkpoint was
    published), read from the fd ``dflash_host.open_nofollow`` opens (no link followed, regular files with one link
    only), or None when it is missing or not such a file."""
    try:
        fd = open_nofollow(path)
    except (OSError, ValueError):
        return None
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
