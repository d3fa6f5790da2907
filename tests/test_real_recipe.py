"""The real recipe in miniature on CPU: the real target (SmolLM2-135M-Instruct from its package) answers a handful of
real prompts (data.regenerate), a drafter trains on the answers (block 16, target features cached), the trainer's
eval and `dflash eval --suite` on the packaged benchmarks decode losslessly, with the prompt-lookup baseline and the
suites' provenance in the report. Numbers are not asserted here (a few steps learn nothing): what is asserted is
that every piece runs on the real model and that speculative decoding equals the target's greedy decoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    "Tom has 3 boxes with 12 pencils in each box. He gives away 10 pencils. How many pencils does he have left?",
    "Write a Python function that returns the largest number in a list.",
    "What causes the seasons on Earth? Answer in two sentences.",
    "Simplify the expression 2(x + 3) - 4x.",
    "Name three primary colors.",
    "Write a Python function that counts the vowels in a string.",
]


def dflash(cache, *args, timeout=600):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DFLASH_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "dflash", *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def test_real_target_regenerate_train_and_eval_the_packaged_suites_losslessly(smollm2_dir, real_target_cache,
                                                                             tmp_path):
    train = tmp_path / "train.jsonl"
    held = tmp_path / "held-out.jsonl"
    rows = [json.dumps({"messages": [{"role": "user", "content": p}]}) for p in PROMPTS]
    train.write_text("\n".join(rows[:4]) + "\n")
    held.write_text("\n".join(rows[4:]) + "\n")
    config = yaml.safe_load((ROOT / "configs" / "smollm2-cpu.yaml").read_text())
    config.update(output_dir=str(tmp_path / "run"))
    config["drafter"].update(num_anchors=8)
    config["data"].update(train_path=str(train), eval_path=str(held), max_length=128, token_budget=512, min_loss_tokens=4,
                          regenerate={"max_new_tokens": 24, "batch_size": 8})
    config["optim"].update(max_steps=3, epochs=3)
    config["checkpoint"].update(interval=3)
    config["logging"].update(interval=1)
    config["eval"].update(speculative_prompts=2, max_new_tokens=12)
    config["runtime"].update(num_threads=1)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))

    done = dflash(real_target_cache, "train", path)
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert f"target: 30 layers, hidden 576, tapped {config['target']['layer_ids']}" in log
    assert "regenerated 4" in log and "feature cache" in log
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"kind": "eval"' in x]
    assert evals and evals[-1]["lossless"] is True and evals[-1]["prompts"] == 2

    out = tmp_path / "suites.json"
    done = dflash(real_target_cache, "eval", path, tmp_path / "run", "--suite", "gsm8k,humaneval,mtbench", "--suite-limit", "1",
                  "--max-new-tokens", "12", "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    suites = report["suites"]
    assert set(suites) == {"gsm8k", "humaneval", "mtbench"}
    for name, suite in suites.items():
        assert suite["lossless"] is True and suite["lossless_prompts"] == suite["num_prompts"] >= 1, name
        histogram = {int(k): n for k, n in suite["histogram"].items()}
        assert sum(histogram.values()) == sum(p["rounds"] for p in suite["prompts"]) > 0, name
        assert sum(k * n for k, n in histogram.items()) == sum(p["new_tokens"] - 1 for p in suite["prompts"]), name
        assert suite["acceptance_length"] == pytest.approx(
            sum(k * n for k, n in histogram.items()) / sum(histogram.values())), name
        assert suite["prompt_lookup"]["lossless_prompts"] == suite["num_prompts"], name
        assert suite["provenance"]["licence"] and suite["provenance"]["version"], name
    assert suites["mtbench"]["num_prompts"] == 2  # both turns of the one question
    assert smollm2_dir.parent.parent == real_target_cache
