"""A fresh node container has no CUDA toolkit: without nvcc and without a wheel the kernels role
refuses at once, naming both fixes, instead of failing minutes into the causal-conv1d build."""

from __future__ import annotations

from .test_kernels_role import KEY, make_wheel, run_role, scratch_venv  # noqa: F401 (fixture)


def test_no_nvcc_and_no_wheel_is_refused_with_the_fix(tmp_path, scratch_venv):  # noqa: F811
    (scratch_venv / ".dflash-causal-conv1d-key").unlink(missing_ok=True)
    result = run_role(tmp_path, scratch_venv, tmp_path / "cache", dflash_kernels_cuda_home=str(tmp_path / "no-cuda"))
    assert result.returncode != 0
    assert f"{tmp_path}/no-cuda/bin/nvcc does not exist" in result.stdout
    assert "cuda-toolkit-13-0" in result.stdout and "dflash_kernels_causal_conv1d_wheel" in result.stdout
    assert "Fetch the causal-conv1d sources" not in result.stdout  # refused before any download


def test_a_cached_wheel_needs_no_nvcc(tmp_path, scratch_venv):  # noqa: F811
    (scratch_venv / ".dflash-causal-conv1d-key").unlink(missing_ok=True)
    make_wheel(tmp_path / "cache" / KEY)
    result = run_role(tmp_path, scratch_venv, tmp_path / "cache", dflash_kernels_cuda_home=str(tmp_path / "no-cuda"))
    assert result.returncode == 0, result.stdout + result.stderr
