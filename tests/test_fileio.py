"""dflash/fileio.py's atomic_file, the package's one atomic writer: its temp name, the directory's fsync, and an
out-of-space error left to a caller that handles it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from dflash.errors import DiskFull
from dflash.fileio import atomic_file


def test_a_given_temp_name_and_the_directory_synced_after_the_rename(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name),
                                                 real_fsync(fd)))
    with atomic_file(tmp_path / "latest", sync_dir=True, tmp=tmp_path / ".latest.tmp-1") as fh:
        fh.write("step-00000001\n")
    assert (tmp_path / "latest").read_text() == "step-00000001\n"
    assert synced == [".latest.tmp-1", tmp_path.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_out_of_space_is_disk_full_unless_the_caller_handles_it(tmp_path, monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(DiskFull, match="while writing f.json"), atomic_file(tmp_path / "f.json") as fh:
        fh.write("{}")
    with pytest.raises(OSError) as err, atomic_file(tmp_path / "f.json", disk_full=False) as fh:
        fh.write("{}")
    assert err.value.errno == errno.ENOSPC and not isinstance(err.value, DiskFull)
    assert list(tmp_path.iterdir()) == []  # no temp file left either way
