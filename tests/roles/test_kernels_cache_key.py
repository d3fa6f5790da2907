"""The kernels role's causal-conv1d wheel cache key."""

import pytest

from .conftest import load_plugin

k = load_plugin("kernels", "dflash_kernels")

H200 = {"torch": "2.11.0+cu130", "cuda": "13.0", "capabilities": [[9, 0]]}


def test_key_names_every_input():
    assert k.causal_conv1d_cache_key(H200, "1.7.0") == "causal_conv1d-1.7.0_torch-2.11.0+cu130_cuda-13.0_sm90"


@pytest.mark.parametrize(
    "change",
    [
        {"torch": "2.12.0+cu130"},
        {"cuda": "12.8"},
        {"capabilities": [[8, 0]]},
        {"capabilities": [[9, 0], [8, 0]]},
    ],
)
def test_key_changes_with_each_input(change):
    assert k.causal_conv1d_cache_key({**H200, **change}, "1.7.0") != k.causal_conv1d_cache_key(H200, "1.7.0")
    assert k.causal_conv1d_cache_key(H200, "1.7.1") != k.causal_conv1d_cache_key(H200, "1.7.0")


def test_key_ignores_gpu_count_and_order():
    eight = {**H200, "capabilities": [[9, 0]] * 8}
    assert k.causal_conv1d_cache_key(eight, "1.7.0") == k.causal_conv1d_cache_key(H200, "1.7.0")
    mixed = {**H200, "capabilities": [[9, 0], [8, 0]]}
    assert k.cuda_arch_list(mixed["capabilities"]) == "8.0;9.0"
    assert k.causal_conv1d_cache_key(mixed, "1.7.0").endswith("_sm80-sm90")


def test_cpu_torch_or_no_device_is_an_error():
    with pytest.raises(ValueError, match="not a CUDA build"):
        k.causal_conv1d_cache_key({"torch": "2.13.0+cpu", "cuda": None, "capabilities": []}, "1.7.0")
    with pytest.raises(ValueError, match="no CUDA device"):
        k.causal_conv1d_cache_key({**H200, "capabilities": []}, "1.7.0")


def test_the_family_table_decides_which_kernels_a_target_needs():
    for_target = load_plugin("kernels", "dflash_kernels").kernels_for_target
    assert for_target("qwen3") == [] and for_target("llama") == []  # dense: no causal-conv1d, no nvcc
    assert for_target("qwen3_5") == ["flash-linear-attention", "causal-conv1d"]
    assert for_target("qwen3", "all") == ["flash-linear-attention", "causal-conv1d"]
    assert for_target("qwen3_next", "none") == []
    with pytest.raises(ValueError, match="model_type 'gpt2' is not in the family table.*dflash_kernels_fast_path"):
        for_target("gpt2")
