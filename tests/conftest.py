from __future__ import annotations

import copy
from pathlib import Path

import pytest

# Imported before any test imports ansible into this process: ansible's sys.intern patch makes a later
# first import of torch._dynamo fail ("substitute_in_graph expects a function"), whatever the test order.
import torch._dynamo  # noqa: F401
import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-cpu.yaml"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Groups for pytest-xdist's --dist loadgroup (pyproject.toml), whose workers run a group one test after the
    other: the tests that spawn several processes (marked `distributed`) share one group, so two of them never
    compete for the cores; and the tests of a module with a module-scoped fixture stay together, so that fixture
    (a training run, a playbook run, a wheel build) is built once, not once per worker."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        if item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.xdist_group("multiprocess"))
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d and d[-1].scope in ("module", "package") for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """On an xdist worker with --dist loadgroup, xdist names each grouped test NODEID@GROUP; a test without the
    suffix would be scheduled alone (pytest-xdist#1386: pytest 9.2 with pytest-xdist 3.8). Say so then."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid.rsplit("]", 1)[-1]]
    if lost:
        session.config.issue_config_time_warning(pytest.PytestConfigWarning(
            f"pytest-xdist did not group {len(lost)} test(s) marked xdist_group (e.g. {lost[0]}): pytest "
            f"{pytest.__version__} and this pytest-xdist do not work together (pytest-xdist#1386), so the groups run "
            "apart; install the versions of the dev extra (pip install -e '.[dev]')"), stacklevel=2)


@pytest.fixture
def tiny_dict() -> dict:
    return copy.deepcopy(yaml.safe_load(TINY.read_text()))


@pytest.fixture
def write_config(tmp_path):
    def write(data: dict, name: str = "run.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data))
        return path

    return write


@pytest.fixture
def tiny_config(tiny_dict, tmp_path):
    """A RunConfig for fast unit tests (few samples, short run) in a temp output dir."""
    from dflash.config import _build, validate

    tiny_dict["output_dir"] = str(tmp_path / "run")
    tiny_dict["data"]["synthetic"]["num_samples"] = 200
    tiny_dict["optim"]["max_steps"] = 6
    tiny_dict["checkpoint"]["interval"] = 3
    tiny_dict["logging"]["interval"] = 2
    cfg = _build(__import__("dflash.config", fromlist=["RunConfig"]).RunConfig, tiny_dict, "")
    validate(cfg)
    return cfg
