"""Atomic checkpoints, keep-last-N, corruption fallback."""

import logging

import pytest

from dflash.checkpoint import CheckpointManager


def write_payload(text):
    def write(tmp):
        (tmp / "model.safetensors").write_text(text)
        (tmp / "trainer_state.pt").write_text(text * 2)
    return write


def test_keep_last_and_latest_pointer(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        m.save(step, write_payload(str(step)))
    assert [p.name for p in m.list()] == ["step-00000002", "step-00000003"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"
    assert m.latest_valid().name == "step-00000003"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_failed_write_leaves_nothing_half_written(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=2)
    m.save(1, write_payload("1"))

    def boom(tmp):
        (tmp / "model.safetensors").write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError):
        m.save(2, boom)
    assert [p.name for p in tmp_path.iterdir() if p.name != "latest"] == ["step-00000001"]
    assert m.latest_valid().name == "step-00000001"


def test_corrupt_latest_falls_back_with_warning(tmp_path, caplog):
    m = CheckpointManager(tmp_path, keep_last=3)
    m.save(1, write_payload("1"))
    m.save(2, write_payload("2"))
    (tmp_path / "step-00000002" / "model.safetensors").write_text("bitrot")
    with caplog.at_level(logging.WARNING):
        assert m.latest_valid().name == "step-00000001"
    assert "checksum mismatch" in caplog.text
    (tmp_path / "step-00000001" / "manifest.json").unlink()  # a partial copy: no manifest
    assert m.latest_valid() is None
