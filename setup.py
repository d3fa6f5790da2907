"""Build hook: the wheel carries the Ansible half of the repository inside the package.

`dflash ops` runs the playbooks with their roles, modules and `ansible.cfg`; an installed package has no
checkout beside it, so build_py copies them (with the run configs and pyproject.toml that a deploy syncs into
the containers) into `dflash/ops/project/`. Everything else is in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# What dflash.ops.runner.project_dir() needs, in the repository's own layout.
PROJECT_TREE = ("ansible.cfg", "pyproject.toml", "playbooks", "roles", "library", "module_utils", "connection_plugins",
                "doc_fragments", "inventories", "configs")


class BuildPyWithProject(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install runs the checkout's own tree
            return
        here = Path(__file__).resolve().parent
        target = Path(self.build_lib) / "dflash" / "ops" / "project"
        for name in PROJECT_TREE:
            source = here / name
            if source.is_dir():
                shutil.copytree(source, target / name, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*_cache"))
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target / name)


setup(cmdclass={"build_py": BuildPyWithProject})
