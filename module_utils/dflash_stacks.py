# Copyright: dflash authors
# Apache-2.0
"""Hang evidence: the stack files of the trainer's ranks (written by dflash/runtime/stacks.py), read, and dumped on demand.

``RUN_DIR/stacks/rank-R.txt`` holds one line ``# dflash stacks: rank R pid P started ISO (UNIX)`` per start of
rank R, each followed by the dumps faulthandler appended while that process lived: every thread's Python stack,
on SIGUSR1 (``request_dump``; the launcher passes it on to its ranks) and on a fatal signal (systemd's watchdog
sends SIGABRT; that dump starts with ``Fatal Python error: Aborted``).

``read_stacks`` reports, per rank, the last dump of the rank's last start: its time (the file's mtime: a dump
is the last thing written), whether it was a fatal one, and the top frames of the main thread (the thread
that is not a ``threading`` thread; faulthandler marks the one that took the signal ``Current thread``).

Which rank is stuck (``stuck_ranks``, the documented rule): ranks are grouped by the top frame (file and
function) of their main thread. When some ranks share one frame and others do not, the others are stuck (the
many wait for the few: a rank in a data read or a deadlock while its peers sit in the collective). When the
groups are all of one rank, the ranks outside a collective wait (``WAIT_PATHS``: ``torch/distributed``, and the
backward that waits for DDP's gradient all-reduce) are stuck (a rank in a collective waits for a peer); when that
leaves none, or every rank is at the same frame, every rank is named.

Standard library only: Ansible ships it to the managed host.
"""

import os
import re
import signal
import stat
import time

from ansible.module_utils.dflash_host import tail_lines_checked

# the last part of a stack file read (a file grows by one dump per request): more than a few dumps of many threads
STACKS_TAIL_BYTES = 256 * 1024

STACKS_DIR = "stacks"
HEADER_PREFIX = "# dflash stacks:"
DUMP_SIGNAL = signal.SIGUSR1
TOP_FRAMES = 3
# Where a rank waits for its peers: a collective of torch.distributed, and DistributedDataParallel's gradient
# all-reduce, which the backward waits for inside the autograd engine (a drafter rank whose peer hangs before its
# backward sits in `_engine_run_backward`, torch/autograd/graph.py).
WAIT_PATHS = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/")
# The ranks whose stack files are read when the job's world size is not known, and at most ever.
MAX_RANKS = 64
MAX_RANKS_READ = 4096
THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.+)$')
FATAL = "Fatal Python error:"
THREAD_BOOTSTRAP = ("_bootstrap", "_bootstrap_inner")


def parse_dumps(text):
    """The dumps of the last start in a stack file's text: a list of {"fatal": str|None, "threads": [...]}, each
    thread {"id", "current", "frames": [(file, line, function), ...] most recent first}."""
    dumps, thread, prev = [], None, ""
    for line in text.splitlines():
        if line.startswith(HEADER_PREFIX):
            dumps, thread = [], None  # a new start: earlier dumps belong to an earlier process
        elif line.startswith(FATAL):
            dumps.append({"fatal": line[len(FATAL):].strip(), "threads": []})
            thread = None
        elif THREAD.match(line):
            match = THREAD.match(line)
            # threads of one dump are separated by a blank line; a thread header right after a frame (or as
            # the first thing after a start) begins the next dump
            if not dumps or (prev.strip() and not prev.startswith(FATAL)):
                dumps.append({"fatal": None, "threads": []})
            thread = {"id": match.group(2), "current": match.group(1) == "Current thread", "frames": []}
            dumps[-1]["threads"].append(thread)
        elif thread is not None and FRAME.match(line):
            file, lineno, func = FRAME.match(line).groups()
            thread["frames"].append((file, int(lineno), func))
        prev = line
    return dumps


def main_thread(dump):
    """The main thread of a dump: not a threading thread (bottom frame ``_bootstrap``), the current one first."""
    threads = dump["threads"]
    if not threads:
        return None
    main = [t for t in threads if not t["frames"] or t["frames"][-1][2] not in THREAD_BOOTSTRAP]
    for group in (main, threads):
        for t in sorted(group, key=lambda t: not t["current"]):
            return t
    return None


def short_path(path):
    """A frame's file: from the package on (``torch/distributed/distributed_c10d.py``), else its name."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    return os.path.basename(path)


def format_frame(frame):
    file, line, func = frame
    return f"{func} ({short_path(file)}:{line})"


def rank_files(run_dir, world_size=None):
    """``(rank, path)`` of the stack file of every rank of the job: ranks 0 to ``world_size`` - 1 (MAX_RANKS when it
    is not known). Named, never listed: the run directory is the trainer's, and a directory of a million files
    costs root nothing."""
    directory = os.path.join(run_dir, STACKS_DIR)
    count = int(world_size) if world_size and int(world_size) > 0 else MAX_RANKS
    return [(rank, os.path.join(directory, f"rank-{rank}.txt")) for rank in range(min(count, MAX_RANKS_READ))]


def read_stacks(run_dir, since=None, world_size=None):
    """Per rank (int -> dict), the last dump of its last start: ``dumped_at`` (unix time), ``fatal`` (the fatal
    error's name or None), ``frames`` (the main thread's top TOP_FRAMES frames, formatted), ``top`` ((file,
    function) of its top frame or None), ``path``. Ranks without a dump since their last start, or whose file was
    last written before ``since`` (unix time, e.g. the launch), are left out; so are ranks at or past
    ``world_size`` (``rank_files``)."""
    found = {}
    try:  # the trainer's `stacks` directory: never a link, whoever made it
        if not stat.S_ISDIR(os.lstat(os.path.join(run_dir, STACKS_DIR)).st_mode):
            return {}
    except OSError:
        return {}
    for rank, path in rank_files(run_dir, world_size):
        # the run directory is the trainer's: root follows no link there and reads regular files only, a tail
        # (dflash_host.read_lines), its text escaped
        try:
            st = os.lstat(path)
        except OSError:
            continue
        mtime = st.st_mtime
        if not stat.S_ISREG(st.st_mode) or (since is not None and mtime < since):
            continue
        lines, _ = tail_lines_checked(path, 0x7FFFFFFF, STACKS_TAIL_BYTES)
        if lines is None:
            continue
        dumps = parse_dumps("\n".join(lines) + "\n")
        if not dumps:
            continue
        thread = main_thread(dumps[-1])
        frames = thread["frames"] if thread else []
        found[rank] = {
            "rank": rank, "path": path, "dumped_at": mtime, "dumps": len(dumps),
            "fatal": dumps[-1]["fatal"], "frames": [format_frame(f) for f in frames[:TOP_FRAMES]],
            "top": (frames[0][0], frames[0][2]) if frames else None,
        }  # fmt: skip
    return found


def stuck_ranks(stacks):
    """The ranks named stuck by the rule of this module's docstring (sorted)."""
    if not stacks:
        return []
    groups = {}
    for rank, info in stacks.items():
        groups.setdefault(info["top"], []).append(rank)
    if len(groups) == 1:
        return sorted(stacks)
    largest = max(len(ranks) for ranks in groups.values())
    if largest > 1 and sum(1 for ranks in groups.values() if len(ranks) == largest) == 1:
        return sorted(r for ranks in groups.values() if len(ranks) < largest for r in ranks)
    outside = [r for r, info in stacks.items()
               if not (info["top"] and any(p in info["top"][0].replace(os.sep, "/") for p in WAIT_PATHS))]
    return sorted(outside) or sorted(stacks)


def describe(stacks, now=None):
    """One line per rank: ``stacks: rank R (stuck): top frames f1 <- f2 <- f3 (dumped Ns ago)``."""
    stuck = set(stuck_ranks(stacks))
    now = time.time() if now is None else now
    lines = []
    for rank, info in stacks.items():
        mark = " (stuck)" if rank in stuck else ""
        fatal = f", fatal: {info['fatal']}" if info.get("fatal") else ""
        frames = " <- ".join(info["frames"]) or "no Python frame"
        lines.append(f"stacks: rank {rank}{mark}: top frames {frames} "
                     f"(dumped {max(0.0, now - info['dumped_at']):.0f}s ago{fatal}; {info['path']})")
    return lines


def catches(pid, signum):
    """Whether process ``pid`` has a handler for ``signum`` (/proc/PID/status SigCgt): a trainer that registered
    its dump handler; anything else would die of SIGUSR1."""
    try:
        with open(f"/proc/{int(pid)}/status") as handle:
            for line in handle:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, TypeError):
        pass
    return False


def _sizes(run_dir, world_size=None):
    sizes = {}
    for _rank, path in rank_files(run_dir, world_size):
        try:
            sizes[os.path.basename(path)] = os.lstat(path).st_size
        except OSError:
            pass
    return sizes


def request_dump(pid, run_dir, wait=2.0, sleep=time.sleep, clock=time.monotonic, world_size=None):
    """Send DUMP_SIGNAL to the job's main process (the trainer, or the launcher that passes it on to its ranks)
    when it catches it, then wait up to ``wait`` seconds for the stack files to grow. Returns whether it was
    sent."""
    if not pid or int(pid) == os.getpid() or not catches(pid, DUMP_SIGNAL):
        return False
    before = _sizes(run_dir, world_size)
    try:
        os.kill(int(pid), DUMP_SIGNAL)
    except OSError:
        return False
    deadline = clock() + wait
    grown = set()
    while clock() < deadline:
        after = _sizes(run_dir, world_size)
        grown = {n for n, size in after.items() if size > before.get(n, 0)}
        # every file of a rank that was there grew (a rank's file that never grows is a rank already gone)
        if grown and grown >= set(before):
            sleep(0.1)  # a dump is written in one go; let the last one finish
            break
        sleep(0.05)
    return True


def hang_evidence(host, obs, params, wait=2.0):
    """A hung job (dflash_health): ask its main process for a dump (when it catches SIGUSR1), wait up to ``wait``
    seconds on the host's clock, and read the stacks written since this launch started."""
    run_dir = os.path.dirname(params["heartbeat_path"])
    unit = obs.get("unit") or {}
    world_size = params.get("world_size")
    if unit.get("main_pid_alive"):
        request_dump(unit.get("main_pid"), run_dir, float(params.get("stacks_wait", wait)), sleep=host.sleep,
                     clock=host.now, world_size=world_size)
    return read_stacks(run_dir, since=unit.get("started_at"), world_size=world_size)


def stacks_report(stacks):
    """``read_stacks``' answer as a module result: a list, one dict per rank, with ``stuck``."""
    stuck = set(stuck_ranks(stacks))
    return [{"rank": rank, "stuck": rank in stuck, "frames": info["frames"], "dumped_at": info["dumped_at"],
             "fatal": info["fatal"], "path": info["path"]} for rank, info in (stacks or {}).items()]
