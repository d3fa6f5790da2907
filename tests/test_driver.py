"""The NVIDIA driver against torch's CUDA build (dflash/driver.py): the rule, the message with both versions and
the fix, the trainer's error when the driver is too old, and the script the kernels role runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dflash import devices, driver
from dflash.errors import BadInput

ROOT = driver.__file__.rsplit("/dflash/", 1)[0]


def test_a_driver_older_than_the_cuda_major_is_named_with_the_fix():
    # a 570 driver (CUDA 12.8) under torch's CUDA 13.0 build: what a default pip install gets on an older node
    line = driver.mismatch("12.8", "13.0", "torch 2.13.0")
    assert line == ("the NVIDIA driver supports CUDA 12.8, but torch 2.13.0 is built for CUDA 13.0 and needs driver "
                    "580.65.06 or newer: install torch built for CUDA 12.8 (dflash_venv_torch_index_url: "
                    "https://download.pytorch.org/whl/cu128), or upgrade the node's driver")  # fmt: skip
    assert "CUDA 11.8 (dflash_venv_torch_index_url: https://download.pytorch.org/whl/cu118)" in driver.mismatch("11.4", "12.6")
    # the same major runs by minor version compatibility; an unknown side is no verdict
    assert driver.mismatch("12.2", "12.8") is None and driver.mismatch("13.0", "12.8") is None
    assert driver.mismatch(None, "13.0") is None and driver.mismatch("12.8", None) is None


def test_the_trainer_names_the_driver_when_cuda_is_not_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(driver, "driver_cuda_version", lambda: "12.8")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(BadInput, match=r"runtime.device is 'cuda' but the NVIDIA driver supports CUDA 12.8, but torch "):
        devices.pick_device("cuda")
    monkeypatch.setattr(driver, "driver_cuda_version", lambda: None)  # no driver at all: the old message
    with pytest.raises(BadInput, match="no CUDA GPU is visible"):
        devices.pick_device("cuda")


def test_no_driver_library_reads_as_none_and_the_script_prints_json():
    assert driver.driver_cuda_version("libcuda-that-does-not-exist.so.1") is None
    out = subprocess.run([sys.executable, f"{ROOT}/dflash/driver.py", "13.0", "torch 2.13.0"], capture_output=True,
                         text=True, check=True, timeout=300).stdout  # fmt: skip
    report = json.loads(out)
    assert report["torch_cuda"] == "13.0" and set(report) == {"driver_cuda", "torch_cuda", "mismatch"}
    assert report["mismatch"] == driver.mismatch(report["driver_cuda"], "13.0", "torch 2.13.0")


# /proc/driver/nvidia/version of the open kernel module (the lent H200's driver) and of the proprietary one.
OPEN_MODULE = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
               "(dvs-builder@U22-I3-AF03-09-1)  Thu Sep 18 20:53:34 UTC 2025\nGCC version:  gcc version 12.3.0\n")
PROPRIETARY = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n"


def test_a_driver_upgrade_on_the_node_is_named_and_is_bad_input(tmp_path, monkeypatch):
    """After a driver upgrade on the node the container's userspace is older than the kernel module: the trainer
    exits 2 (the unit does not restart it in a loop) naming both versions and the provision run that fixes it."""
    for text, version in ((OPEN_MODULE, "580.159.04"), (PROPRIETARY, "550.54.14")):
        (tmp_path / "version").write_text(text)
        assert driver.kernel_module_version(str(tmp_path / "version")) == version
    assert driver.kernel_module_version(str(tmp_path / "absent")) is None
    assert driver.userspace_mismatch("580.159.04", "580.159.04") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(driver, "kernel_module_version", lambda: "580.159.04")
    monkeypatch.setattr(driver, "userspace_version", lambda: "570.172.08")
    with pytest.raises(BadInput, match=r"userspace 570.172.08 does not match the node's kernel module 580.159.04 .*"
                                       r"playbooks/provision.yml"):
        devices.pick_device("cuda")
