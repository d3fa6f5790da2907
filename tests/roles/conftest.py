"""Helpers to import the roles' filter plugins and the proxmox scenario's `pct` double (plain Python files,
not a package)."""

import importlib.machinery
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_plugin(role: str, name: str):
    path = ROOT / "roles" / role / "filter_plugins" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_test_{role}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_pct_double(name: str, tmp_path, monkeypatch):
    """A fresh import of molecule/proxmox/files/pct whose state and containers live under `tmp_path`."""
    path = ROOT / "molecule" / "proxmox" / "files" / "pct"
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
    monkeypatch.setattr(module, "STATE", str(tmp_path / "state"))
    monkeypatch.setattr(module, "LXC_PATH", str(tmp_path / "lxc"))
    return module
