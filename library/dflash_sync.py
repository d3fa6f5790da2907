#!/usr/bin/python
# Copyright: dflash authors
# Apache-2.0

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_sync
short_description: Publish a source tree as a checksummed, atomically swapped release
description:
  - Computes a sha256 manifest (path, content hash, executable bit) of O(src), a directory on the managed host,
    or of O(archive), a tar file on the managed host read member by member (no staging directory).
  - If the manifest equals the one of the release that C(DEST/current) points to, nothing changes.
  - Otherwise the tree is copied into C(DEST/releases/.tmp-*), every file and directory is fsynced, the directory is
    renamed to C(DEST/releases/<first 16 hex digits of the manifest hash>), and C(DEST/current) is swapped
    atomically (a temp symlink renamed over the old one). A kept release with the same hash is reused (rollback).
  - Old releases beyond O(keep) are deleted, never the current one nor the one C(current) pointed to before (the
    rollback target of a deploy whose new code fails to start).
  - With O(publish=false) the release is built but C(DEST/current) is left alone (RV(pending) says a publish is
    due), so the new code can be validated first; a second call with O(publish=true) swaps C(current).
  - With O(release) a kept release is made C(current) again (a rollback), after its files were checked against its
    manifest (O(exclude) applies, so the interpreter's C(__pycache__) does not count).
version_added: "0.1.0"
author: dflash authors
options:
  src:
    description: Directory on the managed host holding the tree to publish. Exactly one of O(src), O(archive) and
      O(release).
    type: path
  archive:
    description: Tar archive on the managed host holding the tree to publish (as made by GNU tar, uncompressed or
      compressed). Only regular files and symlinks inside the tree are accepted.
    type: path
  release:
    description: A kept release to make C(current) again - its id (C(3f9c0a6b1d2e4f50)) or its directory under
      C(DEST/releases) (as RV(previous_release) returns it).
    type: str
  publish:
    description: Swap C(DEST/current) to the release. V(false) only builds it (not with O(release)).
    type: bool
    default: true
  dest:
    description: Releases root; the module manages C(DEST/releases/) and the C(DEST/current) symlink.
    type: path
    required: true
  exclude:
    description:
      - Glob patterns left out of the manifest and the release. A pattern matches the relative path or any one of its
        components, so V(__pycache__) excludes every such directory.
    type: list
    elements: str
    default: ["__pycache__", "*.pyc", ".git"]
  keep:
    description: Number of releases to keep, the current one included.
    type: int
    default: 3
attributes:
  check_mode:
    support: full
    description: Computes the manifest and reports what would change without writing.
  diff_mode:
    support: full
    description: The before/after manifests (one line per file with its short hash).
notes:
  - The release is read-only by convention; point C(PYTHONPATH) (or the working directory) at C(DEST/current).
"""

EXAMPLES = r"""
- name: Stage the trainer sources
  ansible.builtin.copy:
    src: "{{ playbook_dir }}/../dflash"
    dest: /opt/dflash/staging/
    mode: preserve

- name: Publish them as a release
  dflash_sync:
    src: /opt/dflash/staging
    dest: /opt/dflash
    exclude: ["__pycache__", "*.pyc"]
    keep: 3
  register: dflash_code

- name: Build the release of a source tarball without using it yet
  dflash_sync:
    archive: /opt/dflash/archives/source.tar
    dest: /opt/dflash
    publish: false
  register: dflash_code

- name: Publish it once it has been validated
  dflash_sync:
    archive: /opt/dflash/archives/source.tar
    dest: /opt/dflash
  when: dflash_code.pending
"""

RETURN = r"""
changed:
  description: Whether C(current) now points at a different release (with O(publish=false) - whether a new release
    directory was built).
  returned: always
  type: bool
release:
  description: The release directory for O(src)'s content (null in check mode when O(src) does not exist yet).
  returned: always
  type: str
  sample: /opt/dflash/releases/3f9c0a6b1d2e4f50
current:
  description: The C(current) symlink.
  returned: always
  type: str
  sample: /opt/dflash/current
previous_release:
  description: Where C(current) pointed before, or null.
  returned: always
  type: str
manifest_hash:
  description: sha256 of the manifest of O(src).
  returned: always
  type: str
published:
  description: C(current) was swapped to RV(release) by this call.
  returned: always
  type: bool
pending:
  description: With O(publish=false), RV(release) differs from C(current) (a publish is due).
  returned: always
  type: bool
files:
  description: Number of files in the release.
  returned: always
  type: int
files_added:
  description: Paths new relative to the previous release.
  returned: always
  type: list
  elements: str
files_removed:
  description: Paths gone relative to the previous release.
  returned: always
  type: list
  elements: str
files_modified:
  description: Paths whose content or mode changed.
  returned: always
  type: list
  elements: str
pruned:
  description: Release ids deleted because of O(keep).
  returned: always
  type: list
  elements: str
"""

import os
import traceback

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.dflash_sync import SyncError, publish_release, sync


def main():
    module = AnsibleModule(
        argument_spec={
            "src": {"type": "path"},
            "archive": {"type": "path"},
            "release": {"type": "str"},
            "publish": {"type": "bool", "default": True},
            "dest": {"type": "path", "required": True},
            "exclude": {"type": "list", "elements": "str", "default": ["__pycache__", "*.pyc", ".git"]},
            "keep": {"type": "int", "default": 3},
        },
        mutually_exclusive=[("src", "archive", "release")],
        required_one_of=[("src", "archive", "release")],
        supports_check_mode=True,
    )
    p = module.params
    if p["release"] is not None:
        if not p["publish"]:
            module.fail_json(msg="release makes a kept release current: publish=false has no meaning with it")
        try:
            result = publish_release(p["dest"], p["release"], exclude=p["exclude"], keep=p["keep"],
                                     check_mode=module.check_mode)
        except SyncError as exc:
            module.fail_json(msg=str(exc))
        except OSError as exc:
            module.fail_json(msg=f"publishing release {p['release']} in {p['dest']} failed: {exc}",
                             exception=traceback.format_exc())
        diff = result.pop("diff")
        if module._diff and result["changed"]:
            result["diff"] = diff
        module.exit_json(**result)
    source = p["src"] or p["archive"]
    if module.check_mode and not os.path.exists(source):
        # A first run in check mode: the copy into src was only simulated.
        module.warn(f"{source} does not exist (check mode: assuming an earlier task creates it)")
        module.exit_json(changed=True, published=False, pending=True, release=None, current=os.path.join(p["dest"], "current"),
                         previous_release=None, manifest_hash=None, files=0, files_added=[], files_removed=[], files_modified=[],
                         pruned=[])  # fmt: skip
    try:
        result = sync(p["src"], p["dest"], exclude=p["exclude"], keep=p["keep"], check_mode=module.check_mode,
                      archive=p["archive"], publish=p["publish"])  # fmt: skip
    except SyncError as exc:
        module.fail_json(msg=str(exc))
    except OSError as exc:
        module.fail_json(msg=f"sync of {p['src']} into {p['dest']} failed: {exc}", exception=traceback.format_exc())
    diff = result.pop("diff")
    if module._diff and result["changed"]:
        result["diff"] = diff
    module.exit_json(**result)


if __name__ == "__main__":
    main()
