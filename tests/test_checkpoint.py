"""Atomic checkpoints, keep-last-N, corruption fallback."""

import logging

import pytest

from dflash.components.checkpoint import CheckpointManager


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


class Counter:
    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_the_manager_saves_and_restores_the_parts_it_is_given(tmp_path):
    import torch

    a, b, train = Counter(3), Counter(5), Counter(7)
    m = CheckpointManager(tmp_path, states={"a": a, "b": b}, train_state=train)
    path = m.save_state(2)
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    assert state == {"value": 7, "a": {"value": 3}, "b": {"value": 5}}  # the train state's keys at the top
    a.value = b.value = train.value = 0
    m.load_state(path)
    assert (a.value, b.value, train.value) == (3, 5, 7)


def test_a_checkpoint_without_a_part_is_refused_naming_it(tmp_path):
    from dflash.errors import BadInput

    path = CheckpointManager(tmp_path, states={"a": Counter(1)}).save_state(1)
    with pytest.raises(BadInput, match="holds no sampler state"):
        CheckpointManager(tmp_path, states={"a": Counter(), "sampler": Counter()}).load_state(path)


def _complete_copy(src, dst):
    import shutil

    shutil.copytree(src, dst)


@pytest.mark.parametrize("stray", ["step-latest", "step-backup"])
def test_only_step_directories_with_eight_digits_are_checkpoints(tmp_path, caplog, stray):
    m = CheckpointManager(tmp_path, keep_last=2)
    m.save(1, write_payload("1"))
    # A complete, intact-looking copy under another name: never resumed from, never pruned.
    _complete_copy(tmp_path / "step-00000001", tmp_path / stray)
    assert CheckpointManager.verify(tmp_path / stray) is None
    with caplog.at_level(logging.WARNING):
        assert m.latest_valid().name == "step-00000001"
        for step in (2, 3, 4):
            m.save(step, write_payload(str(step)))
        assert [p.name for p in m.list()] == ["step-00000003", "step-00000004"]
        assert m.latest_valid().name == "step-00000004"
        m.recover()
    assert (tmp_path / stray).is_dir() and CheckpointManager.verify(tmp_path / stray) is None
    warnings = [r.getMessage() for r in caplog.records if stray in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "not a checkpoint" in warnings[0] and "step-NNNNNNNN" in warnings[0]


def test_a_stray_directory_alone_is_no_checkpoint_to_resume(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=2)
    m.save(1, write_payload("1"))
    (tmp_path / "step-00000001").rename(tmp_path / "step-1")  # wrong width: not a checkpoint either
    assert m.list() == [] and m.latest_valid() is None
