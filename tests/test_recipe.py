"""The whole recipe on CPU: tiny target -> dflash regenerate -> dflash train -> dflash eval.

The drafter must accept what its target really generates: real greedy acceptance length >= 4.0 at block 8,
lossless on every prompt, and training's simulated tau within 15% of the real acceptance length (both are
measured on the same held-out prompts, whose answers the target regenerated).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-cpu.yaml"


def dflash(*args, timeout=1200):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "dflash", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, f"dflash {args[0]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _recipe(tmp_path: Path, target: dict | None, steps: int, train_samples: int, eval_samples: int,
            max_new_tokens: int):
    base = yaml.safe_load(TINY.read_text())
    base.pop("output_dir")
    base["data"].pop("regenerate", None)
    if target is not None:
        base["target"]["random_init"] = target
    # 1. prompts (the synthetic language's conversations; their answers are about to be replaced)
    dflash("synth-data", tmp_path / "train-prompts.jsonl", "--num-samples", train_samples, "--seed", 1)
    dflash("synth-data", tmp_path / "eval-prompts.jsonl", "--num-samples", eval_samples, "--seed", 2)
    target_cfg = tmp_path / "target.yaml"
    target_cfg.write_text(yaml.safe_dump({**copy.deepcopy(base), "output_dir": str(tmp_path / "unused")}))
    # 2. the target answers them itself (in batches of 512: the tiny target on a CPU, the same answers as the
    # default 64 for less CPU)
    for split in ("train", "eval"):
        dflash("regenerate", tmp_path / f"{split}-prompts.jsonl", tmp_path / f"{split}.jsonl",
               "--target-config", target_cfg, "--max-new-tokens", max_new_tokens, "--batch-size", 512)
    # 3. train on the regenerated answers
    run = copy.deepcopy(base)
    run["output_dir"] = str(tmp_path / "run")
    run["data"].pop("synthetic")
    run["data"].update(train_path=str(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "eval.jsonl"))
    run["optim"].update(max_steps=steps, lr=3e-3)
    run["checkpoint"]["interval"] = 10_000
    run["logging"].update(interval=50, eval_interval=0)  # the eval at the end only (the config's are the demo's)
    run["eval"] = {"speculative_prompts": 16, "max_new_tokens": max_new_tokens}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(run))
    dflash("train", cfg)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final_eval = [r for r in records if r.get("kind") == "eval"][-1]
    # 4. real speculative decoding of the held-out prompts
    report = json.loads(dflash("eval", cfg, tmp_path / "run", "--num-prompts", 24, "--max-new-tokens",
                               max_new_tokens, "--json").stdout)
    return final_eval, report


@pytest.mark.slow
def test_regenerate_train_eval_dense_target_real_acceptance(tmp_path):
    final_eval, report = _recipe(tmp_path, None, steps=400, train_samples=1500, eval_samples=75,
                                 max_new_tokens=40)
    real = report["acceptance_length"]
    print(f"simulated tau {final_eval['tau']:.3f} (decoding path {final_eval['tau_walk']:.3f}), real acceptance {real:.3f} "
          f"(trainer's eval: {final_eval['acceptance_length']:.3f}), histogram {report['histogram']}")
    assert report["lossless"] and report["lossless_prompts"] == report["num_prompts"] == 24
    assert real >= 4.0
    # the simulated acceptance along the decoding path predicts the real one: the data is the target's own
    assert abs(final_eval["tau_walk"] - real) <= 0.15 * real
    # random anchors overstate it a little (rounds restart at hard positions), never by much on such data
    assert real <= final_eval["tau"] <= 1.3 * real
    assert final_eval["lossless"] and final_eval["acceptance_length"] >= 4.0


@pytest.mark.slow
def test_regenerate_train_eval_hybrid_target_is_lossless(tmp_path):
    from dflash.runtime.doctor import PROBE_HYBRID

    hybrid = {**PROBE_HYBRID, "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16,
              "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_hidden_layers": 6,
              "max_position_embeddings": 512,
              "layer_types": ["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"]}
    # losslessness needs no well-trained drafter: a short run, a few prompts
    final_eval, report = _recipe(tmp_path, hybrid, steps=20, train_samples=100, eval_samples=8,
                                 max_new_tokens=24)
    assert report["lossless"] and report["lossless_prompts"] == report["num_prompts"] == 8
    assert final_eval["lossless"]
