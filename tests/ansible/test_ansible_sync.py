"""Code sync: manifest, excludes, atomic release swap, no change on an unchanged tree, prune, rollback."""

from __future__ import annotations

import json
import os

import pytest
from ansible.module_utils.dflash_sync import (
    MANIFEST_NAME,
    SyncError,
    build_manifest,
    manifest_hash,
    publish_release,
    sync,
)


@pytest.fixture
def tree(tmp_path):
    src = tmp_path / "staging"
    (src / "dflash" / "__pycache__").mkdir(parents=True)
    (src / "dflash" / "__init__.py").write_text("")
    (src / "dflash" / "train.py").write_text("print('train')\n")
    (src / "dflash" / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\0junk")
    (src / "configs").mkdir()
    (src / "configs" / "tiny-cpu.yaml").write_text("seed: 0\n")
    (src / "bin").mkdir()
    (src / "bin" / "run").write_text("#!/bin/sh\n")
    os.chmod(src / "bin" / "run", 0o755)
    (src / "pyproject.toml").write_text("[project]\nname='x'\n")
    return src, tmp_path / "opt"


EXCLUDE = ["__pycache__", "*.pyc"]


def test_manifest_content_and_excludes(tree):
    src, _ = tree
    manifest = build_manifest(str(src), EXCLUDE)
    assert sorted(manifest) == ["bin/run", "configs/tiny-cpu.yaml", "dflash/__init__.py", "dflash/train.py", "pyproject.toml"]
    assert manifest["bin/run"]["mode"] == "0755" and manifest["pyproject.toml"]["mode"] == "0644"
    # Same content elsewhere = same hash; mtimes do not matter.
    os.utime(src / "dflash" / "train.py", (1, 1))
    assert manifest_hash(build_manifest(str(src), EXCLUDE)) == manifest_hash(manifest)


def test_first_sync_publishes_and_second_changes_nothing(tree):
    src, dest = tree
    first = sync(str(src), str(dest), EXCLUDE, keep=3)
    assert first["changed"] and first["previous_release"] is None
    assert first["files_added"] == sorted(build_manifest(str(src), EXCLUDE)) and first["files"] == 5
    current = dest / "current"
    assert current.is_symlink() and os.readlink(current) == "releases/" + first["manifest_hash"][:16]
    assert (current / "dflash" / "train.py").read_text() == "print('train')\n"
    assert not (current / "dflash" / "__pycache__").exists()
    assert os.access(current / "bin" / "run", os.X_OK)
    recorded = json.loads((current / MANIFEST_NAME).read_text())
    assert recorded["manifest_hash"] == first["manifest_hash"]
    second = sync(str(src), str(dest), EXCLUDE, keep=3)
    assert not second["changed"] and second["release"] == first["release"]
    assert (second["files_added"], second["files_removed"], second["files_modified"]) == ([], [], [])
    assert [p.name for p in (dest / "releases").iterdir()] == [first["manifest_hash"][:16]]


def test_changes_make_a_new_release_and_report_files(tree):
    src, dest = tree
    first = sync(str(src), str(dest), EXCLUDE)
    (src / "dflash" / "train.py").write_text("print('train v2')\n")
    (src / "configs" / "tiny-cpu.yaml").unlink()
    (src / "dflash" / "new.py").write_text("")
    os.chmod(src / "pyproject.toml", 0o755)
    second = sync(str(src), str(dest), EXCLUDE)
    assert second["changed"] and second["previous_release"] == first["release"]
    assert second["files_added"] == ["dflash/new.py"]
    assert second["files_removed"] == ["configs/tiny-cpu.yaml"]
    assert second["files_modified"] == ["dflash/train.py", "pyproject.toml"]
    assert (dest / "current" / "dflash" / "train.py").read_text() == "print('train v2')\n"
    # The old release is kept for rollback, untouched.
    assert (dest / "releases" / first["manifest_hash"][:16] / "dflash" / "train.py").read_text() == "print('train')\n"
    assert "-" in second["diff"]["before"] or second["diff"]["before"] != second["diff"]["after"]
    assert "dflash/new.py" in second["diff"]["after"] and "dflash/new.py" not in second["diff"]["before"]


def test_check_mode_writes_nothing(tree):
    src, dest = tree
    result = sync(str(src), str(dest), EXCLUDE, check_mode=True)
    assert result["changed"] and not dest.exists()


def test_keep_prunes_old_releases_but_never_current(tree):
    src, dest = tree
    ids = []
    for i in range(5):
        (src / "dflash" / "train.py").write_text(f"v{i}\n")
        ids.append(sync(str(src), str(dest), EXCLUDE, keep=2)["manifest_hash"][:16])
        os.utime(dest / "releases" / ids[-1], (1000 + i, 1000 + i))  # deterministic age order
    assert sorted(p.name for p in (dest / "releases").iterdir()) == sorted(ids[-2:])
    assert os.readlink(dest / "current") == "releases/" + ids[-1]


def test_rollback_reuses_a_kept_release(tree):
    src, dest = tree
    first = sync(str(src), str(dest), EXCLUDE)
    (src / "dflash" / "train.py").write_text("v2\n")
    sync(str(src), str(dest), EXCLUDE)
    (src / "dflash" / "train.py").write_text("print('train')\n")
    marker = dest / "releases" / first["manifest_hash"][:16] / "dflash" / "__init__.py"
    inode = marker.stat().st_ino
    back = sync(str(src), str(dest), EXCLUDE)
    assert back["changed"] and back["release"] == first["release"]
    assert marker.stat().st_ino == inode  # switched back, not copied again


def test_damaged_current_release_is_rebuilt(tree):
    src, dest = tree
    first = sync(str(src), str(dest), EXCLUDE)
    (dest / "current" / MANIFEST_NAME).unlink()  # e.g. an interrupted manual edit
    again = sync(str(src), str(dest), EXCLUDE)
    assert again["changed"] and (dest / "current" / MANIFEST_NAME).exists()
    assert again["release"] == first["release"]


def test_missing_src_and_bad_keep(tree, tmp_path):
    _, dest = tree
    with pytest.raises(SyncError, match="is not a directory"):
        sync(str(tmp_path / "nope"), str(dest))
    with pytest.raises(SyncError, match="keep >= 1"):
        sync(str(tree[0]), str(dest), keep=0)


def test_no_temporary_leftovers(tree):
    src, dest = tree
    sync(str(src), str(dest), EXCLUDE)
    (src / "pyproject.toml").write_text("changed\n")
    sync(str(src), str(dest), EXCLUDE)
    assert [p.name for p in dest.iterdir() if p.name.startswith(".")] == []
    assert [p.name for p in (dest / "releases").iterdir() if p.name.startswith(".")] == []


def _tarball(src, path):
    import subprocess

    subprocess.run(["tar", "--create", "--file", str(path), "--directory", str(src), "--sort=name", "--mtime=@0",
                    "--owner=0", "--group=0", "--numeric-owner", "."], check=True)
    return str(path)


def test_archive_gives_the_same_release_as_the_tree_without_a_staging_directory(tree, tmp_path):
    src, dest = tree
    archive = _tarball(src, tmp_path / "source.tar")
    from_tree = sync(str(src), str(tmp_path / "other"), EXCLUDE)
    from_archive = sync(None, str(dest), EXCLUDE, archive=archive)
    assert from_archive["changed"] and from_archive["manifest_hash"] == from_tree["manifest_hash"]
    assert os.access(dest / "current" / "bin" / "run", os.X_OK)
    assert (dest / "current" / "dflash" / "train.py").read_text() == "print('train')\n"
    assert not sync(None, str(dest), EXCLUDE, archive=archive)["changed"]


def test_publish_false_builds_the_release_and_leaves_current(tree, tmp_path):
    src, dest = tree
    first = sync(str(src), str(dest), EXCLUDE)
    (src / "dflash" / "train.py").write_text("print('train v2')\n")
    archive = _tarball(src, tmp_path / "source.tar")
    prepared = sync(None, str(dest), EXCLUDE, archive=archive, publish=False)
    assert prepared["changed"] and prepared["pending"] and not prepared["published"]
    assert os.path.realpath(dest / "current") == first["release"]  # nothing running sees the new code
    assert (dest / "current" / "dflash" / "train.py").read_text() == "print('train')\n"
    assert (tmp_path / prepared["release"] / "dflash" / "train.py").read_text() == "print('train v2')\n"
    again = sync(None, str(dest), EXCLUDE, archive=archive, publish=False)
    assert not again["changed"] and again["pending"]  # built already
    published = sync(None, str(dest), EXCLUDE, archive=archive)
    assert published["changed"] and published["published"] and os.path.realpath(dest / "current") == prepared["release"]


def test_archive_with_a_path_outside_the_tree_is_refused(tmp_path):
    import tarfile

    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo("../outside.py")
        tar.addfile(info)
    with pytest.raises(SyncError, match="points outside the release"):
        sync(None, str(tmp_path / "opt"), archive=str(archive))
    with pytest.raises(SyncError, match="does not exist: copy the source tarball there first"):
        sync(None, str(tmp_path / "opt"), archive=str(tmp_path / "missing.tar"))


def test_publish_release_makes_the_previous_release_current_again(tree):
    """A deploy's rollback: the release current pointed to before is published again, as it was built."""
    src, dest = tree
    first = sync(str(src), str(dest), EXCLUDE)
    (src / "dflash" / "train.py").write_text("v2\n")
    second = sync(str(src), str(dest), EXCLUDE)
    assert second["previous_release"] == first["release"]
    # the interpreter's byte code, written into the release by a run of it, is no change of the release
    (dest / "releases" / first["manifest_hash"][:16] / "dflash" / "__pycache__").mkdir()
    (dest / "releases" / first["manifest_hash"][:16] / "dflash" / "__pycache__" / "train.pyc").write_bytes(b"\0")
    checked = publish_release(str(dest), second["previous_release"], EXCLUDE, check_mode=True)
    assert checked["changed"] and not checked["published"]
    assert os.path.realpath(dest / "current") == second["release"]
    back = publish_release(str(dest), second["previous_release"], EXCLUDE)
    assert back["changed"] and back["published"] and back["previous_release"] == second["release"]
    assert os.readlink(dest / "current") == "releases/" + first["manifest_hash"][:16]
    assert (dest / "current" / "dflash" / "train.py").read_text() == "print('train')\n"
    assert back["files_modified"] == ["dflash/train.py"]
    again = publish_release(str(dest), first["manifest_hash"][:16], EXCLUDE)  # by id: already current
    assert not again["changed"] and not again["published"]
    assert (dest / "releases" / second["manifest_hash"][:16]).is_dir()  # the one rolled back from stays


def test_publish_release_refuses_a_missing_foreign_or_damaged_release(tree, tmp_path):
    src, dest = tree
    first = sync(str(src), str(dest), EXCLUDE)
    (src / "dflash" / "train.py").write_text("v2\n")
    sync(str(src), str(dest), EXCLUDE)
    with pytest.raises(SyncError, match=r"release 0123456789abcdef is not kept in .*releases \(pruned"):
        publish_release(str(dest), "0123456789abcdef", EXCLUDE)
    with pytest.raises(SyncError, match=r"is not in .*releases: give a release id"):
        publish_release(str(dest), str(tmp_path / "elsewhere" / first["manifest_hash"][:16]), EXCLUDE)
    (dest / "releases" / first["manifest_hash"][:16] / "dflash" / "train.py").write_text("tampered\n")
    with pytest.raises(SyncError, match=r"no longer matches its manifest \(1 file\(s\) differ, e.g. dflash/train.py\)"):
        publish_release(str(dest), first["release"], EXCLUDE)
    assert os.path.realpath(dest / "current") != first["release"]  # current left alone


def test_publish_keeps_the_release_it_replaces_even_beyond_keep(tree, tmp_path):
    """Releases built but rejected by validation are newer than the running one; publishing a new release must not
    prune the running one (the rollback target of this deploy)."""
    src, dest = tree
    running = sync(str(src), str(dest), EXCLUDE, keep=2)
    os.utime(running["release"], (1000, 1000))
    for i, version in enumerate(("rejected 1", "rejected 2")):
        (src / "dflash" / "train.py").write_text(version + "\n")
        built = sync(str(src), str(dest), EXCLUDE, keep=2, publish=False)
        os.utime(built["release"], (2000 + i, 2000 + i))
    (src / "dflash" / "train.py").write_text("new\n")
    new = sync(str(src), str(dest), EXCLUDE, keep=2)
    kept = sorted(p.name for p in (dest / "releases").iterdir())
    assert kept == sorted([running["manifest_hash"][:16], new["manifest_hash"][:16]])
    publish_release(str(dest), new["previous_release"], EXCLUDE, keep=2)
    assert os.path.realpath(dest / "current") == running["release"]
