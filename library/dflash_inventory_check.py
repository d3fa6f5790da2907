#!/usr/bin/python
# Copyright: dflash authors
# Apache-2.0

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_inventory_check
short_description: Refuse inventory variables with the project's prefix that no role knows
description:
  - Every name in O(names) that starts with O(prefix) must be an option of some role (read from the
    C(ROLE/meta/argument_specs.yml) files under O(roles_dirs)) or one of O(known).
  - An unknown one fails, naming the variable, the closest known name (C(difflib)) and where the known ones are
    documented. A typo such as C(dflash_job_confg) is an error instead of a silently ignored setting.
  - With O(job_name) and O(paths), also the job's name and its paths, by the rules the unit module applies
    (module_utils/dflash_unit_spec.py) - a name of 1-64 letters, digits, C(-) or C(_); absolute paths of plain
    characters without C(..) - so that a name such as C(../../../tmp/evil) or C(x; touch /tmp/pwned) is refused here,
    in the first task of a playbook, before any file is written under it.
  - Reads files on the host it runs on; delegate it to the controller.
version_added: "0.2.0"
author: dflash authors
options:
  names:
    description: The variable names to check (for example the keys of C(hostvars[inventory_hostname])).
    type: list
    elements: str
    required: true
  roles_dirs:
    description: Directories of roles; the options of every C(ROLE/meta/argument_specs.yml) in them are known names.
    type: list
    elements: path
    required: true
  known:
    description: Further known names (registered results, variables of playbooks).
    type: list
    elements: str
    default: []
  prefix:
    description: Only names with this prefix are checked.
    type: str
    default: dflash_
  where:
    description: Where the names come from, for the message (for example the inventory host).
    type: str
    default: the inventory
  job_name:
    description: The job's name (C(dflash_job_name)), checked as the unit module checks it. Not checked when omitted.
    type: str
  paths:
    description:
      - Variable name -> path, each checked as the unit module checks the paths it writes into unit properties
        (absolute, letters, digits and C(_./+:@-), no C(..)). Empty values are skipped.
    type: dict
    default: {}
  stray:
    description:
      - What Ansible kept of words without a name in a C(-e KEY=VALUE) (the C(_raw_params) extra variable - C(-e
        "dflash_job_name=a b") sets C(dflash_job_name=a) and leaves C(b)). Refused, naming it - else a job C(a) would be
        deployed beside the inventory's and the word silently dropped.
    type: str
attributes:
  check_mode:
    support: full
    description: Only reads.
  diff_mode:
    support: none
    description: Changes nothing.
"""

EXAMPLES = r"""
- name: Refuse unknown dflash_* variables
  dflash_inventory_check:
    names: "{{ hostvars[inventory_hostname].keys() | list }}"
    roles_dirs: ["{{ playbook_dir }}/../roles"]
    where: "{{ inventory_hostname }}"
  delegate_to: localhost
"""

RETURN = r"""
invalid:
  description: One message per invalid job name or path (on failure).
  returned: always
  type: list
  elements: str
unknown:
  description: The unknown names with their closest known name (null when none is close), on failure too.
  returned: always
  type: list
  elements: dict
checked:
  description: How many names with the prefix were checked.
  returned: always
  type: int
"""

import difflib
import glob
import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.dflash_unit_spec import UnitError, check_name, check_path


def spec_files(roles_dirs):
    return sorted(f for d in roles_dirs for f in glob.glob(os.path.join(d, "*", "meta", "argument_specs.yml")))


def known_options(files):
    import yaml

    names = set()
    for path in files:
        with open(path, encoding="utf-8") as handle:
            specs = (yaml.safe_load(handle) or {}).get("argument_specs") or {}
        for entry in specs.values():
            names.update((entry or {}).get("options") or {})
    return names


def check(names, known, prefix):
    candidates = sorted(n for n in set(names) if n.startswith(prefix))
    unknown = []
    for name in candidates:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            unknown.append({"name": name, "closest": close[0] if close else None})
    return candidates, unknown


def check_job(job_name, paths):
    """The job's name and paths by the unit module's own rules: one message per invalid one."""
    problems = []
    if job_name is not None:
        try:
            check_name(job_name)
        except UnitError as exc:
            problems.append(f"dflash_job_name: {exc}")
    for variable, path in sorted((paths or {}).items()):
        if path in (None, ""):
            continue
        try:
            check_path(variable, str(path))
        except UnitError as exc:
            problems.append(str(exc))
    return problems


def main():
    module = AnsibleModule(
        argument_spec={
            "names": {"type": "list", "elements": "str", "required": True},
            "roles_dirs": {"type": "list", "elements": "path", "required": True},
            "known": {"type": "list", "elements": "str", "default": []},
            "prefix": {"type": "str", "default": "dflash_"},
            "where": {"type": "str", "default": "the inventory"},
            "job_name": {"type": "str"},
            "paths": {"type": "dict", "default": {}},
            "stray": {"type": "str"},
        },
        supports_check_mode=True,
    )
    p = module.params
    if p["stray"] is not None:
        module.fail_json(
            msg=f"-e left {p['stray']!r} without a variable name: Ansible splits -e KEY=VALUE at spaces, so -e "
            f"\"dflash_job_name=a {p['stray']}\" is dflash_job_name=a and a stray {p['stray']!r} (a job 'a' would be "
            "deployed beside the inventory's). Quote the value (-e 'KEY=\"a b\"') or give JSON (-e '{\"KEY\": \"a b\"}').",
            invalid=[], unknown=[], checked=0,
        )  # fmt: skip
    invalid = check_job(p["job_name"], p["paths"])
    if invalid:
        module.fail_json(
            msg=f"invalid job name or path on {p['where']}: " + "; ".join(invalid) + ". Root would create files and "
            "directories under them: fix the value in the inventory or -e before anything is written.",
            invalid=invalid, unknown=[], checked=0,
        )  # fmt: skip
    files = spec_files(p["roles_dirs"])
    if not files:
        module.fail_json(msg=f"no ROLE/meta/argument_specs.yml under {p['roles_dirs']}: nothing to check the variables against")
    try:
        known = known_options(files) | set(p["known"])
    except (OSError, ValueError) as exc:
        module.fail_json(msg=f"cannot read the role argument specs: {exc}")
    checked, unknown = check(p["names"], known, p["prefix"])
    if unknown:
        parts = [f"{u['name']}" + (f" (did you mean {u['closest']}?)" if u["closest"] else " (no known variable is close)")
                 for u in unknown]  # fmt: skip
        module.fail_json(
            msg=f"unknown variable(s) on {p['where']}: " + "; ".join(parts) + ". No role reads them, so they would be "
            "ignored: fix the name in the inventory or -e (the known ones are documented in roles/*/meta/argument_specs.yml "
            "and docs/operations.md).",
            unknown=unknown, invalid=[], checked=len(checked),
        )  # fmt: skip
    module.exit_json(changed=False, unknown=[], invalid=[], checked=len(checked))


if __name__ == "__main__":
    main()
