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


def test_a_dense_target_needs_no_nvcc_and_no_causal_conv1d(tmp_path, scratch_venv):  # noqa: F811
    """The family table decides: Qwen3-8B (model_type qwen3, read from config.json in the model directory) has no
    fast-path kernels, so nothing is built and no nvcc is asked for; the fast-path check has nothing to verify."""
    (scratch_venv / ".dflash-causal-conv1d-key").unlink(missing_ok=True)
    model = tmp_path / "models" / "Qwen3-8B"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "qwen3", "num_hidden_layers": 36}')
    result = run_role(tmp_path, scratch_venv, tmp_path / "cache", dflash_kernels_cuda_home=str(tmp_path / "no-cuda"),
                      dflash_kernels_target_model_type="", dflash_kernels_target_path=str(model))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "target model_type qwen3" in result.stdout and "no causal-conv1d build, no nvcc needed" in result.stdout
    assert "nvcc does not exist" not in result.stdout and "causal-conv1d wheel cache key:" not in result.stdout
    assert not (scratch_venv / ".dflash-causal-conv1d-key").exists()


def test_an_unreadable_target_is_refused_naming_the_mount_and_the_opt_out(tmp_path, scratch_venv):  # noqa: F811
    result = run_role(tmp_path, scratch_venv, tmp_path / "cache", dflash_kernels_target_model_type="",
                      dflash_kernels_target_path=str(tmp_path / "models" / "missing"))
    assert result.returncode != 0
    assert f"{tmp_path}/models/missing/config.json has no model_type" in result.stdout
    assert "dflash_container_bind_mounts" in result.stdout and "dflash_kernels_fast_path" in result.stdout


def test_the_opt_out_installs_nothing(tmp_path, scratch_venv):  # noqa: F811
    (scratch_venv / ".dflash-causal-conv1d-key").unlink(missing_ok=True)
    result = run_role(tmp_path, scratch_venv, tmp_path / "cache", dflash_kernels_fast_path="none",
                      dflash_kernels_cuda_home=str(tmp_path / "no-cuda"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no fast-path kernels" in result.stdout and "nvcc does not exist" not in result.stdout
