"""The kernels role's setup.py patch: build causal-conv1d only for the GPU architectures present."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys

import pytest

from .conftest import ROOT

SCRIPT = ROOT / "roles" / "kernels" / "files" / "dflash-causal-conv1d-archs"

# Shaped like causal-conv1d's setup.py: unconditional and version-gated gencode pairs.
SETUP_PY = '''\
cc_flag = []
if CUDA_HOME is not None:
    check_cuda()
cc_flag.append("-gencode")
cc_flag.append("arch=compute_75,code=sm_75")
cc_flag.append("-gencode")
cc_flag.append("arch=compute_80,code=sm_80")
if bare_metal_version >= Version("11.8"):
    cc_flag.append("-gencode")
    cc_flag.append("arch=compute_90,code=sm_90")
if bare_metal_version >= Version("12.8"):
    cc_flag.append("-gencode")
    cc_flag.append("arch=compute_100,code=sm_100")
    cc_flag.append("-gencode")
    cc_flag.append("arch=compute_120,code=sm_120")
nvcc_args = ["-O3"] + cc_flag
'''


@pytest.fixture(scope="module")
def archs():
    loader = importlib.machinery.SourceFileLoader("causal_conv1d_archs", str(SCRIPT))
    spec = importlib.util.spec_from_loader("causal_conv1d_archs", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def gencodes(source: str) -> list[str]:
    return [line.split("compute_")[1].split(",")[0] for line in source.splitlines() if "arch=compute_" in line]


def test_only_the_present_architecture_is_built(archs):
    patched, kept = archs.restrict(SETUP_PY, {"90"})
    assert kept == ["90"]
    assert gencodes(patched) == ["90"]
    # The emptied `if` blocks hold a `pass`: still valid Python.
    compile(patched, "setup.py", "exec")
    assert "pass  # dflash: sm_100 not built on this node" in patched


def test_several_architectures(archs):
    patched, kept = archs.restrict(SETUP_PY, {"80", "90"})
    assert kept == ["80", "90"] and gencodes(patched) == ["80", "90"]


def test_cli_patches_in_place_and_rejects_a_missing_architecture(tmp_path):
    setup = tmp_path / "setup.py"
    setup.write_text(SETUP_PY)
    ok = subprocess.run([sys.executable, str(SCRIPT), str(setup), "90"], capture_output=True, text=True)
    assert ok.returncode == 0 and "restricted" in ok.stdout
    assert gencodes(setup.read_text()) == ["90"]

    setup.write_text(SETUP_PY)
    bad = subprocess.run([sys.executable, str(SCRIPT), str(setup), "89"], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "no -gencode pair for sm_89" in bad.stderr and "dflash_kernels_causal_conv1d_wheel" in bad.stderr
    assert setup.read_text() == SETUP_PY
