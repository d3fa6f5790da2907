"""Run the project's playbooks with ansible-runner and fold their events into results.

Every run gets its own artifact directory `CACHE/runner/artifacts/<utc time>-<operation>`
(`CACHE` = `$DFLASH_CACHE_DIR`, else `$XDG_CACHE_HOME/dflash`, else `~/.cache/dflash`);
ansible-runner keeps the newest `keep_artifacts` of them. The project directory is the
repository (its `ansible.cfg` supplies roles, library and module_utils), found next to
this package or named by `$DFLASH_PROJECT_DIR`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash.errors import BadInput
from dflash.ops.results import EventCollector, OpsResult

PLAYBOOKS = {"train": "train.yml", "deploy": "deploy.yml", "status": "status.yml", "stop": "stop.yml",
             "logs": "logs.yml"}
DEFAULT_KEEP_ARTIFACTS = 20
CONTAINER_GROUP = "dflash_containers"

EventHandler = Callable[[dict[str, Any]], Any]


def project_dir() -> Path:
    """The repository whose `playbooks/` and `ansible.cfg` the operations run."""
    configured = os.environ.get("DFLASH_PROJECT_DIR")
    root = Path(configured) if configured else Path(__file__).resolve().parents[2]
    if not (root / "playbooks").is_dir() or not (root / "ansible.cfg").is_file():
        raise BadInput(f"{root} holds no playbooks/ and ansible.cfg: dflash ops runs the playbooks of a dflash "
                       f"checkout; install the package editable from the repository (pip install -e .) or set "
                       f"DFLASH_PROJECT_DIR to the repository")
    return root


def cache_dir() -> Path:
    if os.environ.get("DFLASH_CACHE_DIR"):
        return Path(os.environ["DFLASH_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash"


def resolve_inventory(inventory: str | os.PathLike[str]) -> Path:
    """The inventory as an absolute path: relative to the working directory, else to the project."""
    path = Path(inventory).expanduser()
    candidates = [path] if path.is_absolute() else list(dict.fromkeys([Path.cwd() / path, project_dir() / path]))
    for candidate in candidates:
        if candidate.exists():
            return candidate.resolve()
    tried = " or ".join(str(c) for c in candidates)
    raise BadInput(f"inventory {inventory}: no such file or directory ({tried}); pass an inventory file or "
                   f"directory, e.g. -i inventories/local")


def check_extravars(extravars: dict[str, Any]) -> dict[str, Any]:
    for key in extravars:
        if not isinstance(key, str) or not key.isidentifier():
            raise BadInput(f"extra variable name {key!r} is not a valid Ansible variable name "
                           f"(letters, digits and underscores, not starting with a digit)")
    return dict(extravars)


def _ansible_env(root: Path) -> dict[str, str]:
    return {
        "ANSIBLE_CONFIG": str(root / "ansible.cfg"),
        # The ansible of this interpreter's environment, even when it is not activated.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "ANSIBLE_NOCOLOR": "1",
    }


def inventory_containers(inventory: Path, limit: str | None = None) -> tuple[list[str], list[str]]:
    """The hosts of group dflash_containers (after --limit) and ansible's warnings about the inventory."""
    root = project_dir()
    cmd = ["ansible-inventory", "-i", str(inventory), "--list"] + (["--limit", limit] if limit else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env={**os.environ, **_ansible_env(root)},
                          timeout=120, check=False)
    warnings = [line.split(":", 1)[1].strip() for line in proc.stderr.splitlines()
                if line.startswith(("[WARNING]:", "[ERROR]:", "ERROR!"))]
    try:
        groups = json.loads(proc.stdout)
    except ValueError:
        return [], warnings or [proc.stderr.strip() or f"ansible-inventory exited with {proc.returncode}"]

    def hosts(group: str, seen: set[str]) -> list[str]:
        if group in seen:
            return []
        seen.add(group)
        entry = groups.get(group) or {}
        found = list(entry.get("hosts") or [])
        for child in entry.get("children") or []:
            found += hosts(child, seen)
        return found

    return sorted(set(hosts(CONTAINER_GROUP, set()))), warnings


class OpsRun:
    """One playbook run in progress (see :func:`start`)."""

    def __init__(self, operation: str, playbook: str, inventory: Path, limit: str | None, kwargs: dict[str, Any],
                 collector: EventCollector, artifact_dir: Path) -> None:
        self.operation, self.playbook, self.inventory, self.limit = operation, playbook, inventory, limit
        self.collector = collector
        self.artifact_dir = artifact_dir
        self._cancelled = threading.Event()
        self._runner: Any = None
        self._exception: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(kwargs,), name=f"dflash-ops-{operation}", daemon=True)
        self._thread.start()

    def _run(self, kwargs: dict[str, Any]) -> None:
        import ansible_runner

        try:
            self._runner = ansible_runner.run(cancel_callback=self._cancelled.is_set, **kwargs)
        except BaseException as exc:  # reported by wait()
            self._exception = exc

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def cancel(self) -> None:
        """Stop the playbook (ansible-playbook is terminated; a launched unit keeps running)."""
        self._cancelled.set()

    def wait(self, timeout: float | None = None) -> OpsResult | None:
        """The result once the run ends; None if ``timeout`` passed first. Ctrl-C cancels the run."""
        try:
            self._thread.join(timeout)
        except KeyboardInterrupt:
            self.cancel()
            self._thread.join()
            raise
        if self._thread.is_alive():
            return None
        return self.result()

    def result(self) -> OpsResult:
        inventory = str(self.inventory)
        if self._exception is not None:
            return self.collector.result(self.operation, self.playbook, inventory, "failed", None,
                                         str(self.artifact_dir), error=f"ansible-runner failed: {self._exception}")
        runner = self._runner
        error, bad_input = None, False
        if runner.status == "canceled":
            error = "canceled (a unit that was already launched keeps running)"
        elif not self.collector.containers:
            # No task ran on any host: explain from the inventory itself.
            hosts, warnings = inventory_containers(self.inventory, self.limit)
            if not hosts:
                error, bad_input = _no_containers(inventory, self.limit, warnings), True
            elif runner.status != "successful":
                error = _stdout_error(self.artifact_dir)
        return self.collector.result(self.operation, self.playbook, inventory, runner.status, runner.rc,
                                     str(self.artifact_dir), error=error, bad_input=bad_input)


def _no_containers(inventory: str, limit: str | None, warnings: list[str]) -> str:
    where = f" matching --limit {limit!r}" if limit else ""
    parsed = [w for w in warnings if "parse" in w.lower()]
    why = f" (ansible: {parsed[0]})" if parsed else ""
    fix = "check --limit" if limit else "name the training containers there (see inventories/local/hosts.yml)"
    return f"inventory {inventory} has no hosts in group {CONTAINER_GROUP}{where}{why}; {fix}"


def _stdout_error(artifact_dir: Path) -> str | None:
    """Ansible's own fatal error (bad inventory syntax, missing playbook): no task events carry it."""
    try:
        text = (artifact_dir / "stdout").read_text(errors="replace")
    except OSError:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("ERROR", "[ERROR]"))]
    return (errors[0] if errors else lines[-1]) if lines else None


def start(operation: str, inventory: str | os.PathLike[str], *, extravars: dict[str, Any] | None = None,
          limit: str | None = None, event_handler: EventHandler | None = None,
          keep_artifacts: int = DEFAULT_KEEP_ARTIFACTS, timeout: int | None = None) -> OpsRun:
    """Start the operation's playbook in the background; ``.wait()`` returns its :class:`OpsResult`.

    ``event_handler`` receives every runner event as it happens (live progress).
    """
    if operation not in PLAYBOOKS:
        raise BadInput(f"operation {operation!r}: choose one of {', '.join(PLAYBOOKS)}")
    root = project_dir()
    inventory_path = resolve_inventory(inventory)
    extravars = check_extravars(extravars or {})
    playbook = f"playbooks/{PLAYBOOKS[operation]}"
    private_data_dir = cache_dir() / "runner"
    ident = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S.%fZ") + f"-{operation}"
    (private_data_dir / "artifacts").mkdir(parents=True, exist_ok=True)
    collector = EventCollector()

    def handle(event: dict[str, Any]) -> bool:
        collector.add(event)
        if event_handler is not None:
            try:
                event_handler(event)
            except Exception as exc:  # a broken renderer must not lose the run
                print(f"dflash ops: progress handler failed: {exc!r}", file=sys.stderr)
        return True  # keep the event in the artifacts (job_events/)

    envvars = _ansible_env(root)
    kwargs: dict[str, Any] = {
        "private_data_dir": str(private_data_dir),
        "project_dir": str(root),
        "playbook": playbook,
        "inventory": str(inventory_path),
        "ident": ident,
        "envvars": envvars,
        "extravars": extravars,
        "quiet": True,
        "suppress_env_files": True,
        "rotate_artifacts": keep_artifacts,
        "event_handler": handle,
    }
    if limit:
        kwargs["limit"] = limit
    if timeout:
        kwargs["timeout"] = timeout
    return OpsRun(operation, playbook, inventory_path, limit, kwargs, collector, private_data_dir / "artifacts" / ident)
