"""`data.feature_cache`: the target's features kept on disk per sample; later epochs skip the target and train
exactly as the live features do (float32 cache), bfloat16 within its rounding."""

import copy

import pytest
import torch

from dflash.config import ConfigError, load_config
from dflash.training.trainer import Trainer


def _run(cfg, steps):
    trainer = Trainer(cfg).setup()
    calls = []
    live = trainer.target.features

    def counted(*args, **kwargs):
        calls.append(1)
        return live(*args, **kwargs)

    trainer.target.features = counted
    losses = [trainer.train_step()[1].loss for _ in range(steps)]
    weights = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    trainer.source.finish()
    return trainer, losses, weights, len(calls)


@pytest.fixture
def small(tiny_config, tmp_path):
    cfg = copy.deepcopy(tiny_config)
    cfg.data.synthetic.num_samples = 24  # a few batches an epoch
    cfg.data.token_budget = 256
    return cfg


def test_float32_feature_cache_trains_like_the_live_target_and_skips_it_after_the_first_epoch(small, tmp_path):
    live_cfg, cached_cfg = copy.deepcopy(small), copy.deepcopy(small)
    live_cfg.output_dir = str(tmp_path / "live")
    cached_cfg.output_dir = str(tmp_path / "cached")
    cached_cfg.data.feature_cache, cached_cfg.data.feature_cache_dtype = True, "float32"
    trainer, _, _, _ = _run(copy.deepcopy(live_cfg), 0)
    per_epoch = len(list(trainer.sampler.epoch_batches(0)))
    steps = 3 * per_epoch
    _, live_losses, live_weights, live_calls = _run(live_cfg, steps)
    cached, cached_losses, cached_weights, cached_calls = _run(cached_cfg, steps)
    assert live_calls == steps
    assert cached_calls == per_epoch  # the first epoch only
    assert cached_losses == pytest.approx(live_losses, rel=1e-6)
    for k in live_weights:
        assert torch.allclose(live_weights[k], cached_weights[k], atol=1e-6), k
    files = list((tmp_path / "cached" / "feature-cache").rglob("*.safetensors"))
    assert len(files) == cached.source.cache.misses > 0
    assert cached.source.cache.hits >= 2 * cached.source.cache.misses  # epochs 2 and 3 read every sample
    assert "rows read" in cached.source.cache.describe()


def test_bfloat16_feature_cache_is_half_the_disk_and_close(small, tmp_path):
    a, b = copy.deepcopy(small), copy.deepcopy(small)
    a.output_dir, b.output_dir = str(tmp_path / "f32"), str(tmp_path / "bf16")
    a.data.feature_cache, a.data.feature_cache_dtype = True, "float32"
    b.data.feature_cache = True
    sizes = {}
    for cfg in (a, b):
        _run(cfg, 2)
        sizes[cfg.data.feature_cache_dtype] = sum(
            f.stat().st_size for f in (tmp_path / cfg.output_dir / "feature-cache").rglob("*.safetensors"))
    assert sizes["bfloat16"] < 0.6 * sizes["float32"]


def test_feature_cache_is_refused_for_a_disaggregated_run(tmp_path, write_config, tiny_dict):
    tiny_dict["data"]["feature_cache"] = True
    tiny_dict["data"].pop("regenerate")
    tiny_dict["topology"] = {"mode": "disaggregated", "target_gpus": [0], "drafter_gpus": [1]}
    tiny_dict["runtime"]["device"] = "cuda"
    with pytest.raises(ConfigError, match="feature_cache"):
        load_config(write_config(tiny_dict))
