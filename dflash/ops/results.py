"""Typed results of the operator API, built from ansible-runner's structured events.

The playbooks' own modules carry the facts: `dflash_unit` (unit state, pid, exit
status), `dflash_health` (the health invariants, heartbeat metrics, GPUs, log tail,
diagnosis) and `dflash_gpu_facts` (GPU table). Their results are read from the
`res` of `runner_on_ok` / `runner_on_failed` events, recognised by module name;
`runner_on_unreachable` marks a host unreachable. Nothing here parses text output.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from dflash.errors import DflashError

MODULE_UNIT = "dflash_unit"
MODULE_HEALTH = "dflash_health"
MODULE_GPU_FACTS = "dflash_gpu_facts"
MODULE_LOGS = "dflash_logs"
# A long task run in the background (async) is waited for by `dflash_wait`, whose result is the task's own: a
# health check's result arrives from it.
MODULE_WAIT = "dflash_wait"

# Container states. The first seven are dflash_health's (`state`); the others are derived when no
# health check ran (a deploy that failed earlier, stop.yml) or the host was not reached.
TRAINING, FINISHED, STARTING, HUNG, CRASHED, FAILED_TO_START, STOPPED, LOST, DRIVER_MISMATCH = (
    "training", "finished", "starting", "hung", "crashed", "failed-to-start", "stopped", "lost", "driver-mismatch")
UNHEALTHY, RUNNING, FAILED, UNREACHABLE, UNKNOWN = "unhealthy", "running", "failed", "unreachable", "unknown"
HEALTH_STATES = (TRAINING, FINISHED, STARTING, HUNG, CRASHED, FAILED_TO_START, STOPPED, LOST, DRIVER_MISMATCH)
# States a status exits 0 for: healthy, or not running on purpose.
OK_STATES = (TRAINING, FINISHED, STARTING, STOPPED)
# A failure of these modules means the input (inventory, -e) is wrong, not the hosts.
BAD_INPUT_MODULES = ("dflash_inventory_check", "validate_argument_spec")

# Control characters but the newline and the tab, escaped before anything is printed: the modules escape the trainer's
# text on the target (module_utils/dflash_host.printable); this is the controller's own guard.
_CONTROL = {code: f"\\x{code:02x}" for code in (*range(0x09), *range(0x0B, 0x20), 0x7F, *range(0x80, 0xA0))}
_CONTROL.update({code: f"\\u{code:04x}" for code in (0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A))})


def printable(text: Any) -> str:
    """``text`` with its control characters (ESC, carriage return, ...; not the newline, not the tab) escaped."""
    return str(text).translate(_CONTROL)


@dataclass
class GpuMemory:
    """One GPU as the container sees it."""

    index: int
    name: str | None = None
    used_mib: int | None = None
    total_mib: int | None = None
    utilization_pct: int | None = None


@dataclass
class TaskFailure:
    """The task that ended a host's play."""

    host: str
    task: str
    message: str
    play: str | None = None
    module: str | None = None
    unreachable: bool = False
    # The full health report when the failing task is the health check.
    diagnosis: str | None = None

    @property
    def headline(self) -> str:
        """One line naming the host, the task and why."""
        if self.unreachable:
            return f"{self.host} is unreachable (task '{self.task}'): {_first_line(self.message)}"
        return f"task '{self.task}' failed on {self.host}: {failure_summary(self.message, self.diagnosis)}"


@dataclass
class ContainerStatus:
    """What the playbook found out about one container's training job."""

    host: str
    state: str = UNKNOWN
    reachable: bool = True
    # The unit (dflash_unit / dflash_health's `unit`).
    backend: str | None = None
    unit_state: str | None = None  # systemd-style ActiveState: active, inactive, failed, ...
    sub_state: str | None = None
    pid: int | None = None
    exit_status: int | None = None
    action: str | None = None  # what dflash_unit did: none, started, restarted, stopped, removed
    # Self-healing (docs/operations.md): automatic restarts since the launch, watchdog kills among them, how it
    # last failed, and whether the restarts are exhausted.
    restarts: int = 0
    watchdog_kills: int = 0
    last_exit_reason: str | None = None
    crash_loop: bool = False
    failure_class: str | None = None  # the class of the last failed end (dflash/runtime/failures.py): cuda_oom, data_error, ...
    # Health and the trainer's heartbeat (dflash_health).
    healthy: bool | None = None
    health_state: str | None = None  # dflash_health's state, when it ran
    hint: str | None = None  # what to run (a hung job: the restart command)
    checkpoint: str | None = None  # the newest checkpoint (what a restart resumes from)
    finished: bool = False
    failed_invariants: list[str] = field(default_factory=list)
    failures: list[dict[str, str]] = field(default_factory=list)  # dflash_health's: {invariant, reason}
    name: str | None = None  # the job's name (dflash_health's `job`)
    diagnosis: str | None = None
    step: int | None = None
    epoch: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    tau: float | None = None  # simulated, on the training data (docs/evaluation.md)
    acceptance_length: float | None = None  # real, speculative decoding with the target at the last eval
    gpus: list[GpuMemory] = field(default_factory=list)
    log_path: str | None = None
    log_tail: list[str] = field(default_factory=list)
    # A hung job's hang evidence (dflash_health's `stacks`): per rank, whether it is the stuck one, its top frames.
    stacks: list[dict[str, Any]] = field(default_factory=list)
    # playbooks/logs.yml: where the next follow read starts.
    log_next_offset: int | None = None
    failure: TaskFailure | None = None
    # Multi-node jobs (dflash_health's node report): the job, this node's rank among its nodes (in rank order).
    job: str | None = None
    nodes: list[str] = field(default_factory=list)
    node_rank: int | None = None
    all_joined: bool | None = None
    lost_node: str | None = None


# The worst state first: a job across nodes is as bad as its worst node.
_JOB_STATE_ORDER = (UNREACHABLE, DRIVER_MISMATCH, LOST, CRASHED, HUNG, FAILED_TO_START, FAILED, UNHEALTHY, UNKNOWN, STARTING, RUNNING, STOPPED,
                    FINISHED, TRAINING)


@dataclass
class JobAcrossNodes:
    """One multi-node job seen across its containers: its worst node's state, whether every rank joined, the lost node."""

    name: str
    nodes: list[str]
    state: str
    all_joined: bool
    lost_node: str | None = None
    step: int | None = None  # node 0's (its reporter trains the job's steps)
    missing: list[str] = field(default_factory=list)  # nodes of the job this run did not report on

    def describe(self) -> str:
        bits = [f"job {self.name} on {len(self.nodes)} nodes: {self.state}",
                f"all ranks joined: {'yes' if self.all_joined else 'no'}"]
        if self.step is not None:
            bits.append(f"step {self.step}")
        if self.lost_node:
            bits.append(f"lost node: {self.lost_node}")
        if self.missing:
            bits.append("not reported: " + ", ".join(self.missing))
        return ", ".join(bits)


def jobs_across_nodes(containers: dict[str, ContainerStatus]) -> list[JobAcrossNodes]:
    jobs: dict[str, list[str]] = {}
    for c in containers.values():
        if c.job and len(c.nodes) > 1:
            jobs.setdefault(c.job, c.nodes)
    out = []
    for name, nodes in jobs.items():
        seen = [containers[n] for n in nodes if n in containers]
        states = [c.state for c in seen]
        lost = next((c.lost_node for c in seen if c.lost_node), None)
        first = containers.get(nodes[0])
        out.append(JobAcrossNodes(
            name=name, nodes=list(nodes), state=min(states, key=_JOB_STATE_ORDER.index) if states else UNKNOWN,
            all_joined=bool(seen) and len(seen) == len(nodes) and all(c.all_joined for c in seen), lost_node=lost,
            step=first.step if first else None, missing=[n for n in nodes if n not in containers]))
    return out


class OpsFailed(DflashError):
    """An operation failed; ``.result`` is its :class:`OpsResult`."""

    def __init__(self, result: OpsResult) -> None:
        super().__init__(result.message)
        self.result = result


@dataclass
class OpsResult:
    """The outcome of one operation (one playbook run)."""

    operation: str
    playbook: str
    inventory: str
    ok: bool
    status: str  # ansible-runner's: successful, failed, timeout, canceled
    rc: int | None
    containers: dict[str, ContainerStatus] = field(default_factory=dict)
    failures: list[TaskFailure] = field(default_factory=list)
    # Set when the run produced no usable events (e.g. a playbook or inventory error).
    error: str | None = None
    # The inventory, --limit or extra vars were wrong rather than the hosts.
    bad_input: bool = False
    stats: dict[str, dict[str, int]] = field(default_factory=dict)
    artifact_dir: str | None = None
    # Multi-node jobs, each across its containers.
    jobs: list[JobAcrossNodes] = field(default_factory=list)

    @property
    def message(self) -> str:
        """One clear line: what failed where, or a summary of the containers."""
        if self.error:
            return f"{self.operation} failed: {self.error}"
        if self.failures:
            extra = f" (and {len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
            return f"{self.operation} failed: {self.failures[0].headline}{extra}"
        if not self.ok:
            return f"{self.operation} failed: ansible-runner status {self.status}, rc {self.rc}"
        parts = [f"{c.host} {_describe(c)}" for c in self.containers.values()] + [j.describe() for j in self.jobs]
        return f"{self.operation} ok: " + ("; ".join(parts) if parts else "no containers")

    def raise_for_failure(self) -> OpsResult:
        """Self if the operation succeeded, else raise :class:`OpsFailed` (for scripts and schedulers)."""
        if not self.ok:
            raise OpsFailed(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["message"] = self.message
        for failure in data["failures"]:
            failure["headline"] = TaskFailure(**failure).headline
        return data


def _first_line(text: str | None) -> str:
    text = (text or "").strip()
    return text.splitlines()[0] if text else "(no message)"


def failure_summary(message: str, diagnosis: str | None = None) -> str:
    """A diagnosis' failed invariants (`  - unit: unit failed ...`) on one line, else the message's first line."""
    if diagnosis:
        reasons = [line.strip()[2:] for line in diagnosis.splitlines() if line.startswith("  - ")]
        errors = [line.split("| ", 1)[-1] for line in diagnosis.splitlines() if "error" in line.lower() and "| " in line]
        if reasons:
            return "; ".join(reasons) + (f" - last error in the log: {errors[-1]}" if errors else "")
    return _first_line(message)


def _describe(c: ContainerStatus) -> str:
    bits = [c.state]
    if c.step is not None:
        bits.append(f"step {c.step}")
    if c.tokens_per_s is not None:
        bits.append(f"{c.tokens_per_s:.0f} tok/s")
    if c.tau is not None:
        bits.append(f"tau {c.tau:.2f}")
    if c.acceptance_length is not None:
        bits.append(f"real acceptance {c.acceptance_length:.2f}")
    if c.checkpoint:
        bits.append(f"checkpoint {c.checkpoint}")
    if c.state in (STOPPED, FAILED, CRASHED, FAILED_TO_START, LOST, DRIVER_MISMATCH) and c.exit_status is not None:
        bits.append(f"exit status {c.exit_status}" + (f" ({c.failure_class})" if c.failure_class else ""))
    elif c.failure_class:
        bits.append(f"last failure class {c.failure_class}")
    if c.restarts or c.crash_loop:
        bits.append(f"restarted {c.restarts}x (watchdog {c.watchdog_kills}x), last failure {c.last_exit_reason or '-'}"
                    + (": crash loop, restarts exhausted" if c.crash_loop else ""))
    for rank in c.stacks:
        if rank.get("stuck"):
            bits.append(f"stuck rank {rank.get('rank')} at {' <- '.join(rank.get('frames') or []) or 'no Python frame'}")
    if c.hint:
        bits.append(c.hint)
    return ", ".join(bits)


def report_lines(c: ContainerStatus) -> list[str]:
    """The job's report lines that status.yml prints (roles/job/templates/status.txt.j2): the state and each failed
    invariant with its reason (why a `starting` job has no heartbeat yet, too), the hint, and the restarts line
    (restart count, watchdog kills, last failure, the crash loop)."""
    state = c.health_state or c.state
    lines = [f"{c.host} / {c.name or c.job or '-'}: {state}{'' if state in OK_STATES else ' (NOT HEALTHY)'}"]
    if state not in (STOPPED, FINISHED):
        lines += [f"  - {f['invariant']}: {f['reason']}" for f in c.failures]
    if c.hint:
        lines.append(f"  {c.hint}")
    restarts = f"restarts   {c.restarts or 0} (watchdog kills {c.watchdog_kills or 0})"
    if c.last_exit_reason:
        restarts += f", last failure {c.last_exit_reason}"
    if c.crash_loop:
        restarts += " - crash loop: restarts exhausted, the unit stays failed"
    return lines + [restarts]


def module_name(event_data: dict[str, Any]) -> str:
    """`dflash_health` for `dflash_health`, `ansible.legacy.dflash_health`, `local.x.dflash_health`."""
    action = event_data.get("resolved_action") or event_data.get("task_action") or ""
    return action.rsplit(".", 1)[-1]


def failure_message(res: dict[str, Any]) -> str:
    """The most specific message a failed result carries (a loop's failed item, a command's stderr)."""
    for item in res.get("results") or []:
        if isinstance(item, dict) and item.get("failed"):
            return failure_message(item)
    msg = str(res.get("msg") or "").strip()
    stderr = str(res.get("stderr") or res.get("module_stderr") or "").strip()
    if stderr and (not msg or msg in ("non-zero return code", "MODULE FAILURE\nSee stdout/stderr for the exact error")):
        # A traceback's exception and the trainer's `dflash: error: ...` are the last line; the
        # whole stderr stays in the run's artifacts.
        last = stderr.splitlines()[-1].strip()
        return f"{msg.splitlines()[0]}: {last}" if msg else last
    return msg or "failed without a message"


class EventCollector:
    """Folds runner events, in order, into per-container results.

    Call ``add(event)`` for every event (it is an ansible-runner event handler
    that keeps the event), then ``result(...)``.
    """

    def __init__(self) -> None:
        self.containers: dict[str, ContainerStatus] = {}
        self.failures: dict[str, TaskFailure] = {}
        self.stats: dict[str, dict[str, int]] = {}
        self.no_hosts_matched = False
        self.events = 0

    def __call__(self, event: dict[str, Any]) -> bool:
        self.add(event)
        return True

    def container(self, host: str) -> ContainerStatus:
        if host not in self.containers:
            self.containers[host] = ContainerStatus(host=host)
        return self.containers[host]

    def add(self, event: dict[str, Any]) -> None:
        self.events += 1
        kind = event.get("event")
        data = event.get("event_data") or {}
        if kind == "playbook_on_no_hosts_matched":
            self.no_hosts_matched = True
        elif kind == "playbook_on_stats":
            self.stats = {key: dict(data.get(key) or {}) for key in
                          ("ok", "changed", "failures", "dark", "skipped", "rescued", "ignored", "processed")}
        elif kind in ("runner_on_ok", "runner_on_failed", "runner_on_unreachable") and data.get("host"):
            self._add_result(kind, data)

    def _add_result(self, kind: str, data: dict[str, Any]) -> None:
        host = data["host"]
        res = data.get("res") or {}
        container = self.container(host)
        if kind == "runner_on_unreachable":
            container.reachable = False
            self.failures[host] = TaskFailure(
                host=host, task=_task_name(data), message=str(res.get("msg") or "unreachable"),
                play=data.get("play"), module=module_name(data) or None, unreachable=True)
            return
        if kind == "runner_on_failed" and data.get("ignore_errors"):
            return
        module = module_name(data)
        if module == MODULE_WAIT and "healthy" in res:
            module = MODULE_HEALTH
        if module == MODULE_UNIT:
            _apply_unit(container, res)
        elif module == MODULE_HEALTH:
            _apply_health(container, res)
        elif module == MODULE_GPU_FACTS:
            _apply_gpu_facts(container, res)
        elif module == MODULE_LOGS and kind == "runner_on_ok":
            _apply_log(container, res)
        if kind == "runner_on_failed":
            self.failures[host] = TaskFailure(
                host=host, task=_task_name(data), message=failure_message(res), play=data.get("play"),
                module=module or None,
                diagnosis=health_diagnosis(res) if module == MODULE_HEALTH else relayed_diagnosis(res, container))

    def result(self, operation: str, playbook: str, inventory: str, status: str, rc: int | None,
               artifact_dir: str | None = None, error: str | None = None, bad_input: bool = False) -> OpsResult:
        # A failure a rescue block handled does not end the host's play: keep only
        # the hosts the final stats count as failed or unreachable.
        if self.stats:
            ended = set(self.stats.get("failures", {})) | set(self.stats.get("dark", {}))
            failures = [f for host, f in self.failures.items() if host in ended]
        else:
            failures = list(self.failures.values())
        for failure in failures:
            self.container(failure.host).failure = failure
        for container in self.containers.values():
            container.state = derive_state(container)
        if any(f.module in BAD_INPUT_MODULES for f in failures):
            bad_input = True
        if error is None and self.no_hosts_matched and not self.containers:
            error = f"no container matched: {inventory} has no hosts in group dflash_containers (or --limit excludes them all)"
            bad_input = True
        ok = status == "successful" and rc == 0 and not failures and error is None
        if not ok and error is None and not failures and rc not in (0, None):
            error = f"ansible-playbook exited with status {rc} ({status}) before reporting a failed task"
        return OpsResult(operation=operation, playbook=playbook, inventory=inventory, ok=ok, status=status, rc=rc,
                         containers=dict(sorted(self.containers.items())), failures=failures, error=error,
                         bad_input=bad_input, stats=self.stats, artifact_dir=artifact_dir,
                         jobs=jobs_across_nodes(self.containers))


def _task_name(data: dict[str, Any]) -> str:
    task = data.get("task") or "?"
    return f"{data['role']} : {task}" if data.get("role") else task


def _apply_unit_fields(container: ContainerStatus, unit: dict[str, Any]) -> None:
    container.backend = unit.get("backend") or container.backend
    container.unit_state = unit.get("active_state")
    container.sub_state = unit.get("sub_state")
    container.pid = unit.get("main_pid") or None
    container.exit_status = unit.get("exit_status")
    container.restarts = unit.get("restarts") or 0
    container.watchdog_kills = unit.get("watchdog_kills") or 0
    container.last_exit_reason = unit.get("last_exit_reason")
    container.crash_loop = bool(unit.get("crash_loop"))
    container.failure_class = unit.get("failure_class")


def _apply_unit(container: ContainerStatus, res: dict[str, Any]) -> None:
    if "active_state" not in res:  # failed before it knew the unit (bad arguments)
        return
    _apply_unit_fields(container, res)
    container.action = res.get("action")
    if container.action in ("stopped", "removed"):  # a health read before the stop (its stacks) is history now
        container.healthy = container.health_state = container.hint = None


def _apply_health(container: ContainerStatus, res: dict[str, Any]) -> None:
    if "healthy" not in res:  # failed before checking (bad arguments, unknown backend)
        return
    if res.get("unit"):
        _apply_unit_fields(container, res["unit"])
    container.healthy = bool(res["healthy"])
    container.health_state = res.get("state")
    container.hint = res.get("hint")
    container.checkpoint = res.get("checkpoint")
    container.finished = bool(res.get("finished"))
    container.failed_invariants = list(res.get("failed_invariants") or [])
    container.failures = [{"invariant": str(f.get("invariant")), "reason": str(f.get("reason"))}
                          for f in res.get("failures") or [] if isinstance(f, dict)]  # fmt: skip
    container.name = res.get("job") or container.name
    container.diagnosis = health_diagnosis(res)
    for key in ("step", "epoch", "loss", "tokens_per_s", "tau", "acceptance_length"):
        setattr(container, key, res.get(key))
    if res.get("gpus"):
        container.gpus = _gpus(res["gpus"])
    if res.get("log_tail"):
        container.log_tail = list(res["log_tail"])
    container.stacks = list(res.get("stacks") or [])
    if res.get("node") is not None or res.get("all_joined") is not None:
        container.job, container.nodes = res.get("job"), list(res.get("nodes") or [])
        container.node_rank = container.nodes.index(container.host) if container.host in container.nodes else None
        container.all_joined, container.lost_node = res.get("all_joined"), res.get("lost_node")


def relayed_diagnosis(res: dict[str, Any], container: ContainerStatus | None = None) -> str | None:
    """The health report behind another task's failure: a message that quotes it, else the container's last health
    check when it failed (the job role prints a failed check's diagnosis once, then fails with a one-line summary)."""
    message = str(res.get("msg") or "")
    if re.search(r"^dflash job '[^']+' is NOT healthy", message, re.MULTILINE):
        return message
    return container.diagnosis if container is not None and container.healthy is False else None


def health_diagnosis(res: dict[str, Any]) -> str | None:
    """dflash_health's report: `diagnosis` on success, the failure message itself on failure."""
    return res.get("diagnosis") or (res.get("msg") if res.get("healthy") is False else None)


def _apply_gpu_facts(container: ContainerStatus, res: dict[str, Any]) -> None:
    gpus = (res.get("ansible_facts") or {}).get("dflash_gpus")
    if gpus:
        container.gpus = _gpus(gpus)


def _apply_log(container: ContainerStatus, res: dict[str, Any]) -> None:
    container.log_path = res.get("path")
    container.log_tail = list(res.get("lines") or [])
    container.log_next_offset = res.get("next_offset")


def _gpus(rows: list[dict[str, Any]]) -> list[GpuMemory]:
    return [GpuMemory(index=row.get("index"), name=row.get("name"), used_mib=row.get("memory_used_mib"),
                      total_mib=row.get("memory_total_mib"), utilization_pct=row.get("utilization_pct"))
            for row in rows]


def derive_state(c: ContainerStatus) -> str:
    if not c.reachable:
        return UNREACHABLE
    if c.health_state in HEALTH_STATES:
        return c.health_state
    if c.healthy is not None:
        if c.finished:
            return FINISHED
        if c.healthy:
            return TRAINING
        if c.unit_state in ("active", "activating", "reloading"):
            return UNHEALTHY
    if c.unit_state is None:
        return UNKNOWN
    if c.unit_state == "failed" or (c.exit_status not in (None, 0) and c.unit_state != "active"):
        return FAILED
    if c.unit_state in ("active", "activating", "reloading"):
        return RUNNING
    return STOPPED
