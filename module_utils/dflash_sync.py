# Copyright: dflash authors
# Apache-2.0
"""Checksummed, atomic code releases: ``DEST/releases/<hash>`` and a ``DEST/current`` symlink.

A release is identified by the sha256 of its manifest (sorted ``path``, file sha256 and
executable bit). Syncing an unchanged tree changes nothing; a changed tree is copied into
a temp directory, fsynced, renamed into place, and ``current`` is swapped with
symlink-then-rename so a reader always sees a whole release.

The source is a directory or a tar archive (read member by member: no staging directory
that two deploys could share). ``publish=False`` builds the release without swapping
``current``, so the new code can be validated before anything uses it; ``publish_release`` makes a kept
release current again (a rollback), after checking its files against its manifest.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import stat
import tarfile
import uuid

from ansible.module_utils.dflash_host import fsync_dir, read_text

MANIFEST_NAME = ".dflash-manifest.json"
RELEASE_ID_LENGTH = 16


class SyncError(Exception):
    pass


def is_excluded(relpath, patterns):
    parts = relpath.split("/")
    return any(fnmatch.fnmatch(relpath, pat) or any(fnmatch.fnmatch(part, pat) for part in parts) for pat in patterns)


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(src, exclude=()):
    """``{relpath: {"sha256", "mode"}}`` for the regular files and symlinks under ``src``."""
    if not os.path.isdir(src):
        raise SyncError(f"src {src!r} is not a directory: copy the source tree there first (ansible.builtin.copy)")
    manifest = {}
    for root, dirs, files in os.walk(src):
        rel_root = os.path.relpath(root, src)
        rel_root = "" if rel_root == "." else rel_root + "/"
        dirs[:] = sorted(d for d in dirs if not is_excluded(rel_root + d, exclude))
        for name in sorted(files):
            rel = rel_root + name
            if rel == MANIFEST_NAME or is_excluded(rel, exclude):
                continue
            full = os.path.join(root, name)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                manifest[rel] = {"sha256": "link:" + os.readlink(full), "mode": "link"}
            elif stat.S_ISREG(st.st_mode):
                manifest[rel] = {"sha256": file_sha256(full), "mode": "0755" if st.st_mode & 0o111 else "0644"}
    return manifest


def _archive_members(tar, archive, exclude=()):
    """``{relpath: TarInfo}`` of the regular files and symlinks of the open ``tar`` (refuses unsafe paths)."""
    members = {}
    for member in tar.getmembers():
        rel = os.path.normpath(member.name)
        if os.path.isabs(rel) or rel == ".." or rel.startswith("../"):
            raise SyncError(f"archive {archive}: member {member.name!r} points outside the release")
        if rel == "." or member.isdir():
            continue
        if rel == MANIFEST_NAME or is_excluded(rel, exclude):
            continue
        if not (member.isfile() or member.issym()):
            raise SyncError(f"archive {archive}: member {member.name!r} is neither a file nor a symlink")
        members[rel] = member
    return members


def build_archive_manifest(archive, exclude=()):
    """The manifest of the tree a tar archive holds, computed without unpacking it, and its members."""
    if not os.path.isfile(archive):
        raise SyncError(f"archive {archive!r} does not exist: copy the source tarball there first")
    try:
        manifest = {}
        with tarfile.open(archive) as tar:
            members = _archive_members(tar, archive, exclude)
            for rel, member in sorted(members.items()):
                if member.issym():
                    manifest[rel] = {"sha256": "link:" + member.linkname, "mode": "link"}
                    continue
                digest = hashlib.sha256()
                with tar.extractfile(member) as handle:
                    while chunk := handle.read(1 << 20):
                        digest.update(chunk)
                manifest[rel] = {"sha256": digest.hexdigest(), "mode": "0755" if member.mode & 0o111 else "0644"}
    except (tarfile.TarError, EOFError) as exc:
        raise SyncError(f"archive {archive!r} is not a readable tar file ({exc}): copy it again") from exc
    return manifest, members


def manifest_hash(manifest):
    blob = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def manifest_text(manifest):
    """One line per file, for diffs."""
    return "".join(f"{entry['sha256'][:12]} {entry['mode']} {path}\n" for path, entry in sorted(manifest.items()))


def compare(old, new):
    old, new = old or {}, new or {}
    added = sorted(set(new) - set(old))
    removed = sorted(set(old) - set(new))
    modified = sorted(p for p in set(old) & set(new) if old[p] != new[p])
    return added, removed, modified


def current_release(dest):
    """``(release_dir, manifest)`` of ``DEST/current``, or ``(None, None)``."""
    link = os.path.join(dest, "current")
    if not os.path.islink(link):
        return None, None
    return release_manifest(os.path.realpath(link))


def release_manifest(release_dir):
    """``(release_dir, manifest)`` as recorded in the release, manifest None if unreadable."""
    text = read_text(os.path.join(release_dir, MANIFEST_NAME))
    try:
        data = json.loads(text) if text else None
    except ValueError:
        data = None
    return release_dir, (data or {}).get("files")


def _copy_tree(src, dest_dir, manifest, archive=None, members=None):
    """Copy the manifest's files from ``src`` or from ``archive`` (its ``members``, as listed when the
    manifest was built)."""
    tar = tarfile.open(archive) if archive else None
    members = members or {}
    try:
        for rel, entry in sorted(manifest.items()):
            _copy_entry(src, tar, members.get(rel), rel, entry, dest_dir)
    finally:
        if tar is not None:
            tar.close()
    for root, _dirs, _files in os.walk(dest_dir, topdown=False):
        os.chmod(root, 0o755)
        fsync_dir(root)


def _copy_entry(src, tar, member, rel, entry, dest_dir):
    source = os.path.join(src, rel) if src else f"{rel} of the archive"
    target = os.path.join(dest_dir, rel)
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if entry["mode"] == "link":
        os.symlink(entry["sha256"][len("link:"):], target)
        return
    if tar is not None:
        with tar.extractfile(member) as handle, open(target, "wb") as out:
            shutil.copyfileobj(handle, out)
    else:
        shutil.copyfile(source, target, follow_symlinks=False)
    os.chmod(target, int(entry["mode"], 8))
    if file_sha256(target) != entry["sha256"]:
        raise SyncError(f"{source} changed while it was being copied: run the sync again")
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_symlink(link, target):
    """Point ``link`` at ``target`` atomically: a temp symlink renamed over the old one."""
    directory = os.path.dirname(link)
    tmp = os.path.join(directory, f".current-{uuid.uuid4().hex[:8]}")
    os.symlink(target, tmp)
    try:
        os.rename(tmp, link)
    except OSError:
        os.unlink(tmp)
        raise
    fsync_dir(directory)


def prune_releases(releases_dir, keep, protect):
    """Delete the oldest releases beyond ``keep`` (never one in ``protect``). Returns their names."""
    if keep <= 0 or not os.path.isdir(releases_dir):
        return []
    names = [n for n in os.listdir(releases_dir) if not n.startswith(".") and os.path.isdir(os.path.join(releases_dir, n))]
    names.sort(key=lambda n: os.path.getmtime(os.path.join(releases_dir, n)), reverse=True)
    removed = []
    kept = [n for n in names if n in protect]
    for name in names:
        if name in protect:
            continue
        if len(kept) < keep:
            kept.append(name)
            continue
        shutil.rmtree(os.path.join(releases_dir, name))
        removed.append(name)
    # Temp directories of an interrupted sync.
    for name in os.listdir(releases_dir):
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(releases_dir, name), ignore_errors=True)
    return removed


def release_result(dest, release_dir, current_dir, current_manifest, manifest, digest, changed, published, pending):
    """The module's result for ``release_dir`` (with ``manifest``) replacing the current release, before any pruning."""
    added, removed, modified = compare(current_manifest, manifest)
    return {
        "changed": changed,
        "published": published,
        "pending": pending,
        "release": release_dir,
        "current": os.path.join(dest, "current"),
        "previous_release": current_dir,
        "manifest_hash": digest,
        "files": len(manifest),
        "files_added": added,
        "files_removed": removed,
        "files_modified": modified,
        "pruned": [],
        "diff": {
            "before_header": current_dir or "(no release)",
            "after_header": release_dir,
            "before": manifest_text(current_manifest or {}),
            "after": manifest_text(manifest),
        },
    }


def sync(src, dest, exclude=(), keep=3, check_mode=False, archive=None, publish=True):
    """Make ``DEST/current`` a release with exactly the content of ``src`` (a directory) or ``archive``
    (a tar file); with ``publish=False`` only build that release. Returns the module result."""
    if keep < 1:
        raise SyncError(f"keep={keep}: at least the current release must be kept (keep >= 1)")
    if (src is None) == (archive is None):
        raise SyncError("give exactly one of src (a directory) and archive (a tar file)")
    members = None
    if archive:
        manifest, members = build_archive_manifest(archive, exclude)
    else:
        manifest = build_manifest(src, exclude)
    digest = manifest_hash(manifest)
    release_id = digest[:RELEASE_ID_LENGTH]
    releases_dir = os.path.join(dest, "releases")
    release_dir = os.path.join(releases_dir, release_id)
    current_dir, current_manifest = current_release(dest)
    pending = current_manifest is None or manifest_hash(current_manifest) != digest or current_dir != os.path.realpath(release_dir)
    _, existing = release_manifest(release_dir)
    built = existing is not None and manifest_hash(existing) == digest
    changed = pending if publish else pending and not built
    result = release_result(dest, release_dir, current_dir, current_manifest, manifest, digest,
                            changed=changed, published=bool(publish and pending), pending=bool(pending and not publish))
    if not changed or check_mode:
        if check_mode:
            result["published"] = False
        return result
    os.makedirs(releases_dir, mode=0o755, exist_ok=True)
    if not built:
        # Build the release beside its final place, then rename: never a half-copied release.
        tmp_dir = os.path.join(releases_dir, f".tmp-{release_id}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp_dir, mode=0o755)
        try:
            _copy_tree(src, tmp_dir, manifest, archive, members)
            with open(os.path.join(tmp_dir, MANIFEST_NAME), "w", encoding="utf-8") as handle:
                json.dump({"manifest_hash": digest, "files": manifest}, handle, sort_keys=True, indent=1)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(os.path.join(tmp_dir, MANIFEST_NAME), 0o644)
            fsync_dir(tmp_dir)
            if os.path.exists(release_dir):
                shutil.rmtree(release_dir)  # a damaged release of the same id
            os.rename(tmp_dir, release_dir)
            fsync_dir(releases_dir)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
    else:
        os.utime(release_dir)  # a rollback to a kept release: make it the newest
    if not publish:
        return result
    swap_symlink(os.path.join(dest, "current"), os.path.join("releases", release_id))
    # The release current pointed to stays too: a deploy whose new code fails to start goes back to it.
    protect = {release_id} | ({os.path.basename(current_dir)} if current_dir else set())
    result["pruned"] = prune_releases(releases_dir, keep, protect=protect)
    return result


def publish_release(dest, release, exclude=(), keep=3, check_mode=False):
    """Make ``DEST/current`` the kept release ``release`` (its id or its path under ``DEST/releases``) again: a
    rollback. Its files must still match its manifest (files matching ``exclude``, such as the interpreter's
    ``__pycache__``, do not count). Returns the module result."""
    if keep < 1:
        raise SyncError(f"keep={keep}: at least the current release must be kept (keep >= 1)")
    releases_dir = os.path.join(dest, "releases")
    release_id = os.path.basename(os.path.normpath(release))
    release_dir = os.path.join(releases_dir, release_id)
    if os.sep in release and os.path.realpath(os.path.dirname(os.path.normpath(release))) != os.path.realpath(releases_dir):
        raise SyncError(f"release {release} is not in {releases_dir}: give a release id or a directory of it")
    if release_id.startswith(".") or not os.path.isdir(release_dir):
        raise SyncError(f"release {release_id} is not kept in {releases_dir} (pruned, or never built): deploy its "
                        "sources again instead")
    _, recorded = release_manifest(release_dir)
    if recorded is None:
        raise SyncError(f"release {release_dir} has no readable manifest ({MANIFEST_NAME}): deploy its sources again")
    digest = manifest_hash(recorded)
    actual = build_manifest(release_dir, exclude)
    added, removed, modified = compare(recorded, actual)
    if digest[:RELEASE_ID_LENGTH] != release_id or added or removed or modified:
        changed_files = sorted(added + removed + modified)
        raise SyncError(f"release {release_dir} no longer matches its manifest ({len(changed_files)} file(s) differ, "
                        f"e.g. {', '.join(changed_files[:3]) or 'its id'}): deploy its sources again")
    current_dir, current_manifest = current_release(dest)
    pending = current_dir != os.path.realpath(release_dir)
    result = release_result(dest, release_dir, current_dir, current_manifest, recorded, digest,
                            changed=pending, published=bool(pending and not check_mode), pending=False)
    if not pending or check_mode:
        return result
    os.utime(release_dir)  # the newest again
    swap_symlink(os.path.join(dest, "current"), os.path.join("releases", release_id))
    protect = {release_id} | ({os.path.basename(current_dir)} if current_dir else set())
    result["pruned"] = prune_releases(releases_dir, keep, protect=protect)
    return result

