"""Live progress: render plays, tasks and per-host results as the runner reports them."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape as escape_markup

from dflash.ops.results import (
    MODULE_HEALTH,
    MODULE_UNIT,
    failure_message,
    failure_summary,
    health_diagnosis,
    module_name,
    printable,
)


def escape(text: Any) -> str:
    """``text`` for rich: its control characters escaped (results.printable), then its markup."""
    return escape_markup(printable(text))


# Tasks that only include others: their "ok" says nothing.
_INCLUDES = {"include_role", "include_tasks", "import_role", "import_tasks"}


class _RunningTask:
    """The spinner's text: the task and how long it has been running, re-rendered on every refresh."""

    def __init__(self, task: str) -> None:
        self.task, self.started = task, time.monotonic()

    def __rich__(self) -> str:
        return f"{escape(self.task)} [dim]{time.monotonic() - self.started:.0f}s[/]"


class RichProgress:
    """An ansible-runner event handler that prints to a rich console (stderr by default).

    One line per play, per task and per host result; skipped hosts are left out;
    the task running now is shown with a spinner and its elapsed time on a terminal.
    """

    def __init__(self, console: Console | None = None, show_skipped: bool = False) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self.show_skipped = show_skipped
        self._status = None
        self._task: str | None = None
        self._task_started = 0.0

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        data = event.get("event_data") or {}
        if kind == "playbook_on_play_start":
            self._print(f"[bold]PLAY[/] {escape(data.get('play') or data.get('name') or '')}")
        elif kind == "playbook_on_task_start":
            task = data.get("task") or data.get("name") or "?"
            self._task = f"{data['role']} : {task}" if data.get("role") else task
            self._task_started = time.monotonic()
            self._spin(_RunningTask(self._task))
        elif kind in ("runner_on_ok", "runner_on_failed", "runner_on_unreachable", "runner_on_skipped"):
            self._host_result(kind, data)
        elif kind == "playbook_on_stats":
            self.close()
            self._print_stats(data)

    def _host_result(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "runner_on_skipped" and not self.show_skipped:
            return
        if kind == "runner_on_ok" and module_name(data) in _INCLUDES:
            return
        host = escape(data.get("host") or "?")
        res = data.get("res") or {}
        task = escape(self._task or data.get("task") or "?")
        took = f" [dim]{time.monotonic() - self._task_started:.1f}s[/]" if self._task_started else ""
        if kind == "runner_on_unreachable":
            line = f"  [bold red]UNREACHABLE[/] {host}  {task}: {escape(str(res.get('msg') or ''))}"
        elif kind == "runner_on_failed":
            label = "[yellow]failed (ignored)[/]" if data.get("ignore_errors") else "[bold red]FAILED[/]"
            diagnosis = health_diagnosis(res) if module_name(data) == MODULE_HEALTH else None
            why = failure_summary(failure_message(res), diagnosis)
            line = f"  {label} {host}  {task}: {escape(why)}"
        elif kind == "runner_on_skipped":
            line = f"  [dim]skipped {host}  {task}[/]"
        else:
            label = "[yellow]changed[/]" if res.get("changed") else "[green]ok[/]"
            line = f"  {label} {host}  {task}{took}{escape(_module_summary(data, res))}"
        self._print(line)

    def _print_stats(self, data: dict[str, Any]) -> None:
        hosts = sorted(set().union(*(data.get(key) or {} for key in ("ok", "failures", "dark", "processed"))))
        for host in hosts:
            failed = (data.get("failures") or {}).get(host, 0)
            dark = (data.get("dark") or {}).get(host, 0)
            colour = "red" if failed or dark else "green"
            self._print(f"[{colour}]{escape(host)}[/]: ok={(data.get('ok') or {}).get(host, 0)} "
                        f"changed={(data.get('changed') or {}).get(host, 0)} failed={failed} unreachable={dark}")

    def _spin(self, running: _RunningTask) -> None:
        if not self.console.is_terminal:
            return
        if self._status is None:
            self._status = self.console.status(running)
            self._status.start()
        else:
            self._status.update(running)

    def _print(self, markup: str) -> None:
        self.console.print(markup, soft_wrap=True)

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def _module_summary(data: dict[str, Any], res: dict[str, Any]) -> str:
    """A few words from the project's modules: what the unit did, whether it trains."""
    module = module_name(data)
    if module == MODULE_UNIT and "active_state" in res:
        pid = f", pid {res['main_pid']}" if res.get("main_pid") else ""
        return f"  -> {res.get('action')} ({res.get('active_state')}/{res.get('sub_state')}{pid})"
    if module == MODULE_HEALTH and "healthy" in res:
        verdict = "finished" if res.get("finished") else ("training" if res["healthy"] else "NOT healthy")
        step = res.get("step")
        tps = res.get("tokens_per_s")
        extra = f", step {step}" if step is not None else ""
        extra += f", {tps:.0f} tok/s" if isinstance(tps, (int, float)) else ""
        return f"  -> {verdict}{extra}"
    return ""
