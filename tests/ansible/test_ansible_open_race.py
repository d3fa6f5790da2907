"""Root's open of a trainer's file holds when the trainer swaps a checked path for a link between root's check
and root's open (a race a check alone loses): `open_nofollow` stats each component, then opens it with
O_NOFOLLOW, so a link planted in between is refused, never followed. Each test plants the link exactly there."""

from __future__ import annotations

import os

import pytest
from ansible.module_utils import dflash_host
from ansible.module_utils.dflash_host import UnsafeFile, open_nofollow

SECRET = b'{"step": 424242, "status": "root only"}\n'


@pytest.fixture
def tree(tmp_path):
    secret_dir = tmp_path / "root-only"
    secret_dir.mkdir(mode=0o700)
    (secret_dir / "heartbeat.json").write_bytes(SECRET)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "heartbeat.json").write_text('{"step": 1}\n')
    (run / "checkpoints" / "latest").write_text("step-00000001\n")
    return run, secret_dir


def _swap_after_stat(monkeypatch, name, swap):
    """Run `swap` right after root's stat of the path component `name`, before root opens it."""
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        result = real_stat(path, *args, **kwargs)
        if path == name and not swap.done:
            swap.done = True
            swap()
        return result

    swap.done = False
    monkeypatch.setattr(dflash_host.os, "stat", stat)


def test_a_file_swapped_for_a_link_after_the_check_is_refused(tree, monkeypatch):
    run, secret_dir = tree

    def swap():
        os.unlink(run / "heartbeat.json")
        os.symlink(secret_dir / "heartbeat.json", run / "heartbeat.json")

    _swap_after_stat(monkeypatch, "heartbeat.json", swap)
    with pytest.raises(UnsafeFile, match="symbolic link"):
        fd = open_nofollow(str(run / "heartbeat.json"))
        os.close(fd)
    assert swap.done


def test_a_directory_swapped_for_a_link_after_the_check_is_refused(tree, monkeypatch):
    run, secret_dir = tree
    os.rename(secret_dir / "heartbeat.json", secret_dir / "latest")

    def swap():
        os.rename(run / "checkpoints", run / "checkpoints.old")
        os.symlink(secret_dir, run / "checkpoints")

    _swap_after_stat(monkeypatch, "checkpoints", swap)
    # O_DIRECTORY | O_NOFOLLOW on a link fails with ENOTDIR: read as missing, nothing read through the link
    with pytest.raises((UnsafeFile, NotADirectoryError)):
        fd = open_nofollow(str(run / "checkpoints" / "latest"))
        os.close(fd)
    assert swap.done


def test_without_a_swap_the_file_is_read(tree):
    """The control: the same open, nothing planted, reads the trainer's file."""
    run, _ = tree
    fd = open_nofollow(str(run / "heartbeat.json"))
    try:
        assert os.read(fd, 100) == b'{"step": 1}\n'
    finally:
        os.close(fd)
