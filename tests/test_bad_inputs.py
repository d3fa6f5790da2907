"""Bad inputs (and a full disk) that once ended in a traceback or lost work (issue 32, item 5): each ends in one
`dflash: error: ...` line, exit 2 where it is the user's input, and nothing half-written."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from dflash.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-cpu.yaml"
PROMPT = {"messages": [{"role": "user", "content": "count by 1 from w1"}]}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("dflash: error: ")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


def tiny_run(tiny_dict, tmp_path: Path, **optim) -> dict:
    """A few steps of the tiny config without regeneration or speculative eval: seconds on one core."""
    tiny_dict["output_dir"] = str(tmp_path / "run")
    tiny_dict["data"]["synthetic"]["num_samples"] = 50
    tiny_dict["data"]["regenerate"] = None
    tiny_dict["eval"]["speculative_prompts"] = 0
    tiny_dict["optim"].update({"max_steps": 4, **optim})
    tiny_dict["checkpoint"]["interval"] = 2
    tiny_dict["logging"]["interval"] = 2
    return tiny_dict


def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(PROMPT) + "\n")
    return path


def no_space(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def safetensors_no_space(*_args, **_kwargs):
    """What safetensors' Rust writer raises on a full disk: no OSError, the errno only in its text."""
    import safetensors

    raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                      '"No space left on device" })')


# ------------------------------------------------------------------------------------------- 1. disk full
@pytest.mark.parametrize("fail", [no_space, safetensors_no_space])
def test_1_disk_full_during_a_checkpoint_keeps_the_previous_one(write_config, tiny_dict, tmp_path, capsys,
                                                                 monkeypatch, fail):
    """An OSError was one line already (CheckpointManager.save); safetensors' own error was a traceback."""
    import safetensors.torch

    real, calls = safetensors.torch.save_file, []

    def second_fails(*args, **kwargs):
        calls.append(args[1])
        if len(calls) >= 2:
            fail()
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", second_fails)
    assert main(["train", str(write_config(tiny_run(tiny_dict, tmp_path)))]) == 1
    line = one_error_line(capsys)
    ckpts = tmp_path / "run" / "checkpoints"
    assert f"no space left in {ckpts}" in line and "step-00000004" in line and "free space" in line
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-00000002"]  # no temp directory
    assert (ckpts / "latest").read_text().strip() == "step-00000002"


def test_1_disk_full_while_writing_regenerated_data_leaves_no_temp_file(tmp_path, capsys, monkeypatch):
    from dflash.regenerate import files

    monkeypatch.setattr(files.os, "fsync", no_space)
    out = tmp_path / "out" / "regen.jsonl"
    assert main(["regenerate", str(prompts_file(tmp_path)), str(out), "--target-config", str(TINY),
                 "--max-new-tokens", "4"]) == 1
    line = one_error_line(capsys)
    assert "disk full" in line and str(out.parent / "regen.jsonl.parts") in line and "free" in line
    assert not [p for p in (tmp_path / "out").rglob("*") if ".tmp-" in p.name]
    assert not out.exists()


def test_1_disk_full_while_writing_a_jsonl_file_leaves_no_temp_file(tmp_path, monkeypatch):
    """data.regenerate's cache (output_dir/regenerated/) and `dflash synth-data` write through write_jsonl."""
    from dflash.data import synthetic
    from dflash.errors import DiskFull

    monkeypatch.setattr(synthetic.os, "fsync", no_space)
    with pytest.raises(DiskFull, match=f"disk full: no space left in {tmp_path} while writing rows.jsonl"):
        synthetic.write_jsonl(tmp_path / "rows.jsonl", [{"a": 1}])
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------- 2. regenerate OUTPUT under a file
def test_2_regenerate_output_under_a_regular_file_exits_2_before_any_work(tmp_path, capsys, monkeypatch):
    from dflash.regenerate import runner

    monkeypatch.setattr(runner, "build_backend", lambda args: pytest.fail("the target was loaded"))
    (tmp_path / "file").write_text("x")
    inp = prompts_file(tmp_path)
    assert main(["regenerate", str(inp), str(tmp_path / "file" / "x.jsonl"), "--target-config", str(TINY)]) == 2
    line = one_error_line(capsys)
    assert f"'{tmp_path / 'file'}' is a file, not a directory" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "in.jsonl"]


# ------------------------------------------------------------------------ 7. --target-path that is missing
def test_7_regenerate_target_path_missing_names_the_directory(tmp_path, capsys):
    missing = tmp_path / "models" / "nope"
    assert main(["regenerate", str(prompts_file(tmp_path)), str(tmp_path / "o.jsonl"), "--target-path",
                 str(missing)]) == 2
    line = one_error_line(capsys)
    assert f"--target-path '{missing}' is not a directory (it does not exist)" in line
    assert "tokenizer" not in line and "repo" not in line.lower()


# ------------------------------------------------------------------ 8. overrides after the options
def test_8_overrides_after_the_options_apply_like_those_before(write_config, tiny_dict, tmp_path, capsys):
    tiny_dict["output_dir"] = str(tmp_path / "run")
    config = str(write_config(tiny_dict))
    assert main(["train", config, "--check", "optim.lr=fast"]) == 2
    assert one_error_line(capsys) == "dflash: error: optim.lr: expected a number, got 'fast'"
    assert main(["train", config, "optim.lr=fast", "--check"]) == 2
    assert one_error_line(capsys) == "dflash: error: optim.lr: expected a number, got 'fast'"
    # both places, in order: the later one wins as it would before the options
    assert main(["train", config, "optim.lr=fast", "--check", "optim.lr=1e-3"]) == 0
    assert main(["train", config, "optim.lr=1e-3", "--check", "optim.lr=fast"]) == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:  # an unknown option stays refused by the parser
        main(["train", config, "--check", "--no-such-option"])
    assert stop.value.code == 2


def test_8_overrides_after_the_options_reach_the_trainer(write_config, tiny_dict, tmp_path, monkeypatch):
    from dflash import launch

    seen = {}
    monkeypatch.setattr(launch, "run_training", lambda config, path, overrides: seen.update(
        lr=config.optim.lr, overrides=list(overrides)) or 0)
    tiny_dict["output_dir"] = str(tmp_path / "run")
    assert main(["train", str(write_config(tiny_dict)), "optim.max_steps=5", "--check-data", "optim.lr=1e-3"]) == 0
    assert seen == {"lr": 1e-3, "overrides": ["optim.max_steps=5", "optim.lr=1e-3"]}


# ------------------------------------------------------------------------ 9. negative intervals
@pytest.mark.parametrize("override, message", [
    ("logging.eval_interval=-5", "logging.eval_interval must be >= 0 steps, 0 = only at the end (got -5)"),
    ("data.min_loss_tokens=-1", "data.min_loss_tokens must be >= 1 (got -1)"),
    ("data.min_loss_tokens=0", "data.min_loss_tokens must be >= 1 (got 0)"),
])
def test_9_negative_eval_interval_and_min_loss_tokens_exit_2_naming_the_key(write_config, tiny_dict, tmp_path,
                                                                            capsys, override, message):
    tiny_dict["output_dir"] = str(tmp_path / "run")
    assert main(["train", str(write_config(tiny_dict)), override, "--check"]) == 2
    assert message in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------- 3./4. dflash eval
def tiny_drafter(directory: Path, **target) -> Path:
    """An untrained drafter of the tiny config's target, with `target` changing that target's shape."""
    import yaml

    from dflash.models.drafter import Drafter, arch_from_target
    from dflash.models.target import target_config, text_config_of

    spec = {**yaml.safe_load(TINY.read_text())["target"]["random_init"], **target}
    arch = arch_from_target(text_config_of(target_config(None, spec)), num_layers=1, block_size=8,
                            layer_ids=[1, 3, 4], mask_token_id=1, vocab_size=spec["vocab_size"])
    Drafter(arch).save(directory)
    return directory


def eval_config(write_config, tiny_dict, tmp_path: Path) -> str:
    tiny_dict["output_dir"] = str(tmp_path / "run")
    tiny_dict["data"]["regenerate"] = None
    tiny_dict["data"]["synthetic"]["num_samples"] = 50
    return str(write_config(tiny_dict))


def test_3_eval_out_into_a_missing_directory_exits_2_before_the_evaluation(write_config, tiny_dict, tmp_path,
                                                                           capsys, monkeypatch):
    from dflash.models import target

    monkeypatch.setattr(target, "build_hf_model", lambda *a, **k: pytest.fail("the evaluation started"))
    drafter = tiny_drafter(tmp_path / "drafter")
    missing = tmp_path / "reports"
    assert main(["eval", eval_config(write_config, tiny_dict, tmp_path), str(drafter), "--num-prompts", "1",
                 "--out", str(missing / "r.json")]) == 2
    line = one_error_line(capsys)
    assert f"the directory '{missing}' does not exist" in line and f"mkdir -p {missing}" in line
    assert not missing.exists()


@pytest.mark.parametrize("shape, named", [
    ({"hidden_size": 32, "head_dim": 8}, "hidden_size 32 (the target's: 64)"),
    ({"vocab_size": 128}, "vocab_size 128 (the target's: 96)"),
    ({"num_hidden_layers": 8}, "num_target_layers 8 (the target's: 6)"),
])
def test_4_eval_of_a_drafter_that_does_not_fit_the_target_is_one_line(write_config, tiny_dict, tmp_path, capsys,
                                                                      monkeypatch, shape, named):
    from dflash.models import target

    monkeypatch.setattr(target, "build_hf_model", lambda *a, **k: pytest.fail("the target was loaded"))
    drafter = tiny_drafter(tmp_path / "drafter", **shape)
    assert main(["eval", eval_config(write_config, tiny_dict, tmp_path), str(drafter), "--num-prompts", "1",
                 "--max-new-tokens", "4"]) == 2
    line = one_error_line(capsys)
    assert f"drafter '{drafter}' does not fit the config's target: its {named}" in line


def test_4_eval_of_a_drafter_tapping_other_layers_is_one_line(write_config, tiny_dict, tmp_path, capsys):
    """Already one line on today's code (run_eval's layer check): pinned here."""
    drafter = tiny_drafter(tmp_path / "drafter")
    assert main(["eval", eval_config(write_config, tiny_dict, tmp_path), str(drafter), "target.layer_ids=[1,2,4]",
                 "--num-prompts", "1"]) == 2
    line = one_error_line(capsys)
    assert "taps target layers [1, 3, 4] but the config's target taps [1, 2, 4]" in line


# ------------------------------------------------------------------------------------ 5. divergence
def test_5_a_huge_lr_stops_with_one_line_and_no_checkpoint_of_nan_weights(write_config, tiny_dict, tmp_path,
                                                                            capsys):
    tiny_dict["optim"]["warmup_ratio"] = 0
    tiny_run(tiny_dict, tmp_path)["checkpoint"]["interval"] = 1  # a save after step 1, whose weights overflowed
    config = write_config(tiny_dict)
    assert main(["train", str(config), "optim.lr=1e308"]) == 1
    line = one_error_line(capsys)
    assert line.startswith("dflash: error: training diverged: ") and "after step 1" in line
    assert "lower optim.lr (it is 1e+308)" in line
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*"))
    beat = json.loads((tmp_path / "run" / "heartbeat.json").read_text())
    assert beat["status"] == "failed" and beat["error"] == line.removeprefix("dflash: error: ")


def test_5_a_nan_loss_keeps_the_last_good_checkpoint_latest(write_config, tiny_dict, tmp_path, capsys,
                                                            monkeypatch):
    import torch

    from dflash.training import trainer as train_module

    real, calls = train_module.Trainer.optimizer_step, []

    def third_step_overflows(self, *args, **kwargs):
        real(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:  # the weights of step 3 (not a checkpoint step) are NaN: the loss of step 4 is NaN
            with torch.no_grad():
                next(self.drafter.parameters()).fill_(float("nan"))

    monkeypatch.setattr(train_module.Trainer, "optimizer_step", third_step_overflows)
    assert main(["train", str(write_config(tiny_run(tiny_dict, tmp_path)))]) == 1
    line = one_error_line(capsys)
    assert "training diverged: the loss is nan at step 4; lower optim.lr" in line and "step-00000002" in line
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000002"]
    assert (ckpts / "latest").read_text().strip() == "step-00000002"


def test_1_disk_full_during_an_export_leaves_nothing(tmp_path, capsys, monkeypatch):
    import safetensors.torch

    drafter = tiny_drafter(tmp_path / "drafter")
    monkeypatch.setattr(safetensors.torch, "save_file", safetensors_no_space)
    assert main(["export", str(drafter), str(tmp_path / "export")]) == 1
    line = one_error_line(capsys)
    assert f"disk full: no space left in {tmp_path} while writing export" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


# ----------------------------------------------------------------------- 6. export onto a dangling link
def test_6_export_onto_a_dangling_symlink_exits_2_and_writes_nothing(tmp_path, capsys):
    drafter = tiny_drafter(tmp_path / "drafter")
    link, nowhere = tmp_path / "export", tmp_path / "elsewhere" / "drafter"
    link.symlink_to(nowhere)
    assert main(["export", str(drafter), str(link)]) == 2
    line = one_error_line(capsys)
    assert f"export target '{link}' is a symbolic link (to '{nowhere}')" in line
    assert link.is_symlink() and not (tmp_path / "elsewhere").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "export"]  # no temp directory


# ------------------------------------------------------------------------- 11. checkpoint file modes
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_11_checkpoint_files_are_readable_like_the_rest_of_the_run(tmp_path, umask, mode):
    import stat

    from dflash.components.checkpoint import CheckpointManager
    from dflash.models.drafter import Drafter

    drafter = Drafter.load(tiny_drafter(tmp_path / "drafter"))
    previous = os.umask(umask)
    try:
        step = CheckpointManager(tmp_path / "checkpoints", model=drafter).save_state(1)
    finally:
        os.umask(previous)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in step.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {mode}, modes


# ------------------------------------------------------------------------------ 10. the heartbeat of exit 2
def test_10_a_bad_config_leaves_no_heartbeat(write_config, tiny_dict, tmp_path, capsys):
    """Bad input found without a model (config, paths, GPUs) is refused before the heartbeat is written."""
    tiny_dict["output_dir"] = str(tmp_path / "run")
    assert main(["train", str(write_config(tiny_dict)), "logging.eval_interval=-1"]) == 2
    one_error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_10_bad_input_found_at_setup_leaves_a_failed_heartbeat_with_the_error(write_config, tiny_dict, tmp_path,
                                                                               capsys):
    """Kept on purpose (docs/troubleshooting.md): what is found only once the data is read is reported by a
    `failed` heartbeat at step 0 carrying the error line (the health check shows it: failed-to-start), never a
    heartbeat that claims a run (`starting`, `training`), and no checkpoints directory."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "count"}]}\n{not json}\n')
    tiny_dict["data"] = {**tiny_dict["data"], "synthetic": None, "regenerate": None, "train_path": str(data)}
    tiny_dict["output_dir"] = str(tmp_path / "run")
    assert main(["train", str(write_config(tiny_dict))]) == 3  # a data error (dflash/runtime/failures.py)
    line = one_error_line(capsys)
    beat = json.loads((tmp_path / "run" / "heartbeat.json").read_text())
    assert beat["status"] == "failed" and beat["step"] == 0 and beat["error"] == line.removeprefix("dflash: error: ")
    assert not (tmp_path / "run" / "checkpoints").exists()
