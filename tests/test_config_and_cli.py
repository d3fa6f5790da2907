"""Config validation and the CLI's bad-input contract: one readable line, exit code 2, nothing written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.cli import main
from dflash.config import load_config
from dflash.errors import ConfigError


def test_tiny_config_loads_with_overrides(write_config, tiny_dict):
    cfg = load_config(write_config(tiny_dict), ["optim.lr=1e-3", "drafter.block_size=4", "logging.tensorboard=true"])
    assert cfg.optim.lr == 1e-3 and cfg.drafter.block_size == 4 and cfg.logging.tensorboard is True


@pytest.mark.parametrize("override, message", [
    (["optim.lrr=1"], r"unknown config key 'optim.lrr'; did you mean 'optim.lr'"),
    (["data.num_workers=2"], r"unknown config key 'data.num_workers'"),  # removed: nothing read it
    (["runtime.deterministic=true"], r"unknown config key 'runtime.deterministic'"),
    (["target.random_init.rope_scaling={rope_type: linear, factor: 2.0}"],
     r"rope_type 'linear', but the drafter implements only default RoPE"),
    (["drafter.block_size=abc"], r"drafter.block_size: expected an integer, got 'abc'"),
    (["drafter.block_size=1"], r"drafter.block_size must be >= 2"),
    (["data.token_budget=32"], r"data.token_budget \(32\) is smaller than one sequence"),
    (["target.layer_ids=[1,9]"], r"layer ids \[9\] are beyond the target's depth \(6 layers"),
    (["drafter.attention=magic"], r"drafter.attention: must be one of 'auto' \| 'flex' \| 'sdpa'"),
    (["topology.mode=disaggregated", "topology.target_gpus=[0,1]", "topology.drafter_gpus=[1,2]"],
     r"GPUs \[1\] are in both target_gpus and drafter_gpus"),
    (["topology.mode=disaggregated", "topology.target_gpus=[0]", "topology.drafter_gpus=[1]"],
     r"data.regenerate runs inside colocated trainers only; .* `dflash regenerate`"),
    (["data.regenerate.temperature=-1"], r"data.regenerate.temperature must be >= 0"),
    (["eval.speculative_prompts=-1"], r"eval.speculative_prompts must be >= 0"),
    (["data.synthetic=null", "data.train_path=/nonexistent.jsonl"], r"data.train_path '/nonexistent.jsonl' does not exist"),
])
def test_bad_config_is_rejected_with_exit_2_before_any_model_loads(write_config, tiny_dict, tmp_path, capsys,
                                                                   override, message):
    out = tmp_path / "out"
    tiny_dict["output_dir"] = str(out)
    rc = main(["train", str(write_config(tiny_dict)), *override])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("dflash: error: ") and err.count("\n") == 1
    import re

    assert re.search(message, err), err
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


def test_missing_config_file_and_bad_yaml(tmp_path, capsys):
    assert main(["train", str(tmp_path / "none.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    assert main(["train", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="not of the form key.path=value"):
        load_config(None, ["optim.lr"])


def test_malformed_data_line_exits_3_data_error_with_file_and_line(write_config, tiny_dict, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "count by 1 from w1"}, '
                    '{"role": "assistant", "content": "w1 w2 w3 w4 w5 w6 w7 w8 w9"}]}\n{not json}\n')
    tiny_dict["data"] = {**tiny_dict["data"], "synthetic": None, "train_path": str(data)}
    tiny_dict["output_dir"] = str(tmp_path / "out")
    assert main(["train", str(write_config(tiny_dict))]) == 3  # data_error (dflash/runtime/failures.py)
    err = capsys.readouterr().err
    assert f"{data}:2: malformed JSON" in err


@pytest.mark.skipif(os.geteuid() == 0 and sys.platform != "linux", reason="needs POSIX permissions")
def test_unwritable_checkpoint_dir_exits_2(write_config, tiny_dict, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    tiny_dict["output_dir"] = str(blocker / "run")
    assert main(["train", str(write_config(tiny_dict))]) == 2
    assert "is not writable" in capsys.readouterr().err
    assert blocker.read_text() == "not a directory"


def test_console_script_check_mode(write_config, tiny_dict):
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "dflash", "train", str(write_config(tiny_dict)), "--check"],
                       capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1])
    assert r.returncode == 0 and "config OK" in r.stdout


def test_doctor_without_gpu_reports_and_require_fast_path_fails(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "GPUs: none visible" in out and "hybrid fast path" in out
    import importlib.util

    if importlib.util.find_spec("fla") is None:
        assert main(["doctor", "--require-fast-path"]) == 1


def test_tokens_outside_the_targets_vocabulary_are_refused_with_exit_2(write_config, tiny_dict, capsys):
    """A tokenizer that does not belong to the target: one clear line, exit 2, no checkpoint written."""
    tiny_dict["target"]["random_init"]["vocab_size"] = 40  # the synthetic tokenizer has more ids than that
    out = tiny_dict["output_dir"] = str(write_config(tiny_dict).parent / "run")
    assert main(["train", str(write_config(tiny_dict))]) == 2
    err = capsys.readouterr().err
    assert "dflash: error: token id" in err and "outside the target's embedding table (40)" in err
    assert not list((Path(out) / "checkpoints").glob("step-*"))


# --- `train --check`: the GPUs the config asks for, refused before a deploy touches anything ----------------


def _check(write_config, tiny_dict, tmp_path, *overrides):
    tiny_dict["output_dir"] = str(tmp_path / "out")
    return main(["train", str(write_config(tiny_dict)), *overrides, "--check"])


def test_check_refuses_cuda_where_no_gpu_is_visible(write_config, tiny_dict, tmp_path):
    """The trainer's own refusal at start (exit 2), given by --check already: a real process with every GPU hidden."""
    tiny_dict["output_dir"] = str(tmp_path / "out")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "dflash", "train", str(write_config(tiny_dict)), "runtime.device=cuda",
                        "--check"], capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1])
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""
    assert r.stderr.startswith("dflash: error: runtime.device is 'cuda' but no CUDA GPU is visible "
                               "(CUDA_VISIBLE_DEVICES=); set runtime.device=cpu"), r.stderr
    assert r.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_check_refuses_cuda_without_cuda(write_config, tiny_dict, tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _check(write_config, tiny_dict, tmp_path, "runtime.device=cuda") == 2
    err = capsys.readouterr().err
    assert err == ("dflash: error: runtime.device is 'cuda' but no CUDA GPU is visible; set runtime.device=cpu (or "
                   "auto), or run where CUDA_VISIBLE_DEVICES names GPUs of this machine\n")
    # auto falls back to the CPU: nothing to refuse
    assert _check(write_config, tiny_dict, tmp_path, "runtime.device=auto") == 0


@pytest.mark.parametrize("overrides, visible_devices, message", [
    (["topology.mode=disaggregated", "topology.target_gpus=[0]", "topology.drafter_gpus=[2]"], "4,5",
     r"^dflash: error: topology.drafter_gpus \[2\] names GPU ids \[2\] but only ids 0..1 are visible "
     r"\(CUDA_VISIBLE_DEVICES=4,5\) \(ids are positions in CUDA_VISIBLE_DEVICES\); fix topology.target_gpus / "
     r"topology.drafter_gpus or expose more GPUs\n$"),
    (["topology.mode=disaggregated", "topology.target_gpus=[3,1]", "topology.drafter_gpus=[0]"], None,
     r"^dflash: error: topology.target_gpus \[3, 1\] names GPU ids \[3\] but only ids 0..1 are visible "),
    (["topology.nproc=3"], "0,1",
     r"^dflash: error: topology.nproc asks for 3 ranks \(one GPU each\) on this node but only 2 GPU\(s\) are "
     r"visible \(CUDA_VISIBLE_DEVICES=0,1\); lower topology.nproc or expose more GPUs\n$"),
    ([], "0,1,7",
     r"^dflash: error: CUDA_VISIBLE_DEVICES=0,1,7 lists 3 GPUs but only 2 are visible: '7' \(position 2\) is no "
     r"GPU of this machine .*; list only GPUs that nvidia-smi shows\n$"),
])
def test_check_refuses_gpu_ids_beyond_the_visible_count(write_config, tiny_dict, tmp_path, capsys, monkeypatch,
                                                         overrides, visible_devices, message):
    import re

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    if visible_devices is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible_devices)
    tiny_dict["data"].pop("regenerate")  # a disaggregated run trains on data regenerated beforehand
    assert _check(write_config, tiny_dict, tmp_path, "runtime.device=cuda", *overrides) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and re.search(message, captured.err), captured.err


def test_check_accepts_the_gpus_that_exist(write_config, tiny_dict, tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    tiny_dict["data"].pop("regenerate")
    assert _check(write_config, tiny_dict, tmp_path, "runtime.device=cuda", "topology.mode=disaggregated",
                  "topology.target_gpus=[1]", "topology.drafter_gpus=[0]") == 0
    assert capsys.readouterr().out.startswith("config OK")
