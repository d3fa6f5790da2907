"""A hostile run directory: what an attacker holding the trainer account can put at every path it writes and root
reads (docs/operations.md, "Security", lists them). Used by test_ansible_hostile_run_dir.py; run as a script, it
is the module runner of that test (every root module, in one process, under the test's memory and time limits).

Kinds, each planted at every path: a FIFO, the trainer's link to /dev/zero, its link to a root-only file, a 1 TiB
sparse file, a hard link to the root-only file, JSON of the wrong types, JSON nested 200,000 deep (and 20,000 deep:
under the size cap, so the parser's guard is what refuses it), and ESC sequences with a forged line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

TRAINER_UID = 4242
SECRET = "R00T-ONLY-8d1f"
SECRET_STEP = 424242
FORGED = "health: OK, all invariants hold"
ESC = "\x1b[2J\x1b[H"
KINDS = ("fifo", "dev-zero", "root-only", "sparse", "hard-link", "wrong-types", "deep", "deep-small", "escapes")
# Every path the trainer can write that root reads (relative to the run directory), and how root reads it.
JSON_PATHS = ("heartbeat.json", "nodes/node-0.json")
TEXT_PATHS = ("checkpoints/latest", "stacks/rank-0.txt", ".shared-storage-probe")
# The job's log: root's unit appends the trainer's output to it (its directory is root's); its text is the trainer's.
LOG = "log/job.log"


def secret_file(base: Path) -> Path:
    """A root-only file shaped like everything root reads (a heartbeat, a log line, a checkpoint name)."""
    directory = base / "root-only"
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / "secret.json"
    if not path.exists():
        path.write_text(json.dumps({"step": SECRET_STEP, "time": time.time(), "pid": 1, "status": SECRET,
                                    "error": SECRET}) + "\n" + f"step {SECRET_STEP} {SECRET}\n")  # fmt: skip
        os.chmod(path, 0o600)
    return path


def _content(kind: str, rel: str, pid: int) -> str:
    now = time.time()
    if kind == "wrong-types":
        if rel.endswith(".json"):
            return json.dumps({"step": 7, "time": "x", "pid": [1], "status": 7, "loss": {"a": 1}, "missing": "all"})
        return json.dumps([1]) + "\n"
    if kind in ("deep", "deep-small"):
        depth = 200_000 if kind == "deep" else 20_000
        return "[" * depth + "]" * depth
    assert kind == "escapes"
    if rel == "heartbeat.json":
        return json.dumps({"step": 3, "epoch": 0, "time": now, "pid": pid, "status": "failed",
                           "error": f"boom{ESC}\n{FORGED}\r", "failure_class": f"data_error{ESC}"})  # fmt: skip
    if rel.startswith("nodes/"):
        return json.dumps({"step": 3, "time": now, "pid": pid, "status": "failed", "node_rank": 0, "nnodes": 2,
                           "node": f"n0{ESC}", "joined": True, "all_joined": False, "missing": [1],
                           "error": f"lost{ESC}\n{FORGED}", "nodes": {"0": f"n0{ESC}", "1": "n1\x07"}})  # fmt: skip
    if rel == "checkpoints/latest":
        return f"checkpoint-{ESC}7\n{FORGED}\n"
    if rel == ".shared-storage-probe":
        return f"token{ESC}\n"
    if rel.startswith("stacks/"):
        return (f"# dflash stacks: rank 0 pid {pid} started x ({int(now)})\nThread 0x00007f00 (most recent call first):\n"
                f'  File "/x/evil{ESC}.py", line 3 in stuck\x1b]0;pwned\x07\n  File "/x/main.py", line 9 in <module>\n')
    return f"step 1 epoch 0 loss 3.2100\n{ESC}\n{FORGED}\r\x1b]0;title\x07done\x1b[31m\n"  # the log


# Several kinds in one run directory, a kind per path: the Ansible runs (the wait plugin, `dflash ops`) take these,
# one container each; together they put every kind at the heartbeat or the log (the module runner takes every kind
# at every path).
LAYOUTS = {
    "mixed-1": {"heartbeat.json": "fifo", "nodes/node-0.json": "dev-zero", "checkpoints/latest": "sparse",
                "stacks/rank-0.txt": "hard-link", LOG: "escapes"},
    "mixed-2": {"heartbeat.json": "escapes", "nodes/node-0.json": "escapes", "checkpoints/latest": "root-only",
                "stacks/rank-0.txt": "escapes", LOG: "fifo"},
    "mixed-3": {"heartbeat.json": "deep", "nodes/node-0.json": "wrong-types", "checkpoints/latest": "fifo",
                "stacks/rank-0.txt": "root-only", LOG: "sparse"},
    "mixed-4": {"heartbeat.json": "dev-zero", "nodes/node-0.json": "deep-small", "checkpoints/latest": "hard-link",
                "stacks/rank-0.txt": "sparse", LOG: "root-only"},
    "mixed-5": {"heartbeat.json": "hard-link", "nodes/node-0.json": "root-only", "checkpoints/latest": "dev-zero",
                "stacks/rank-0.txt": "fifo", LOG: "hard-link"},
}  # fmt: skip


def plant(base: Path, name: str, kinds: dict[str, str] | None = None, pid: int | None = None) -> dict[str, str]:
    """A run directory (the trainer's, uid TRAINER_UID) with the kind ``name`` at every path of JSON_PATHS, TEXT_PATHS
    and LOG, or ``kinds`` (path -> kind). Returns {run, log, heartbeat, node}."""
    secret = secret_file(base)
    pid = os.getpid() if pid is None else pid
    root = base / name
    run = root / "run"
    for rel in (*JSON_PATHS, *TEXT_PATHS, LOG):
        kind = kinds.get(rel, "escapes") if kinds else name
        where = (root if rel == LOG else run) / rel
        where.parent.mkdir(parents=True, exist_ok=True)
        if kind == "fifo":
            os.mkfifo(where)
        elif kind == "dev-zero":
            os.symlink("/dev/zero", where)
        elif kind == "root-only":
            os.symlink(secret, where)
        elif kind == "sparse":
            with open(where, "wb") as handle:
                handle.truncate(1 << 40)
        elif kind == "hard-link":
            os.link(secret, where)
        else:
            where.write_text(_content(kind, rel, pid))
        os.lchown(where, TRAINER_UID, TRAINER_UID)
    for directory in [run, *{(run / rel).parent for rel in (*JSON_PATHS, *TEXT_PATHS)}]:
        os.chown(directory, TRAINER_UID, TRAINER_UID)
    return {"run": str(run), "log": str(root / LOG), "heartbeat": str(run / "heartbeat.json"),
            "node": str(run / "nodes" / "node-0.json")}  # fmt: skip


def raw_controls(text: str) -> list[str]:
    """The control characters in ``text`` other than a newline and a tab (what must never reach a terminal)."""
    return sorted({repr(c) for c in text if (ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) < 0xA0})


# --- the module runner: every root module on every kind, in this one process -------------------------------------

def _module(path: Path, args: dict) -> dict:
    """Run the module at ``path`` as Ansible would (its result: the JSON it prints)."""
    import contextlib
    import io
    import runpy

    from ansible.module_utils import basic

    basic._ANSIBLE_ARGS = json.dumps({"ANSIBLE_MODULE_ARGS": {**args, "_ansible_tmpdir": "/tmp"}}).encode()
    basic._ANSIBLE_PROFILE = "legacy"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit:
            pass
    return json.loads(out.getvalue())


def run_modules(root: Path, planted: dict, unit_pid: int, limit_s: int) -> dict:
    """{kind: {entry point: {"elapsed", "result" | "error"}}} for every root reader on every planted kind."""
    import signal

    import ansible.module_utils

    ansible.module_utils.__path__.append(str(root / "module_utils"))
    from ansible.module_utils.dflash_health import check_health
    from ansible.module_utils.dflash_host import LocalHost
    from ansible.module_utils.dflash_unit import crash_loop_message

    def timed_out(*_):
        raise TimeoutError(f"no answer within {limit_s}s")

    signal.signal(signal.SIGALRM, timed_out)
    library = root / "library"
    active = {"load_state": "loaded", "active_state": "active", "sub_state": "running", "main_pid": unit_pid,
              "exit_status": None, "result": None, "backend": "daemon", "started_at": time.time() - 3600}  # fmt: skip
    out = {}
    for kind, paths in planted.items():
        health = {"name": "hostile", "backend": "daemon", "state_dir": paths["run"] + "-state", "log_path": paths["log"],
                  "heartbeat_path": paths["heartbeat"], "node_heartbeat_path": paths["node"], "timeout": 0,
                  "dump_stacks": True, "log_lines": 10, "fail_on_unhealthy": False}  # fmt: skip
        running = {**health, "gpu_ids": [], "gpu_min_memory_mib": 1, "progress_window": 60}
        calls = {
            "dflash_health": (_module, library / "dflash_health.py", health),
            "dflash_health (running)": (check_health, LocalHost(), running, lambda: dict(active)),
            "dflash_logs": (_module, library / "dflash_logs.py", {"path": paths["log"], "lines": 10}),
            "dflash_logs (follow)": (_module, library / "dflash_logs.py", {"path": paths["log"], "offset": 0}),
            "dflash_progress": (_module, library / "dflash_progress.py", {"log": paths["log"], "heartbeat": paths["heartbeat"]}),
            "dflash_unit (crash report)": (crash_loop_message, {"name": "hostile", "log_path": paths["log"]}, {"restarts": 3}),
            "dflash_directory (probe)": (_module, library / "dflash_directory.py",
                                         {"path": paths["run"], "read_probe": True, "_ansible_check_mode": True}),
        }  # fmt: skip
        out[kind] = {}
        for name, (call, *call_args) in calls.items():
            start = time.monotonic()
            signal.alarm(limit_s)
            try:
                entry = {"result": call(*call_args)}
            except BaseException as exc:  # noqa: BLE001 - a crash, a hang or memory: what the test reports
                entry = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            finally:
                signal.alarm(0)
            entry["elapsed"] = time.monotonic() - start
            out[kind][name] = entry
    return out


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    results = run_modules(Path(args["root"]), args["planted"], args["unit_pid"], args["limit_s"])
    json.dump(results, sys.stdout, default=str)
