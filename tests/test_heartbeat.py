"""The trainer's heartbeat while it starts: `starting` is rewritten while the run loads and prepares its data,
and never overwrites the status that follows."""

from __future__ import annotations

import json
import threading

from dflash.observability import RunObserver


def _join_refreshers():
    for thread in threading.enumerate():
        if thread.name == "dflash-starting-heartbeat":
            thread.join(5)


def read(path):
    return json.loads(path.read_text())


def test_starting_is_rewritten_until_the_next_status_and_never_after(tmp_path, monkeypatch):
    observer = RunObserver(tmp_path)
    monkeypatch.setattr(observer, "STARTING_REFRESH_S", 0.01)
    written = threading.Event()
    count = {"starting": 0}
    original = observer._write_beat

    def counting(step, epoch, status, extra):
        original(step, epoch, status, extra)
        if status == "starting":
            count["starting"] += 1
            if count["starting"] >= 3:
                written.set()

    monkeypatch.setattr(observer, "_write_beat", counting)
    observer.heartbeat(0, 0, "starting")
    assert written.wait(30), "the starting heartbeat was not rewritten"
    first = read(tmp_path / "heartbeat.json")
    assert first["status"] == "starting" and first["step"] == 0

    observer.heartbeat(1, 0, "training", loss=2.0)
    after = count["starting"]
    threading.Event().wait(0.1)  # ten refresh intervals: none may follow the training beat
    assert count["starting"] == after
    beat = read(tmp_path / "heartbeat.json")
    assert beat["status"] == "training" and beat["step"] == 1 and beat["loss"] == 2.0
    _join_refreshers()
    assert not [t for t in threading.enumerate() if t.name == "dflash-starting-heartbeat"]


def test_a_disabled_observer_writes_nothing_and_starts_no_thread(tmp_path):
    observer = RunObserver(tmp_path / "run", enabled=False)
    observer.heartbeat(0, 0, "starting")
    assert not (tmp_path / "run").exists()
    assert not [t for t in threading.enumerate() if t.name == "dflash-starting-heartbeat"]


def test_close_ends_the_refresh(tmp_path, monkeypatch):
    observer = RunObserver(tmp_path)
    monkeypatch.setattr(observer, "STARTING_REFRESH_S", 0.01)
    observer.heartbeat(0, 0, "starting")
    observer.close()
    _join_refreshers()
    assert not [t for t in threading.enumerate() if t.name == "dflash-starting-heartbeat"]
