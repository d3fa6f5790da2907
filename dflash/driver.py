"""The node's NVIDIA driver against the CUDA build of torch.

A torch wheel built for CUDA X.Y runs on a driver that supports CUDA X.0 or newer (CUDA's minor version
compatibility); an older driver makes ``torch.cuda.is_available()`` false, which otherwise reads like broken GPU
passthrough. The driver's CUDA version comes from ``cuDriverGetVersion`` in ``libcuda.so.1`` (the driver's own
library, present in the container once its userspace is installed), so no CUDA context is made.

Plain Python without torch at import: the kernels role loads this file by path to apply the same rule, and
``python dflash/driver.py TORCH_CUDA`` prints the check as JSON.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys

# The oldest Linux driver of each CUDA major (NVIDIA's CUDA toolkit release notes, "CUDA Toolkit and Minimum
# Required Driver Version for CUDA Minor Version Compatibility").
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
# The CUDA builds of torch on download.pytorch.org/whl/cuXYZ.
TORCH_BUILDS = ("11.8", "12.1", "12.4", "12.6", "12.8", "12.9", "13.0")
INDEX = "https://download.pytorch.org/whl/cu{}"


def _version(text: str) -> tuple[int, int]:
    major, _, minor = str(text).partition(".")
    return int(major), int(minor.split(".")[0] or 0)


def driver_cuda_version(library: str = "libcuda.so.1") -> str | None:
    """The newest CUDA version the installed driver supports (``"12.8"``), or None without a driver."""
    try:
        cuda = ctypes.CDLL(library)
    except OSError:
        return None
    version = ctypes.c_int(0)
    if cuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def mismatch(driver_cuda: str | None, torch_cuda: str | None, torch_version: str = "torch") -> str | None:
    """One line naming both versions and the fix when the driver is too old for torch's CUDA build, else None
    (also when either is unknown: no driver, or a CPU build of torch)."""
    if not driver_cuda or not torch_cuda:
        return None
    driver, built = _version(driver_cuda), _version(torch_cuda)
    if driver[0] >= built[0]:
        return None
    # a build no newer than the driver, else the oldest of the driver's major (minor version compatibility)
    fits = [b for b in TORCH_BUILDS if _version(b) <= driver] or [b for b in TORCH_BUILDS if _version(b)[0] == driver[0]][:1]
    fix = (f"install torch built for CUDA {fits[-1]} (dflash_venv_torch_index_url: {INDEX.format(fits[-1].replace('.', ''))})"
           if fits else "install a torch built for the driver's CUDA")
    return (f"the NVIDIA driver supports CUDA {driver_cuda}, but {torch_version} is built for CUDA {torch_cuda} and "
            f"needs driver {MIN_DRIVER.get(built[0], 'newer')} or newer: {fix}, or upgrade the node's driver")


def kernel_module_version(path: str = "/proc/driver/nvidia/version") -> str | None:
    """The node's NVIDIA kernel module version (``580.159.04``), as /proc shows it inside a container too."""
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError:
        return None
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else None


def userspace_version(library: str = "libcuda.so.1", maps: str = "/proc/self/maps") -> str | None:
    """The version of the driver library this process loads (``libcuda.so.580.159.04`` -> ``580.159.04``)."""
    try:
        ctypes.CDLL(library)
        with open(maps) as handle:
            paths = {line.split()[-1] for line in handle if "libcuda.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        match = re.search(r"libcuda\.so\.(\d+(?:\.\d+)+)$", os.path.realpath(path))
        if match:
            return match.group(1)
    return None


def userspace_mismatch(module: str | None, userspace: str | None) -> str | None:
    """One line when the container's driver userspace is not the node's kernel module (a driver upgrade on the
    node since the container was provisioned), else None."""
    if not module or not userspace or module == userspace:
        return None
    return (f"the container's NVIDIA userspace {userspace} does not match the node's kernel module {module} (the "
            "node's driver changed): run ansible-playbook playbooks/provision.yml, whose container role installs "
            "the node driver's userspace, then start the job again")


if __name__ == "__main__":  # python driver.py TORCH_CUDA [TORCH_VERSION]
    torch_cuda = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] not in ("", "None") else None
    found = driver_cuda_version()
    problem = mismatch(found, torch_cuda, sys.argv[2] if len(sys.argv) > 2 else "torch")
    print(json.dumps({"driver_cuda": found, "torch_cuda": torch_cuda, "mismatch": problem}))
