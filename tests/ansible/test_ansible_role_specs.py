"""Each role variable has one documented default: meta/argument_specs.yml agrees with defaults/main.yml, an
option another entry point shares with main has main's type and default (a YAML alias of it), and the module defaults the job
role restates are the modules' constants."""

from __future__ import annotations

import pytest
import yaml
from ansible.module_utils.dflash_unit import GPU_RELEASE_THRESHOLD_MIB, GPU_RELEASE_TIMEOUT
from conftest import ROOT

ROLES = sorted(p.parent.parent.name for p in (ROOT / "roles").glob("*/meta/argument_specs.yml"))


def _load(role):
    specs = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    defaults_path = ROOT / "roles" / role / "defaults" / "main.yml"
    defaults = (yaml.safe_load(defaults_path.read_text()) or {}) if defaults_path.exists() else {}
    return specs, defaults


@pytest.mark.parametrize("role", ROLES)
def test_documented_defaults_are_the_roles_defaults(role):
    specs, defaults = _load(role)
    wrong = []
    for entry, spec in specs.items():
        for name, option in (spec.get("options") or {}).items():
            value = defaults.get(name)
            # A computed default ({{ ... }}) is documented in words; a literal one must match.
            if "default" in option and not (isinstance(value, str) and "{{" in value) and option["default"] != value:
                wrong.append(f"{entry}.{name}: documented {option['default']!r}, defaults/main.yml {value!r}")
    assert not wrong, wrong


@pytest.mark.parametrize("role", ROLES)
def test_an_option_shared_with_main_is_mains_own(role):
    specs, _ = _load(role)
    main = specs.get("main", {}).get("options") or {}
    for entry, spec in specs.items():
        for name, option in (spec.get("options") or {}).items():
            if name in main and entry != "main":
                # The facts (type, default, choices) are main's; only the description may be the entry point's.
                facts = {k: v for k, v in option.items() if k != "description"}
                assert facts == {k: v for k, v in main[name].items() if k != "description"}, (
                    f"{role} {entry}.{name} differs from main's: use main's option (the alias *{name})")


def test_the_job_roles_release_defaults_are_the_modules():
    _, defaults = _load("job")
    assert defaults["dflash_job_gpu_release_threshold_mib"] == GPU_RELEASE_THRESHOLD_MIB
    assert defaults["dflash_job_gpu_release_timeout"] == GPU_RELEASE_TIMEOUT


def test_the_roles_that_prepare_a_container_do_not_read_the_job_roles_variables():
    """They get the job's facts as their own parameters (playbooks/vars/job.yml, passed by provision.yml)."""
    readers = {}
    for role in ("container", "kernels", "env", "venv", "node"):
        for path in sorted((ROOT / "roles" / role).rglob("*")):
            if path.is_file() and path.suffix in (".yml", ".j2", ".py") and "dflash_job_" in path.read_text():
                readers.setdefault(role, []).append(str(path.relative_to(ROOT)))
    assert not readers, readers
    handed = yaml.safe_load((ROOT / "playbooks/vars/job.yml").read_text())
    assert {"dflash_container_gpus", "dflash_kernels_gpus", "dflash_env_gpus", "dflash_env_job"} <= set(handed)
    provision = yaml.safe_load((ROOT / "playbooks/provision.yml").read_text())
    for play in provision:
        roles = {r["role"] if isinstance(r, dict) else r for r in play.get("roles") or []}
        if roles & {"container", "kernels", "env"}:
            assert "vars/job.yml" in play.get("vars_files", []), play["name"]
