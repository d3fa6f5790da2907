"""The venv role installs exactly the trainer's runtime dependencies from pyproject.toml."""

import tomllib

import yaml

from .conftest import ROOT


def test_venv_requirements_match_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = sorted(dep for dep in project["dependencies"] if not dep.startswith("torch"))
    defaults = yaml.safe_load((ROOT / "roles" / "venv" / "defaults" / "main.yml").read_text())
    assert sorted(defaults["dflash_venv_requirements"]) == runtime, (
        "roles/venv/defaults/main.yml dflash_venv_requirements must list pyproject's dependencies (minus torch)"
    )
