"""Run the project's playbooks with ansible-runner and fold their events into results.

Every run gets its own artifact directory `CACHE/runner/artifacts/<utc time>-<operation>`
(`CACHE` = `$DFLASH_CACHE_DIR`, else `$XDG_CACHE_HOME/dflash`, else `~/.cache/dflash`);
ansible-runner keeps the newest `keep_artifacts` of them. The project directory (playbooks,
roles, library, module_utils and the `ansible.cfg` that names them) is the one shipped in the
installed package (`dflash/ops/project/`), else the checkout this package runs from, or the one
named by `$DFLASH_PROJECT_DIR`.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from dflash.errors import BadInput
from dflash.ops.results import EventCollector, OpsResult

PLAYBOOKS = {"train": "train.yml", "deploy": "deploy.yml", "status": "status.yml", "stop": "stop.yml",
             "logs": "logs.yml"}
DEFAULT_KEEP_ARTIFACTS = 20
CONTAINER_GROUP = "dflash_containers"
# Where the wheel carries the Ansible half (setup.py copies it there at build time).
PACKAGED_PROJECT = "project"

EventHandler = Callable[[dict[str, Any]], Any]


def _is_project(root: Path) -> bool:
    return (root / "playbooks").is_dir() and (root / "ansible.cfg").is_file()


def project_dir() -> Path:
    """The directory whose `playbooks/` and `ansible.cfg` the operations run."""
    configured = os.environ.get("DFLASH_PROJECT_DIR")
    if configured:
        if not _is_project(Path(configured)):
            raise BadInput(f"DFLASH_PROJECT_DIR={configured} holds no playbooks/ and ansible.cfg: point it at a dflash "
                           f"checkout, or unset it to use the playbooks of the installed package")
        return Path(configured)
    packaged = Path(str(resources.files("dflash.ops") / PACKAGED_PROJECT))
    checkout = Path(__file__).resolve().parents[2]
    for root in (packaged, checkout):
        if _is_project(root):
            return root
    raise BadInput(f"no playbooks found: neither the installed package ({packaged}) nor a checkout ({checkout}) holds "
                   f"playbooks/ and ansible.cfg; reinstall dflash-trainer[ops] from a wheel built from the repository, "
                   f"or set DFLASH_PROJECT_DIR to a dflash checkout")


def source_tree(root: Path, into: Path) -> Path | None:
    """What a deploy syncs into the containers (`dflash/` without `dflash/ops`, `configs/`, `pyproject.toml`),
    gathered into ``into`` when ``root`` is the installed package's project (it has no `dflash/` beside it);
    None for a checkout, whose own tree the job role packs."""
    if (root / "dflash").is_dir():
        return None
    package = Path(__file__).resolve().parents[1]
    shutil.copytree(package, into / "dflash", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "ops"))
    shutil.copytree(root / "configs", into / "configs")
    shutil.copy2(root / "pyproject.toml", into / "pyproject.toml")
    return into


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
        "PATH": _ansible_path(),
        "ANSIBLE_NOCOLOR": "1",
    }


def _ansible_path() -> str:
    """PATH with the ansible of this interpreter's environment first, even when it is not activated."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def inventory_containers(inventory: Path) -> tuple[list[str], list[str]]:
    """The hosts of group dflash_containers and ansible's warnings about the inventory (ansible-runner's
    get_inventory, i.e. `ansible-inventory --list`)."""
    import ansible_runner

    root = project_dir()
    if not shutil.which("ansible-inventory", path=_ansible_path()):
        return [], [f"ansible-inventory is not installed next to {sys.executable}: pip install 'dflash-trainer[ops]'"]
    # get_inventory looks the command up in this process's PATH.
    os.environ["PATH"] = _ansible_path()
    try:
        # Its own private data dir, few artifacts kept: without one, ansible-runner leaves a temp dir behind.
        groups, errors = ansible_runner.get_inventory("list", [str(inventory)], response_format="json", quiet=True,
                                                      envvars=_ansible_env(root), timeout=120,
                                                      private_data_dir=str(cache_dir() / "inventory"), rotate_artifacts=2)
    except Exception as exc:  # noqa: BLE001 - the explanation of a failed run must not fail itself
        return [], [f"ansible-inventory failed: {exc}"]
    warnings = [line.split(":", 1)[1].strip() for line in (errors or "").splitlines()
                if line.startswith(("[WARNING]:", "[ERROR]:", "ERROR!"))]
    if not isinstance(groups, dict):
        return [], warnings or [(errors or "").strip() or "ansible-inventory printed no inventory"]

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
    """One playbook run in progress (see :func:`start`): ansible-runner's ``run_async`` thread and Runner."""

    def __init__(self, operation: str, playbook: str, inventory: Path, limit: str | None, kwargs: dict[str, Any],
                 collector: EventCollector, artifact_dir: Path) -> None:
        import ansible_runner

        self.operation, self.playbook, self.inventory, self.limit = operation, playbook, inventory, limit
        self.collector = collector
        self.artifact_dir = artifact_dir
        self._cancelled = False
        self._thread: Any = None
        self._runner: Any = None
        self._exception: BaseException | None = None
        try:
            self._thread, self._runner = ansible_runner.run_async(cancel_callback=lambda: self._cancelled, **kwargs)
        except Exception as exc:  # a configuration ansible-runner refuses: reported by wait()
            self._exception = exc

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def cancel(self) -> None:
        """Stop the playbook (ansible-playbook is terminated; a launched unit keeps running)."""
        self._cancelled = True

    def wait(self, timeout: float | None = None) -> OpsResult | None:
        """The result once the run ends; None if ``timeout`` passed first. Ctrl-C cancels the run."""
        if self._thread is not None:
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
        runner = self._runner
        if self._exception is not None or runner is None or runner.status in ("unstarted", "starting", "running"):
            why = self._exception or "it ended without a final status (see the run's artifacts)"
            return self.collector.result(self.operation, self.playbook, inventory, "failed", None,
                                         str(self.artifact_dir), error=f"ansible-runner failed: {why}")
        error, bad_input = None, False
        if runner.status == "canceled":
            error = "canceled (a unit that was already launched keeps running)"
        elif not self.collector.containers:
            # No task ran on any host: explain from the inventory itself.
            hosts, warnings = inventory_containers(self.inventory)
            error = _stdout_error(self.artifact_dir) if runner.status != "successful" else None
            unmatched = bool(self.limit) and (self.collector.no_hosts_matched or "no hosts" in (error or ""))
            if not hosts or unmatched:
                error, bad_input = _no_containers(inventory, self.limit, hosts, warnings), True
        return self.collector.result(self.operation, self.playbook, inventory, runner.status, runner.rc,
                                     str(self.artifact_dir), error=error, bad_input=bad_input)


def _no_containers(inventory: str, limit: str | None, hosts: list[str], warnings: list[str]) -> str:
    if hosts and limit:
        return (f"inventory {inventory} has no hosts in group {CONTAINER_GROUP} matching --limit {limit!r} "
                f"(its hosts: {', '.join(hosts)}); check --limit")
    parsed = [w for w in warnings if "parse" in w.lower()]
    why = f" (ansible: {parsed[0]})" if parsed else ""
    return (f"inventory {inventory} has no hosts in group {CONTAINER_GROUP}{why}; name the training containers "
            f"there (see inventories/local/hosts.yml)")


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

    if operation in ("train", "deploy") and "dflash_job_source_dir" not in extravars:
        source = source_tree(root, private_data_dir / "sources" / ident)
        if source is not None:
            extravars["dflash_job_source_dir"] = str(source)
            for old in sorted((private_data_dir / "sources").iterdir())[:-keep_artifacts] if keep_artifacts else []:
                shutil.rmtree(old, ignore_errors=True)
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
