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


def test_malformed_data_line_exits_2_with_file_and_line(write_config, tiny_dict, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "count by 1 from w1"}, '
                    '{"role": "assistant", "content": "w1 w2 w3 w4 w5 w6 w7 w8 w9"}]}\n{not json}\n')
    tiny_dict["data"] = {**tiny_dict["data"], "synthetic": None, "train_path": str(data)}
    tiny_dict["output_dir"] = str(tmp_path / "out")
    assert main(["train", str(write_config(tiny_dict))]) == 2
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
