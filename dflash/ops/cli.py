"""`dflash ops train|deploy|status|stop|logs -i INVENTORY [-e key=value ...] [--json] [--quiet]`.

Exit codes: 0 ok, 1 failed (a task failed, a host was unreachable), 2 bad input
(an inventory that does not exist, a malformed -e).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape as escape_markup
from rich.table import Table

from dflash.errors import BadInput
from dflash.ops import api
from dflash.ops.results import (
    CRASHED,
    DRIVER_MISMATCH,
    FAILED,
    FAILED_TO_START,
    FINISHED,
    HUNG,
    LOST,
    OK_STATES,
    STARTING,
    TRAINING,
    UNHEALTHY,
    UNREACHABLE,
    ContainerStatus,
    OpsResult,
    printable,
    report_lines,
)

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT = 0, 1, 2


def escape(text: Any) -> str:
    """``text`` for rich: its control characters escaped (results.printable), then its markup."""
    return escape_markup(printable(text))

_HELP = {
    "train": "provision the containers, launch the trainer, prove it trains (playbooks/train.yml)",
    "deploy": "deploy and (re)start the job in provisioned containers, prove it trains (playbooks/deploy.yml)",
    "status": "unit state, pid, step, tokens/s, tau, real acceptance length, GPU memory and log tail of every job",
    "stop": "stop every job (SIGTERM, checkpoint; SIGKILL after the timeout) and wait for its GPUs",
    "logs": "the last lines of every job's log; --follow keeps reading",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash ops", description="Drive the dflash playbooks through ansible-runner.")
    sub = p.add_subparsers(dest="operation", required=True)
    for name, text in _HELP.items():
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("-i", "--inventory", required=True, help="inventory file or directory, e.g. inventories/local")
        s.add_argument("-e", "--extra-vars", action="append", default=[], metavar="KEY=VALUE",
                       help="extra variable (VALUE is YAML: 3, true, [0, 1], {a: 1}); also a YAML/JSON mapping "
                            "or @FILE, as ansible-playbook takes them; repeatable")
        s.add_argument("-l", "--limit", help="only these hosts (an Ansible host pattern)")
        s.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
        s.add_argument("-q", "--quiet", action="store_true", help="no live progress")
        if name == "status":
            s.add_argument("--require-training", action="store_true",
                           help="exit 1 unless every job is training (or finished), also when one is starting or "
                                "stopped; without it, status exits 1 only for a hung, crashed, failed-to-start, lost or driver-mismatch job")
        if name == "logs":
            s.add_argument("-n", "--lines", type=int, default=40, help="lines per job (default 40)")
            s.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C")
            s.add_argument("--interval", type=float, default=5.0, help="seconds between reads with --follow")
    return p


def parse_extravars(items: list[str]) -> dict[str, Any]:
    """`-e` values the way ansible-playbook takes them: KEY=VALUE, a YAML/JSON mapping, or @FILE."""
    out: dict[str, Any] = {}
    for item in items:
        if item.startswith("@"):
            path = Path(item[1:]).expanduser()
            try:
                data = yaml.safe_load(path.read_text())
            except OSError as exc:
                raise BadInput(f"-e {item}: cannot read {path}: {exc.strerror}") from exc
            except yaml.YAMLError as exc:
                raise BadInput(f"-e {item}: {path} is not valid YAML/JSON: {exc}") from exc
            if not isinstance(data, dict):
                raise BadInput(f"-e {item}: {path} must hold a mapping of variable names to values")
            out.update(data)
        elif item.lstrip().startswith("{"):
            try:
                data = yaml.safe_load(item)
            except yaml.YAMLError as exc:
                raise BadInput(f"-e {item!r}: not a valid YAML/JSON mapping: {exc}") from exc
            out.update(data)
        else:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise BadInput(f"-e {item!r}: expected KEY=VALUE (e.g. -e dflash_job_state=restarted), "
                               f"a mapping ('{{\"key\": 1}}') or @FILE")
            try:
                out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
            except yaml.YAMLError as exc:
                raise BadInput(f"-e {item!r}: the value is not valid YAML ({exc.problem}); quote it") from exc
    for key in out:
        if not isinstance(key, str) or not key.isidentifier():
            raise BadInput(f"-e: {key!r} is not a valid variable name (letters, digits, underscores)")
    return out


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec and isinstance(value, (int, float)) else str(value)


_STATE_STYLE = {TRAINING: "green", FINISHED: "green", STARTING: "yellow", UNHEALTHY: "yellow", HUNG: "red", CRASHED: "red",
                FAILED_TO_START: "red", FAILED: "red", UNREACHABLE: "red", LOST: "red", DRIVER_MISMATCH: "red"}


def render(result: OpsResult, console: Console, show_logs: bool) -> None:
    """The result for a human: one row per container, then log tails and failure diagnoses."""
    if result.containers:
        table = Table(title=f"dflash ops {result.operation}: {escape(result.inventory)}", title_justify="left")
        # Names and states stay whole on a narrow terminal; the other columns wrap.
        table.add_column("container", no_wrap=True, min_width=max(len(h) for h in result.containers))
        table.add_column("state", no_wrap=True, min_width=15)
        table.add_column("unit", overflow="fold")
        for column in ("pid", "exit", "step", "tok/s", "tau", "accept"):  # tau: simulated; accept: real
            table.add_column(column, justify="right")
        table.add_column("GPU MiB", overflow="fold")
        for c in result.containers.values():
            style = _STATE_STYLE.get(c.state, "")
            unit = f"{c.unit_state}/{c.sub_state}" if c.unit_state else "-"
            if c.action and c.action != "none":
                unit += f" ({c.action})"
            table.add_row(escape(c.host), f"[{style}]{c.state}[/]" if style else c.state, escape(unit), _fmt(c.pid),
                          _fmt(c.exit_status), _fmt(c.step), _fmt(c.tokens_per_s, ".0f"), _fmt(c.tau, ".3f"),
                          _fmt(c.acceptance_length, ".2f"), escape(_gpu_memory(c)))
        console.print(table)
    for job in result.jobs:  # a multi-node job across its containers
        style = _STATE_STYLE.get(job.state, "")
        console.print(f"[{style}]{escape(job.describe())}[/]" if style else escape(job.describe()), soft_wrap=True)
    if result.operation == "status":  # status.yml's report lines of each job (results.report_lines)
        for c in result.containers.values():
            if c.health_state:
                for line in report_lines(c):
                    console.print(escape(line), soft_wrap=True)
    for c in result.containers.values():
        # One diagnosis per job, printed once: it holds the log tail already.
        diagnosis = (c.failure.diagnosis if c.failure else None) or (c.diagnosis if c.state not in OK_STATES else None)
        if diagnosis:
            console.print(f"[bold red]{escape(c.host)}[/] health diagnosis:")
            console.print(escape(diagnosis), soft_wrap=True)
        elif show_logs and c.log_tail:
            console.print(f"[bold]{escape(c.host)}[/] log{(' ' + escape(c.log_path)) if c.log_path else ''}:")
            for line in c.log_tail:
                console.print(f"  | {escape(line)}", soft_wrap=True)


def _gpu_memory(c: ContainerStatus) -> str:
    if not c.gpus:
        return "-"
    return " ".join(f"{g.index}:{_fmt(g.used_mib)}/{_fmt(g.total_mib)}" for g in c.gpus)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Piped output is not cut to 80 columns.
    out = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)
    try:
        extravars = parse_extravars(args.extra_vars)
        progress = not args.quiet
        if args.operation == "logs":
            result = _logs(args, extravars, progress)
        else:
            result = api.run(args.operation, args.inventory, extravars=extravars, limit=args.limit, progress=progress)
    except BadInput as exc:
        err.print(f"dflash ops: error: {escape(str(exc))}", soft_wrap=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        err.print("dflash ops: canceled")
        return EXIT_FAILURE
    # `logs` printed its lines as `host | line` (or JSON lines with --follow --json) already.
    lines_only = args.operation == "logs"
    if args.json and not (lines_only and args.follow):
        print(json.dumps(result.to_dict(), indent=2, default=str))
    elif not args.json and not lines_only:
        render(result, out, show_logs=args.operation == "status")
    idle = [c for c in result.containers.values() if c.state not in (TRAINING, FINISHED)]
    if result.ok and getattr(args, "require_training", False) and idle:
        err.print("dflash ops: error: not training: " + escape(", ".join(f"{c.host} is {c.state}" for c in idle)),
                  soft_wrap=True)
        return EXIT_FAILURE
    if result.ok:
        if not args.json and not lines_only:
            out.print(escape(result.message), soft_wrap=True)
        return EXIT_OK
    err.print(f"dflash ops: error: {escape(result.message)}", soft_wrap=True)
    if result.artifact_dir and not args.json:
        err.print(f"dflash ops: events and output of the run: {escape(result.artifact_dir)}", soft_wrap=True)
    return EXIT_BAD_INPUT if result.bad_input else EXIT_FAILURE


def _logs(args: argparse.Namespace, extravars: dict[str, Any], progress: bool) -> OpsResult:
    """Print `host | line` per log line (pipe-friendly), JSON lines with --follow --json."""

    def emit(host: str, lines: list[str]) -> None:
        for line in lines:
            print(json.dumps({"host": host, "line": line}) if args.json else printable(f"{host} | {line}"), flush=True)

    if args.follow:
        return api.logs(args.inventory, args.lines, follow=True, limit=args.limit, progress=progress, on_lines=emit,
                        interval=args.interval, extravars=extravars)
    result = api.logs(args.inventory, args.lines, limit=args.limit, progress=progress, extravars=extravars)
    if not args.json:
        for host, container in result.containers.items():
            emit(host, container.log_tail)
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
