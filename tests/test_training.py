"""End-to-end training on CPU: resume equivalence, SIGTERM, export (learning: tests/test_recipe.py)."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.cli import main
from dflash.models.drafter import Drafter
from dflash.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def weights(trainer):
    return {k: v.clone() for k, v in trainer.drafter.state_dict().items()}


def test_resume_n_plus_n_equals_2n(tiny_config, tmp_path):
    import copy

    full = copy.deepcopy(tiny_config)
    full.output_dir = str(tmp_path / "full")
    full.optim.max_steps = 8
    full.checkpoint.interval = 100
    a = Trainer(full).setup()
    a.run()

    half = copy.deepcopy(full)
    half.output_dir = str(tmp_path / "half")
    first = Trainer(half).setup()
    first.total_steps = 8  # same schedule as the full run
    while first.step < 4:
        first.train_step()
    first.save_checkpoint()
    del first
    second = Trainer(half).setup()
    assert second.step == 4
    second.run()
    assert second.step == 8
    wa, wb = weights(a), weights(second)
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6), k
    # the exported checkpoint of each run loads as a drafter
    assert Drafter.load(second.ckpt.latest_valid()).arch.block_size == full.drafter.block_size


def _spawn(config_path, *overrides):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "dflash", "train", str(config_path), *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)


def test_sigterm_checkpoints_and_exits_cleanly_then_resumes(write_config, tiny_dict, tmp_path):
    out = tmp_path / "run"
    tiny_dict["output_dir"] = str(out)
    tiny_dict["data"]["synthetic"]["num_samples"] = 200  # regenerated at each start: enough for the steps here
    tiny_dict["checkpoint"]["interval"] = 100000
    tiny_dict["logging"]["interval"] = 5
    cfg = write_config(tiny_dict)
    proc = _spawn(cfg)
    hb = out / "heartbeat.json"
    deadline = time.time() + 600
    while time.time() < deadline:
        if hb.exists() and json.loads(hb.read_text())["step"] >= 10:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("trainer made no progress: " + proc.communicate()[0])
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    beat = json.loads(hb.read_text())
    assert beat["status"] == "stopped" and beat["pid"] == proc.pid
    step = beat["step"]
    ckpts = sorted((out / "checkpoints").glob("step-*"))
    assert ckpts and ckpts[-1].name == f"step-{step:08d}"
    lines = [r for x in (out / "metrics.jsonl").read_text().splitlines() if (r := json.loads(x)).get("kind") != "eval"]
    assert lines and {"step", "loss", "tau", "tokens_per_s", "blocks_per_s", "acc", "lr"} <= set(lines[-1])
    assert lines[-1]["blocks_per_s"] > 0
    # resume continues from that step
    proc2 = _spawn(cfg, f"optim.max_steps={step + 5}")
    output2, _ = proc2.communicate(timeout=600)
    assert proc2.returncode == 0, output2
    assert f"resumed from {ckpts[-1]} at step {step}" in output2
    assert json.loads(hb.read_text())["step"] == step + 5


def test_export_cli_writes_serving_layout(tiny_config, tmp_path, capsys):
    tiny_config.optim.max_steps = 3
    Trainer(tiny_config).setup().run()
    out = tmp_path / "export"
    assert main(["export", tiny_config.output_dir, str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3, 4] and cfg["torch_dtype"] == "bfloat16"
    assert Drafter.load(out).arch.num_hidden_layers == 2
    assert main(["export", tiny_config.output_dir, str(out)]) == 2  # refuses to overwrite
    assert "not empty" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2


def test_bf16_target_trains_on_cpu_and_metrics_report_input_share(tiny_config, tmp_path):
    """A bf16 target on CPU (no autocast there) meets the fp32 drafter; each metrics record says how much of
    the window went to obtaining inputs (here: the target forward), a fraction in (0, 1)."""
    cfg = tiny_config
    cfg.output_dir = str(tmp_path / "bf16")
    cfg.target.dtype = "bfloat16"
    cfg.optim.max_steps = 4
    trainer = Trainer(cfg).setup()
    assert next(trainer.target.model.parameters()).dtype == torch.bfloat16
    result = trainer.run()
    records = [r for x in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()
               if (r := json.loads(x)).get("kind") != "eval"]
    assert records and all(0.0 < r["input_frac"] < 1.0 for r in records)
    # the run's loss is the last logged window's (step 4), a finite positive cross-entropy in every window
    assert result["step"] == 4 and records[-1]["step"] == 4 and result["loss"] == records[-1]["loss"]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records)


def test_fused_loss_trains_like_the_checkpointed_loss(tiny_config, tmp_path):
    import copy

    runs = {}
    for impl in ("checkpoint", "fused"):
        cfg = copy.deepcopy(tiny_config)
        cfg.output_dir = str(tmp_path / impl)
        cfg.drafter.loss_impl = impl
        cfg.drafter.loss_chunk_size = 64  # several chunks per batch
        trainer = Trainer(cfg).setup()
        losses = [trainer.train_step()[1].loss for _ in range(3)]
        runs[impl] = (losses, weights(trainer))
    (la, wa), (lb, wb) = runs["checkpoint"], runs["fused"]
    assert la == pytest.approx(lb, rel=1e-5)
    for k in wa:  # AdamW turns fp32 rounding of near-zero gradients into updates of up to ~lr (3e-3 here)
        assert torch.allclose(wa[k], wb[k], atol=1e-4), k


@pytest.fixture
def stop_handlers():
    """The process's stop handlers as they were before the test (a trainer's run installs its own)."""
    from dflash.runtime import stop

    saved = {s: signal.getsignal(s) for s in stop.SIGNALS}
    yield stop
    for s, handler in saved.items():
        signal.signal(s, handler)
    # the request this test made must not stay latched: when an earlier test of this process (a CLI run) left
    # the handlers installed, a later trainer's install() would keep it and stop at step 0
    stop._STOP.signum = None


def _count_eval_features(trainer, stop_after=None):
    """Wrap the trainer's feature source: count the calls made after training ended (the final eval's), and
    send this process SIGTERM on the `stop_after`-th of them."""
    calls = []
    features = trainer.source.features

    def counted(batch):
        if trainer.step >= trainer.total_steps:
            calls.append(batch)
            if stop_after is not None and len(calls) == stop_after:
                os.kill(os.getpid(), signal.SIGTERM)
        return features(batch)
    trainer.source.features = counted
    return calls


def test_a_stop_during_the_final_eval_ends_it_early_and_keeps_the_checkpoint(tiny_config, tmp_path,
                                                                              stop_handlers, caplog):
    """systemd gives a stopped unit TimeoutStopSec before SIGKILL: the final eval (with a large target,
    minutes of decoding) must not hold the exit; the last step's checkpoint is already written."""
    import copy
    import logging

    tiny_config.optim.max_steps = 4
    tiny_config.checkpoint.interval = 100
    tiny_config.eval.speculative_prompts = 2
    whole = copy.deepcopy(tiny_config)
    whole.output_dir = str(tmp_path / "whole")
    full = Trainer(whole).setup()
    all_calls = _count_eval_features(full)
    assert "eval_tau" in full.run()
    assert len(all_calls) >= 2  # the eval's batch and the walk's, then the speculative decoding

    stop_handlers.install(lambda signum: None)  # what `dflash train` installs
    trainer = Trainer(tiny_config).setup()
    calls = _count_eval_features(trainer, stop_after=1)
    with caplog.at_level(logging.INFO):
        result = trainer.run()
    assert len(calls) == 1  # the eval stopped at its next batch: no walk, no speculative decoding
    assert "eval_tau" not in result and "eval_acceptance_length" not in result
    assert result["step"] == 4 and not result["stopped"]  # the training itself finished
    assert trainer.drafter.training  # the eval's mode switch was undone
    assert trainer.ckpt.latest_valid() == trainer.ckpt.path_for(4)
    assert any("interrupted by a stop request" in r.getMessage() for r in caplog.records)
    beat = json.loads((Path(tiny_config.output_dir) / "heartbeat.json").read_text())
    assert beat["status"] == "finished" and beat["step"] == 4


def test_step_pause_sleeps_after_every_step_and_a_negative_one_is_refused(tiny_config, monkeypatch):
    import dflash.training.trainer as train_module
    from dflash.config import ConfigError, validate

    pauses = []
    monkeypatch.setattr(train_module.time, "sleep", pauses.append)
    tiny_config.runtime.step_pause_s = 0.25
    tiny_config.optim.max_steps = 3
    tiny_config.eval.speculative_prompts = 0
    result = Trainer(tiny_config).setup().run()
    assert result["step"] == 3 and pauses == [0.25, 0.25, 0.25]
    tiny_config.runtime.step_pause_s = -1
    with pytest.raises(ConfigError, match=r"runtime.step_pause_s must be in \[0, 60\] seconds \(got -1\)"):
        validate(tiny_config)
