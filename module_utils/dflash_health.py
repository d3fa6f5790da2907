# Copyright: dflash authors
# Apache-2.0
"""Is the training job really training? The invariants of DESIGN.md §1, the job's state and a diagnosis.

Invariants (names as returned in ``failed_invariants``):

* ``log``      - the log file exists and grows (grew during the check, or was written within
                 ``progress_window``).
* ``unit``     - the unit is active and its MainPID is alive.
* ``gpu``      - every listed GPU holds at least ``gpu_min_memory_mib`` in processes of the unit
                 (MainPID and its descendants); another job's memory does not count.
* ``progress`` - a heartbeat of *this launch* (written by a process of the unit, after the unit
                 started) advances: its step grows during the check, after a first step. A one-snapshot
                 check (``timeout: 0``, status) accepts a heartbeat of this launch in status
                 ``training`` written within ``progress_window``.
* ``joined``   - multi-node jobs only (``node_heartbeat_path`` set): the node file of this launch
                 (``OUTPUT_DIR/nodes/node-R.json``, written by the node's launcher) says that every rank of
                 the job joined (this node's ranks all finished a step). The diagnosis names the node
                 that did not join, or the node that was lost. On nodes other than 0 the node file is
                 the heartbeat (the trainer's heartbeat is node 0's reporter's), and the log need only
                 exist (the reporter writes the step lines).

A heartbeat of an earlier launch (its pid is not the unit's, or it was written before the unit
started) is never evidence: the job reads as ``starting`` until this launch writes its own.

The job's state: ``training``, ``finished``, ``starting`` (within the progress window of a launch),
``hung`` (running without progress for a window), ``crashed`` (exited non-zero after training
steps of this launch), ``failed-to-start`` (exited non-zero before its first step), ``stopped``
(exited 0 or by SIGTERM without finishing: a stop on purpose, or never started), ``lost`` (meant to
run, but the container or node restarted under it and this boot did not launch it again: the boot
relaunch failed or did not run; whatever its last exit was). A stop that needed SIGKILL after the
stop timeout (137) reads as ``crashed``.
"""

from __future__ import annotations

import dataclasses
import os
import time
import typing

from ansible.module_utils.dflash_gpu import GpuQueryError, format_gpu_table, gpu_faults, query_gpus
from ansible.module_utils.dflash_host import tail_lines_checked
from ansible.module_utils.dflash_stacks import describe as describe_stacks
from ansible.module_utils.dflash_stacks import hang_evidence, stacks_report
from ansible.module_utils.dflash_unit_procs import pid_alive, proc_stat_fields
from ansible.module_utils.dflash_unit_records import is_running
from ansible.module_utils.dflash_untrusted import read_heartbeat as read_heartbeat_file
from ansible.module_utils.dflash_untrusted import read_node_file, read_word

# An Ansible `path` option: a str whose ~ and variables the module expands.
Path = typing.NewType("Path", str)


@dataclasses.dataclass(frozen=True)
class HealthRequest:
    """What one health check is asked: the options of the module dflash_health, each with its type and its only default.

    The module's argument_spec is ``HealthRequest.argument_spec()`` (a field without a default is required, ``Path``
    is Ansible's ``path``, ``list[int]`` a list of int elements, ``X | None`` an option without a default); its
    DOCUMENTATION lists the same options (tests/ansible/test_ansible_health_request.py). ``check_health`` and
    ``HealthTracker`` take the fields as a dict and fill the ones they are not given from here
    (``HealthRequest.with_defaults``). A new option: a field here, its entry in DOCUMENTATION, its use below.
    """

    name: str
    log_path: Path
    heartbeat_path: Path
    backend: str = dataclasses.field(default="auto", metadata={"choices": ("auto", "systemd", "daemon")})
    state_dir: Path | None = None
    gpu_ids: list[int] = dataclasses.field(default_factory=list)
    gpu_min_memory_mib: int = 1024
    timeout: int = 300
    progress_window: int = 120
    start_window: int = 0
    first_failure: bool = False
    poll_interval: int = 5
    log_lines: int = 40
    fail_on_unhealthy: bool = True
    node_heartbeat_path: Path | None = None
    node_rank: int = 0
    nodes: list[str] = dataclasses.field(default_factory=list)
    dump_stacks: bool = False
    world_size: int = 0
    watchdog: int = 0

    @classmethod
    def defaults(cls):
        """Every field that has a default, with it (a fresh list for a list)."""
        out = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
        return out

    @classmethod
    def with_defaults(cls, params):
        """``params`` with the defaults of the fields it does not give (other keys kept)."""
        return {**cls.defaults(), **params}

    @classmethod
    def argument_spec(cls):
        """The AnsibleModule argument_spec of these fields."""
        hints = typing.get_type_hints(cls)
        defaults = cls.defaults()
        spec = {}
        for f in dataclasses.fields(cls):
            option = _ansible_type(hints[f.name])
            if f.name not in defaults:
                option["required"] = True
            elif defaults[f.name] is not None:
                option["default"] = defaults[f.name]
            if "choices" in f.metadata:
                option["choices"] = list(f.metadata["choices"])
            spec[f.name] = option
        return spec


_ANSIBLE_TYPES = {str: "str", int: "int", bool: "bool", float: "float", dict: "dict", Path: "path"}


def _ansible_type(hint):
    """{"type": ...} (and "elements" for a list) of a field's type hint; ``X | None`` is X."""
    args = typing.get_args(hint)
    if type(None) in args:
        (hint,) = [a for a in args if a is not type(None)]
    if typing.get_origin(hint) is list:
        (element,) = typing.get_args(hint)
        return {"type": "list", "elements": _ANSIBLE_TYPES[element]}
    if hint not in _ANSIBLE_TYPES:
        raise TypeError(f"no Ansible option type for {hint!r}")
    return {"type": _ANSIBLE_TYPES[hint]}


INVARIANTS = ("log", "unit", "gpu", "progress", "joined")
TRAINING, FINISHED, STARTING, HUNG, CRASHED, FAILED_TO_START, STOPPED, LOST, DRIVER_MISMATCH = (
    "training", "finished", "starting", "hung", "crashed", "failed-to-start", "stopped", "lost", "driver-mismatch")
STATES = (TRAINING, FINISHED, STARTING, HUNG, CRASHED, FAILED_TO_START, STOPPED, LOST, DRIVER_MISMATCH)
# States a script may treat as fine (exit 0 of status): healthy, or not running on purpose.
OK_STATES = (TRAINING, FINISHED, STARTING, STOPPED)
RESTART_HINT = "restart it with -e dflash_job_state=restarted (ansible-playbook playbooks/train.yml or deploy.yml)"
DRIVER_MISMATCH_HINT = ("the container's NVIDIA userspace no longer matches the node's driver (a driver upgrade "
                        "on the node): run ansible-playbook playbooks/provision.yml (the container role installs the "
                        "node driver's userspace), then playbooks/train.yml; the unit is not restarted until then")
LOST_HINT = ("relaunch it with ansible-playbook playbooks/train.yml (or deploy.yml); why the boot relaunch failed: "
             "journalctl -u dflash-boot-{name}.service in the container")
# A heartbeat's time may precede the unit's start by clock granularity only.
LAUNCH_SLACK_S = 2.0


def read_heartbeat(path):
    """The heartbeat dict, or ``(None, reason)`` when missing, unreadable or invalid.

    The trainer account writes it: read as dflash_untrusted reads every file of the trainer's (no link followed,
    never waited on, regular files with one link only, a size cap, its fields' types checked, its text escaped).
    A file of the wrong shape is an ``invalid heartbeat``, said in the reason, never an exception."""
    return read_heartbeat_file(path)


def process_started_at(pid):
    """Wall-clock start time of a live process (from /proc, against the boot clock), or None."""
    fields = proc_stat_fields(pid) if pid else None
    if not fields:
        return None
    try:
        ticks = int(fields[19])
        booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    except (IndexError, ValueError, AttributeError, OSError):
        return None
    return booted + ticks / os.sysconf("SC_CLK_TCK")


def process_tree(main_pid):
    """MainPID and all its live descendants (torchrun's ranks included)."""
    if not main_pid or not pid_alive(main_pid):
        return set()
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = proc_stat_fields(name)
        if fields and len(fields) > 1 and fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(int(name))
    tree, todo = set(), [int(main_pid)]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


def read_checkpoint(run_dir):
    """Name and step of ``RUN_DIR/checkpoints/latest``, or (None, None)."""
    name = read_word(os.path.join(run_dir, "checkpoints", "latest"))
    if not name:
        return None, None
    base = os.path.basename(name.rstrip("/"))
    digits = base.rsplit("-", 1)[-1]
    return base, int(digits) if digits.isdigit() else None


def observe(host, params, backend_status, wall=None):
    """One snapshot of everything the invariants look at.

    ``backend_status`` may carry ``started_at`` (wall-clock start of the unit's current or last
    launch); otherwise the MainPID's start time is used.
    """
    wall = time.time() if wall is None else wall
    obs = {"wall": wall, "log_exists": False, "log_size": 0, "log_mtime": None}
    try:
        st = os.lstat(params["log_path"])  # never through a link (the log is read by dflash_host.read_lines)
        obs.update(log_exists=True, log_size=st.st_size, log_mtime=st.st_mtime)
    except OSError:
        pass
    unit = dict(backend_status)
    unit["main_pid_alive"] = pid_alive(unit.get("main_pid"))
    if unit.get("started_at") is None and unit["main_pid_alive"]:
        unit["started_at"] = process_started_at(unit["main_pid"])
    obs["unit"] = unit
    obs["unit_pids"] = sorted(process_tree(unit.get("main_pid"))) if unit["main_pid_alive"] else []
    obs["heartbeat"], obs["heartbeat_error"] = read_heartbeat(params["heartbeat_path"])
    obs["node"], obs["node_error"] = None, None
    if params.get("node_heartbeat_path"):
        node, obs["node_error"] = read_node_file(params["node_heartbeat_path"])
        if node is not None:
            current, why = heartbeat_is_current({**obs, "heartbeat": node})
            obs["node"], obs["node_error"] = (node, None) if current else (None, "the node file is not this launch's: " + why)
        if params.get("node_rank"):  # the trainer's heartbeat is node 0's reporter's: this node's is the node file
            obs["heartbeat"], obs["heartbeat_error"] = node, obs["node_error"]
    obs["heartbeat_current"], obs["heartbeat_stale_reason"] = heartbeat_is_current(obs)
    obs["checkpoint"], obs["checkpoint_step"] = read_checkpoint(os.path.dirname(params["heartbeat_path"]))
    obs["gpus"], obs["gpu_processes"], obs["gpu_error"], obs["gpu_error_kind"] = [], [], None, None
    if params.get("gpu_ids"):
        obs["gpu_faults"], obs["gpu_lost"] = {}, []
        try:
            obs["gpus"], obs["gpu_processes"] = query_gpus(host)
            obs["gpu_faults"], obs["gpu_lost"] = gpu_faults(host, obs["gpus"])
        except GpuQueryError as exc:
            obs["gpu_error"], obs["gpu_error_kind"] = str(exc), exc.kind
        # the listed pids that exist in this (the container's) PID namespace: a driver that reports host pids
        # lists pids that are not here, or are other processes here
        listed = {p.get("pid") for p in obs["gpu_processes"] if p.get("pid")}
        obs["gpu_pids_here"] = sorted(p for p in listed if pid_alive(p))
    return obs


def heartbeat_is_current(obs):
    """``(True, None)`` when the heartbeat was written by this launch, else ``(False, why not)``."""
    hb, unit = obs.get("heartbeat"), obs["unit"]
    if hb is None:
        return False, None
    started = unit.get("started_at")
    written = float(hb.get("time") or 0)
    if started is not None and written < started - LAUNCH_SLACK_S:
        return False, (f"it was written {started - written:.0f}s before this launch started "
                       f"(step {hb['step']}, status {hb.get('status')}, pid {hb.get('pid')})")
    pids = obs.get("unit_pids") or []
    if pids and hb.get("pid") not in pids:
        return False, (f"its pid {hb.get('pid')} is not a process of the unit (MainPID {unit.get('main_pid')}; "
                       f"step {hb['step']}, status {hb.get('status')})")
    if started is None and not pids and is_running(unit):
        return False, "the unit's MainPID is not alive, so the heartbeat cannot be attributed to it"
    return True, None


def unit_gpu_memory(obs, gpu_ids):
    """``{index: (MiB held by the unit's processes or None, note)}`` for the listed GPUs.

    When nvidia-smi lists no process at all while memory is in use (a PID namespace that hides
    them, as in many containers), the GPU's total use is taken and the note says so; likewise when
    none of the listed pids exists in this PID namespace (a driver that reports the host's pids).
    A listed pid that does not exist here is foreign: never the unit's.
    """
    pids = set(obs.get("unit_pids") or [])
    here = obs.get("gpu_pids_here")
    here = None if here is None else set(here)
    by_index = {g["index"]: g for g in obs["gpus"]}
    out = {}
    for i in gpu_ids:
        gpu = by_index.get(i)
        if gpu is None:
            continue
        procs = [p for p in obs.get("gpu_processes", ()) if p.get("gpu_index") == i or p.get("gpu_uuid") == gpu.get("uuid")]
        if not procs:
            out[i] = (gpu.get("memory_used_mib"), "no processes listed by nvidia-smi: the GPU's total counted")
            continue
        if here is not None and not any(p.get("pid") in here for p in procs):
            out[i] = (gpu.get("memory_used_mib"),
                      "nvidia-smi lists pid(s) " + ", ".join(str(p.get("pid")) for p in procs)
                      + " that do not exist in this container (host pids): the GPU's total counted")
            continue
        mine = [p for p in procs if p.get("pid") in pids and (here is None or p.get("pid") in here)]
        out[i] = (sum(p.get("used_memory_mib") or 0 for p in mine),
                  None if mine else "held by pid(s) " + ", ".join(str(p.get("pid")) for p in procs) + ", not the unit's")
    return out


def ended_since_launch(unit):
    """The running unit's launch ended at least once already (its restart policy restarts it, or did): a restart
    counted, systemd's `auto-restart` wait, or a failed end in the unit's records since the launch."""
    return bool((unit.get("restarts") or 0) > 0 or unit.get("sub_state") == "auto-restart" or unit.get("last_exit_reason"))


class HealthTracker:
    """Accumulates observations; ``update`` returns the failures of the latest one.

    Each failure is ``{"invariant", "reason", "final"}``; ``final`` means waiting longer
    cannot help. ``now`` is a monotonic clock (seconds), observations carry wall time.
    ``snapshot`` (one observation, no watching) judges progress by the heartbeat's age.
    """

    def __init__(self, params, snapshot=False):
        self.params = params = HealthRequest.with_defaults(params)
        self.snapshot = snapshot
        self.window = float(params["progress_window"])
        # how long a launch may keep saying `starting` (refreshed: it is alive and loading) before it is hung
        self.start_window = max(float(params["start_window"] or 0), self.window)
        self.started = None
        self.first_log_size = None
        self.log_grew = False
        self.step = None
        self.step_since = None
        self.first_step = None
        self.failing_since = {}
        self.finished = False
        self.state = None

    def update(self, obs, now):
        if self.started is None:
            self.started = now
        failures = []
        self.finished = False
        hb = obs.get("heartbeat") if obs.get("heartbeat_current") else None
        unit = obs["unit"]
        running = is_running(unit)
        finished = bool(hb and hb.get("status") == "finished" and not running and unit.get("exit_status") in (0, None))
        loading = running and self._loading(obs)

        # log
        if not obs["log_exists"]:
            failures.append(("log", f"log file {self.params['log_path']} does not exist", False))
        else:
            if self.first_log_size is None:
                self.first_log_size = obs["log_size"]
            if obs["log_size"] > self.first_log_size:
                self.log_grew = True
            age = obs["wall"] - obs["log_mtime"] if obs["log_mtime"] is not None else None
            recent = age is not None and age <= self.window
            # on nodes other than 0 the log holds start-up lines only: the reporter on node 0 writes the steps
            quiet_node = bool(self.params.get("node_heartbeat_path") and self.params.get("node_rank"))
            if not (self.log_grew or (obs["log_size"] > 0 and recent) or finished or quiet_node or loading):
                failures.append(
                    ("log", f"log file {self.params['log_path']} last written {age:.0f}s ago "
                     f"(size {obs['log_size']} bytes, progress window {self.window:.0f}s)", False)
                )  # fmt: skip

        # unit
        if finished:
            pass
        elif not running:
            if unit.get("lost"):
                reason = ("lost: the container (or its node) restarted under the job and it was not launched again in "
                          "this boot (the boot relaunch failed or did not run)"
                          + (f"; its last exit status {unit['exit_status']}" if unit.get("exit_status") is not None else ""))
            elif unit.get("exit_status") is not None:
                reason = f"unit {unit['active_state']}: exit status {unit['exit_status']}"
            elif unit.get("load_state") == "not-found":
                reason = "unit not found: it was never started, or it exited and was unloaded"
            else:
                reason = f"unit {unit['active_state']} ({unit.get('sub_state')})"
            failures.append(("unit", reason, True))
        elif self.params.get("first_failure") and ended_since_launch(unit):
            # a launch a deploy can roll back: its first end is its failure, not the restart burst's last
            ended = unit.get("last_exit_reason") or f"exit status {unit.get('exit_status')}"
            failures.append(("unit", f"the launch ended ({ended}) and its restart policy restarts it (restarted "
                             f"{unit.get('restarts') or 0} time(s) so far): failed at its start", True))
        elif not unit.get("main_pid"):
            failures.append(("unit", f"unit {unit['active_state']} but has no MainPID yet", False))
        elif not unit.get("main_pid_alive"):
            failures.append(("unit", f"MainPID {unit['main_pid']} is not alive", False))

        # gpu
        gpu_ids = self.params.get("gpu_ids") or []
        if gpu_ids and running:
            failures.extend(self._gpu(obs, gpu_ids))

        # progress
        if running:
            failures.extend(self._progress(obs, now))

        # joined (multi-node)
        if running and self.params.get("node_heartbeat_path"):
            failures.extend(self._joined(obs))

        for invariant in INVARIANTS:
            if invariant not in {f[0] for f in failures}:
                self.failing_since.pop(invariant, None)
        result = []
        for invariant, reason, final in failures:
            since = self.failing_since.setdefault(invariant, now)
            # Anything failing for a whole progress window will not heal by waiting; a launch that says it is
            # still loading (final None) is judged by its start-up allowance instead.
            result.append({"invariant": invariant, "reason": reason,
                           "final": bool(final) or (final is not None and now - since >= self.window)})
        self.finished = finished and not result
        self.state = self._state(obs, result, finished)
        return result

    def _gpu(self, obs, gpu_ids):
        if obs.get("gpu_error"):
            final = obs.get("gpu_error_kind") in ("missing", "driver_mismatch", "no_driver")
            return [("gpu", obs["gpu_error"], final)]
        failures = []
        faults = obs.get("gpu_faults") or {}
        unfit = [f"GPU {i}: {'; '.join(faults[i])}" for i in gpu_ids if faults.get(i)] + list(obs.get("gpu_lost") or [])
        if unfit:
            failures.append(("gpu", "unfit GPU(s), the job cannot run on them: " + ". ".join(unfit), True))
        present = {g["index"] for g in obs["gpus"]}
        absent = [i for i in gpu_ids if i not in present]
        if absent:
            failures.append(("gpu", f"GPU(s) {absent} not visible to nvidia-smi (visible: {sorted(present)})", True))
        minimum = self.params["gpu_min_memory_mib"]
        low = []
        for i, (used, note) in sorted(unit_gpu_memory(obs, gpu_ids).items()):
            if used is None or used < minimum:
                low.append(f"GPU {i}: {'?' if used is None else used} MiB" + (f" ({note})" if note else ""))
        if low:
            failures.append(("gpu", f"GPU memory of the unit's processes below {minimum} MiB (model not loaded?): "
                             + ", ".join(low), False))  # fmt: skip
        return failures

    def _loading(self, obs):
        """This launch's heartbeat says `starting` and was rewritten within the progress window: the trainer
        refreshes it while it loads the models and prepares (regenerates) its data, which may take longer than
        the window."""
        hb = obs.get("heartbeat") if obs.get("heartbeat_current") else None
        if not hb or hb.get("status") != "starting":
            return False
        return obs["wall"] - float(hb.get("time") or 0) <= self.window

    def _node_loading(self, obs):
        """Multi-node: this launch's node file says every node reached the rendezvous and this node's ranks run
        but have not finished a step (on nodes other than 0 the node file is the heartbeat: node 0's trainer
        writes the `starting` one)."""
        node = obs.get("node")
        return bool(node and node.get("joined") and not node.get("all_joined") and node.get("status") != "failed")

    def _progress(self, obs, now):
        hb = obs.get("heartbeat")
        launched = obs["unit"].get("started_at")
        launch_age = obs["wall"] - launched if launched else None
        if self._loading(obs) or (self.params.get("node_rank") and self._node_loading(obs)):
            loading_for = launch_age if launch_age is not None else 0.0
            if loading_for > self.start_window:
                return [("progress", f"no progress: still starting {loading_for:.0f}s after the launch, beyond the "
                         f"start-up allowance ({self.start_window:.0f}s)", True)]
            return [("progress", f"no progress yet: starting (loading for {loading_for:.0f}s; start-up allowance "
                     f"{self.start_window:.0f}s)", None)]
        if not obs.get("heartbeat_current"):
            why = obs.get("heartbeat_stale_reason") or f"no heartbeat: {obs['heartbeat_error']}"
            if hb is not None:
                why = "the heartbeat file is not this launch's: " + why
            if launch_age is not None and launch_age > self.window:
                return [("progress", f"no progress: no heartbeat from this launch {launch_age:.0f}s after it started ({why})", True)]
            return [("progress", f"no progress yet: {why}", False)]
        step = hb["step"]
        status = hb.get("status")
        if status == "failed":
            error = f": {hb['error']}" if hb.get("error") else ""
            return [("progress", f"trainer reported status 'failed' at step {step}{error}", True)]
        age = obs["wall"] - float(hb.get("time") or 0)
        if status == "starting" or step == 0:
            observed = max(age, 0.0)
            return [("progress", f"no progress yet: heartbeat status {status!r}, step {step} for {observed:.0f}s",
                     launch_age is not None and launch_age > self.window)]  # fmt: skip
        if self.first_step is None:
            self.first_step = step
        if step != self.step:
            self.step, self.step_since = step, now
        if self.snapshot:
            if status == "training" and age <= self.window:
                return []
            return [("progress", f"no progress: heartbeat step stayed at {step} for {age:.0f}s", age > self.window)]
        if step > self.first_step:
            return []
        stayed = max(now - self.step_since, age)
        return [("progress", f"no progress: heartbeat step stayed at {step} for {stayed:.0f}s", stayed >= self.window)]

    def _joined(self, obs):
        node = obs.get("node")
        launched = obs["unit"].get("started_at")
        late = launched is not None and obs["wall"] - launched > self.window
        rank = int(self.params.get("node_rank") or 0)
        if node is None:
            return [("joined", f"{self.node_label(rank)}: no node file from this launch yet ({obs.get('node_error')})", late)]
        if node.get("status") == "failed":
            return [("joined", f"the job failed: {node.get('error') or 'its ranks ended'}", True)]
        if node.get("all_joined"):
            return []
        waited = obs["wall"] - (launched or obs["wall"])
        missing = node.get("missing") or []
        if missing:
            names = ", ".join(self.node_label(r, node) for r in missing)
            return [("joined", f"rendezvous incomplete after {waited:.0f}s: {names} did not join "
                     f"(never reached the rendezvous on {self.node_label(0, node)})", late)]
        if node.get("joined"):
            # every rank runs: they load the models and prepare the data, judged by the start-up allowance
            final = None if waited <= self.start_window else True
            return [("joined", f"every node reached the rendezvous; waiting for the first step of "
                     f"{self.node_label(rank, node)}'s ranks ({waited:.0f}s; start-up allowance "
                     f"{self.start_window:.0f}s)", final)]
        if rank:
            return [("joined", f"{self.node_label(rank, node)} is waiting {waited:.0f}s for the rendezvous on "
                     f"{self.node_label(0, node)} (did node 0 start? is its rendezvous port reachable from here?)", late)]
        return [("joined", f"{self.node_label(0, node)} is waiting {waited:.0f}s for the other nodes to join", late)]

    def node_label(self, rank, node=None):
        """``node R (NAME)``: the inventory's name first, else the one the launcher reported."""
        names = self.params.get("nodes") or []
        name = names[rank] if rank < len(names) else ((node or {}).get("nodes") or {}).get(str(rank))
        return f"node {rank} ({name})" if name else f"node {rank}"

    def _state(self, obs, failures, finished):
        unit = obs["unit"]
        hb = obs.get("heartbeat") if obs.get("heartbeat_current") else None
        if finished:
            return FINISHED
        if obs.get("gpu_error_kind") == "driver_mismatch" and not (is_running(unit) and not failures):
            return DRIVER_MISMATCH
        if is_running(unit):
            if not failures:
                return TRAINING
            if hb and hb.get("status") == "failed":
                return CRASHED
            if self.params.get("first_failure") and ended_since_launch(unit):
                return CRASHED if hb and hb.get("step", 0) > 0 else FAILED_TO_START
            return HUNG if any(f["final"] for f in failures) else STARTING
        if unit.get("lost"):
            # Never `stopped`: the shutdown's SIGTERM looks like a stop on purpose, but the job was meant to run.
            return LOST
        exit_status = unit.get("exit_status")
        # SIGTERM (143) is a stop: systemd counts it a success (Result=success) as well.
        if exit_status in (0, None, 143) or unit.get("result") == "success" or (hb and hb.get("status") == "stopped"):
            return STOPPED
        trained = hb is not None and hb["step"] > 0 and hb.get("status") in ("training", "failed", "stopped")
        return CRASHED if trained else FAILED_TO_START


def watchdog_line(watchdog, obs):
    """When the unit's watchdog acts on a hung job: ``watchdog`` seconds after the trainer's last step ping."""
    watchdog = int(watchdog or 0)
    if watchdog <= 0:
        return "watchdog: none (dflash_job_watchdog 0): it stays hung until restarted"
    hb = obs.get("heartbeat") if obs.get("heartbeat_current") else None
    if not hb or not hb.get("step") or hb.get("status") == "starting":
        return (f"watchdog: it acts {watchdog}s after the trainer's last step ping (before the first step: the start-up "
                f"interval, dflash_job_watchdog_start): SIGABRT, then the unit's restart policy")
    age = max(obs["wall"] - float(hb.get("time") or 0), 0.0)
    if age < watchdog:
        return (f"watchdog: it acts in about {watchdog - age:.0f}s ({watchdog}s after the last step's ping, step "
                f"{hb.get('step')} {age:.0f}s ago): SIGABRT, then the unit's restart policy")
    return (f"watchdog: its {watchdog}s after the last step's ping (step {hb.get('step')}) ran out {age - watchdog:.0f}s "
            f"ago: it acts now (SIGABRT, then the unit's restart policy), unless something else still pings it")


def format_diagnosis(name, healthy, failures, obs, log_tail, elapsed, log_path, finished=False, state=None,
                     log_unsafe=None, stacks=None, watchdog=0):
    unit = obs["unit"]
    hb = obs.get("heartbeat") or {}
    current = obs.get("heartbeat_current")
    if healthy:
        head = f"dflash job {name!r} is healthy" + (" (finished)" if finished else "") + f" after {elapsed:.0f}s"
    else:
        head = f"dflash job {name!r} is NOT healthy ({state}) after {elapsed:.0f}s:"
    lines = [head]
    for failure in failures:
        lines.append(f"  - {failure['invariant']}: {failure['reason']}")
    if state == HUNG:
        lines.append(f"the job is hung: {RESTART_HINT}")
        # hang evidence: every rank's stacks dumped by this launch (module_utils/dflash_stacks.py)
        lines.extend(describe_stacks(stacks, obs["wall"]) if stacks else
                     ["stacks: no dump from this launch (a trainer with dflash/runtime/stacks.py dumps on SIGUSR1)"])
        lines.append(watchdog_line(watchdog, obs))
    if state == LOST:
        lines.append("the job is lost: " + LOST_HINT.format(name=name))
    if state == DRIVER_MISMATCH:
        lines.append("driver mismatch: " + DRIVER_MISMATCH_HINT)
    lines.append(
        f"unit: backend={unit.get('backend', '?')} active_state={unit.get('active_state')} sub_state={unit.get('sub_state')} "
        f"main_pid={unit.get('main_pid') or '-'} exit_status={'-' if unit.get('exit_status') is None else unit['exit_status']}"
        + (f" failure_class={failure_class(unit, hb if current else None)}" if failure_class(unit, hb if current else None)
           else "")
    )
    if hb and current:
        age = obs["wall"] - float(hb.get("time") or 0)
        rate = hb.get("tokens_per_s") if state in (TRAINING, FINISHED, None) else None
        lines.append(
            f"heartbeat: step={hb.get('step')} epoch={hb.get('epoch')} status={hb.get('status')} "
            f"loss={hb.get('loss')} tau={hb.get('tau')} tokens/s={rate if rate is not None else '-'} age={age:.0f}s"
        )
        if hb.get("eval_step") is not None:
            lines.append(
                f"last eval (step {hb.get('eval_step')}): simulated tau={hb.get('eval_tau')} "
                f"real acceptance length={hb.get('eval_acceptance_length')} (speculative decoding with the target)"
            )
    elif hb:
        lines.append(f"heartbeat: none from this launch ({obs.get('heartbeat_stale_reason')})")
    else:
        lines.append(f"heartbeat: {obs.get('heartbeat_error')}")
    if obs.get("node") is not None:
        node = obs["node"]
        lines.append(f"node: {node.get('node_rank')} of {node.get('nnodes')} ({node.get('node')}), status {node.get('status')}, "
                     f"all ranks joined: {'yes' if node.get('all_joined') else 'no'}"
                     + (f", {node['error']}" if node.get("error") else ""))
    elif obs.get("node_error"):
        lines.append(f"node: {obs['node_error']}")
    if obs.get("checkpoint"):
        lines.append(f"checkpoint: {obs['checkpoint']} (the job resumes from it)")
    if obs.get("gpus") or obs.get("gpu_error"):
        lines.append("GPUs:")
        lines.append(obs["gpu_error"] if obs.get("gpu_error") else format_gpu_table(obs["gpus"], obs.get("gpu_processes", ())))
    if log_unsafe:
        lines.append(f"log {log_path} {log_unsafe}: not read")
    elif log_tail is None:
        lines.append(f"log {log_path}: missing")
    else:
        lines.append(f"log {log_path} (last {len(log_tail)} lines):")
        lines.extend("  | " + line for line in log_tail)
    return "\n".join(lines)


def failure_class(unit, hb):
    """The class of the job's last failure (dflash/runtime/failures.py): the trainer's own (its `failed` heartbeat) when it
    wrote one, else that of the unit's exit status; None when it did not fail."""
    if hb and hb.get("status") == "failed" and hb.get("failure_class"):
        return hb["failure_class"]
    return unit.get("failure_class")


def _sleep_for(poll_interval, polls):
    # Fast at first (a healthy tiny job advances within a second), then the configured interval.
    return min(float(poll_interval), 0.25 * (2**polls))


def check_health(host, params, status_probe, wall_clock=time.time):
    """Poll until all invariants hold, one is final, or ``timeout``. Returns the module result.

    ``status_probe()`` returns the unit status dict (see dflash_unit backends), optionally with
    ``started_at``. ``timeout: 0`` takes one snapshot.
    """
    params = HealthRequest.with_defaults(params)
    timeout = float(params["timeout"])
    tracker = HealthTracker(params, snapshot=timeout <= 0)
    start = host.now()
    polls = 0
    while True:
        obs = observe(host, params, status_probe(), wall=wall_clock())
        now = host.now()
        failures = tracker.update(obs, now)
        if not failures or any(f["final"] for f in failures) or now - start >= timeout:
            break
        host.sleep(min(_sleep_for(params["poll_interval"], polls), max(0.0, timeout - (now - start))) or 0.1)
        polls += 1
    elapsed = host.now() - start
    log_tail, log_unsafe = tail_lines_checked(params["log_path"], int(params["log_lines"]))
    healthy = not failures
    state = tracker.state
    # Only this launch's heartbeat speaks for the job; a rate is reported only while it trains.
    hb = (obs.get("heartbeat") if obs.get("heartbeat_current") else None) or {}
    stacks = hang_evidence(host, obs, params) if state == HUNG or params.get("dump_stacks") else {}
    diagnosis = format_diagnosis(params["name"], healthy, failures, obs, log_tail, elapsed, params["log_path"],
                                 tracker.finished, state, log_unsafe=log_unsafe, stacks=stacks,
                                 watchdog=params.get("watchdog") or 0)  # fmt: skip
    return {
        "healthy": healthy,
        "finished": tracker.finished,
        "state": state,
        "ok": state in OK_STATES,
        "failed_invariants": [f["invariant"] for f in failures],
        "failures": [{"invariant": f["invariant"], "reason": f["reason"]} for f in failures],
        "diagnosis": diagnosis,
        "hint": (f"{RESTART_HINT}; {watchdog_line(params.get('watchdog'), obs)}" if state == HUNG else LOST_HINT.format(name=params["name"]) if state == LOST
                 else DRIVER_MISMATCH_HINT if state == DRIVER_MISMATCH else None),
        "unit": obs["unit"],
        "unit_pids": obs.get("unit_pids", []),
        "failure_class": failure_class(obs["unit"], hb),
        "step": hb.get("step"),
        "epoch": hb.get("epoch"),
        "loss": hb.get("loss"),
        "tokens_per_s": hb.get("tokens_per_s") if state in (TRAINING, FINISHED) else None,
        "tau": hb.get("tau"),
        "eval_tau": hb.get("eval_tau"),
        "acceptance_length": hb.get("eval_acceptance_length"),
        "heartbeat": obs.get("heartbeat"),
        "heartbeat_current": bool(obs.get("heartbeat_current")),
        "job": params["name"],
        "nodes": list(params.get("nodes") or []),
        "node": obs.get("node"),
        "all_joined": bool((obs.get("node") or {}).get("all_joined")) if params.get("node_heartbeat_path") else None,
        "lost_node": (obs.get("node") or {}).get("lost_node_name"),
        "checkpoint": obs.get("checkpoint"),
        "checkpoint_step": obs.get("checkpoint_step"),
        "gpus": obs.get("gpus", []),
        "gpu_processes": obs.get("gpu_processes", []),
        "gpu_table": format_gpu_table(obs["gpus"], obs.get("gpu_processes", ())) if obs.get("gpus") else None,
        "log_tail": log_tail or [],
        "stacks": stacks_report(stacks),
        "elapsed_s": round(elapsed, 1),
    }
