"""The trainer's heartbeat while it starts: `starting` is rewritten while the run loads and prepares its data,
and never overwrites the status that follows."""

from __future__ import annotations

import json
import threading

from dflash.runtime.observability import RunObserver


def _refresh_ended(observer) -> bool:
    """This observer's refresher thread ended (other tests' trainers may still have theirs)."""
    thread = observer._starting_thread
    if thread is not None:
        thread.join(60)
    return thread is not None and not thread.is_alive()


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
    assert _refresh_ended(observer)


def test_a_disabled_observer_writes_nothing_and_starts_no_thread(tmp_path):
    observer = RunObserver(tmp_path / "run", enabled=False)
    observer.heartbeat(0, 0, "starting")
    assert not (tmp_path / "run").exists()
    assert observer._starting_thread is None


def test_close_ends_the_refresh(tmp_path, monkeypatch):
    observer = RunObserver(tmp_path)
    monkeypatch.setattr(observer, "STARTING_REFRESH_S", 0.01)
    observer.heartbeat(0, 0, "starting")
    assert observer._starting_thread.is_alive()
    observer.close()
    assert _refresh_ended(observer)
