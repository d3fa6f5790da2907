"""The Makefile's recipes run the tests with Python allowed to write its bytecode: the controller venv is
installed without byte-compiling (Makefile), so a shell's PYTHONDONTWRITEBYTECODE would otherwise make every
test process compile torch and transformers from source again."""

from __future__ import annotations

import os
import subprocess

from conftest import ROOT


def test_make_recipes_do_not_inherit_pythondontwritebytecode(tmp_path):
    probe = tmp_path / "probe.mk"
    probe.write_text(f"include {ROOT}/Makefile\nprobe:\n\t@echo \"[$$PYTHONDONTWRITEBYTECODE]\"\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(["make", "-s", "-f", str(probe), "probe"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
