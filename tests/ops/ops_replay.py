"""Replay the real event streams recorded by record_events.py (tests/ops/events/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash.ops.results import EventCollector, OpsResult

EVENTS = Path(__file__).resolve().parent / "events"
INVENTORY = Path(__file__).resolve().parent / "inventory"


def load(name: str) -> dict[str, Any]:
    return json.loads((EVENTS / f"{name}.json").read_text())


def replay(name: str, handler=None) -> OpsResult:
    """The OpsResult dflash.ops builds from a recorded run (events fed in order, as the runner does)."""
    doc = load(name)
    collector = EventCollector()
    for event in doc["events"]:
        collector(event)
        if handler is not None:
            handler(event)
    playbook = f"playbooks/{doc['operation']}.yml"
    return collector.result(doc["operation"], playbook, str(INVENTORY), doc["runner"]["status"], doc["runner"]["rc"])
