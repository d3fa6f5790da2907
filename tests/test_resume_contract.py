"""The resume contract: settings that change the loss or the layout are recorded in each checkpoint
(contract.json); a resume with a changed one exits 2 naming it, unless checkpoint.allow_changed accepts it."""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml

from dflash.cli import main
from dflash.components.checkpoint import CONTRACT, MANIFEST, CheckpointManager
from dflash.config import ConfigError, RunConfig, _build, validate
from dflash.errors import BadInput
from dflash.training.trainer import Trainer

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml"


def small_run(tiny_dict: dict, output_dir) -> dict:
    """The tiny config without regeneration, few samples: a setup of seconds."""
    d = copy.deepcopy(tiny_dict)
    d["output_dir"] = str(output_dir)
    d["data"]["regenerate"] = None
    d["data"]["synthetic"]["num_samples"] = 64
    d["optim"]["max_steps"] = 4
    d["eval"]["speculative_prompts"] = 0
    return d


def config_of(d: dict, **changes) -> RunConfig:
    """`changes`: dotted keys with "__" for "." (drafter__gamma=5.0)."""
    d = copy.deepcopy(d)
    for key, value in changes.items():
        section, name = key.split("__")
        d.setdefault(section, {})[name] = value
    cfg = _build(RunConfig, d, "")
    validate(cfg)
    return cfg


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A run directory with one checkpoint at step 2, built once; every test resumes a copy of it."""
    root = tmp_path_factory.mktemp("contract")
    d = small_run(yaml.safe_load(TINY.read_text()), root / "run")
    trainer = Trainer(config_of(d)).setup()
    trainer.train_step()
    trainer.train_step()
    trainer.save_checkpoint()
    return d, root / "run"


@pytest.fixture
def run(template, tmp_path):
    d, src = template
    d = copy.deepcopy(d)
    d["output_dir"] = str(tmp_path / "run")
    shutil.copytree(src, tmp_path / "run")
    return d


def checkpoint_dir(d: dict):
    return CheckpointManager(f"{d['output_dir']}/checkpoints").latest_valid()


def test_every_checkpoint_records_the_contract(run):
    contract = json.loads((checkpoint_dir(run) / CONTRACT).read_text())
    assert contract == {"drafter.block_size": 8, "drafter.gamma": 4.0, "drafter.num_anchors": 16,
                        "drafter.loss_impl": "fused", "drafter.num_layers": 2, "target.layer_ids": [1, 3, 4]}
    manifest = json.loads((checkpoint_dir(run) / MANIFEST).read_text())
    assert CONTRACT in manifest["files"]  # checksummed and renamed with the rest of the step


@pytest.mark.parametrize(("change", "key", "old", "new"), [
    ({"drafter__gamma": 5.0}, "drafter.gamma", "4.0", "5.0"),
    ({"drafter__num_anchors": 8}, "drafter.num_anchors", "16", "8"),
    ({"drafter__block_size": 6, "drafter__gamma": 4.0}, "drafter.block_size", "8", "6"),
    ({"drafter__loss_impl": "checkpoint"}, "drafter.loss_impl", "fused", "checkpoint"),
])
def test_a_changed_setting_is_refused_naming_the_key_both_values_and_the_fix(run, change, key, old, new):
    with pytest.raises(BadInput) as err:
        Trainer(config_of(run, **change)).setup()
    message = str(err.value)
    assert "\n" not in message
    assert f"{key} is {new} but the checkpoint " in message and f"was trained with {old}" in message
    assert "checkpoint.allow_changed=[" in message and key in message.split("allow_changed=")[1]
    assert "new output_dir" in message


def test_a_sliding_window_layout_is_a_changed_setting_too(run):
    with pytest.raises(BadInput, match=r"drafter.layer_types is \['sliding_attention', 'full_attention'\] but the "
                                       r"checkpoint .* was trained with unset; drafter.sliding_window is 8 but it "
                                       r"was trained with unset"):
        Trainer(config_of(run, drafter__layer_types=["sliding_attention", "full_attention"],
                          drafter__sliding_window=8)).setup()


def test_an_unset_gamma_says_it_is_the_block_sizes_default(run):
    with pytest.raises(BadInput, match=r"drafter.block_size is 16 but .*drafter.gamma is 7.0 \(unset: "
                                       r"the default for drafter.block_size 16\) but it was trained with 4.0"):
        Trainer(config_of(run, drafter__block_size=16)).setup()


def test_the_cli_exits_2_with_one_line(run, write_config, capsys):
    path = write_config(run)
    assert main(["train", str(path), "drafter.gamma=5.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("dflash: error: drafter.gamma is 5.0 but the checkpoint")
    assert "the resume contract" in err and "checkpoint.allow_changed=[drafter.gamma]" in err


def test_a_changed_num_layers_is_refused_before_any_model_loads_without_offering_the_override(run, write_config,
                                                                                              capsys):
    path = write_config(run)
    assert main(["train", str(path), "drafter.num_layers=3"]) == 2
    err = capsys.readouterr().err.strip()
    # the words molecule/faults/rollback.yml looks for in a rolled-back deploy
    assert err.startswith("dflash: error: drafter.num_layers is 3 but the checkpoint ")
    assert "was trained with 2" in err and "new output_dir" in err and "allow_changed" not in err


def test_the_override_accepts_the_changes_and_the_next_checkpoint_records_them(run):
    cfg = config_of(run, drafter__gamma=3.0, drafter__num_anchors=8, drafter__block_size=6,
                    checkpoint__allow_changed=["drafter.gamma", "drafter.num_anchors", "drafter.block_size"])
    trainer = Trainer(cfg).setup()
    assert trainer.step == 2
    assert trainer.drafter.arch.block_size == 6 and trainer.gamma == 3.0
    assert set(trainer.checkpointer.accepted_changes) == {"drafter.gamma", "drafter.num_anchors", "drafter.block_size"}
    trainer.train_step()
    saved = trainer.save_checkpoint()
    contract = json.loads((saved / CONTRACT).read_text())
    assert (contract["drafter.block_size"], contract["drafter.gamma"], contract["drafter.num_anchors"]) == (6, 3.0, 8)
    assert json.loads((saved / "config.json").read_text())["block_size"] == 6


def test_an_unchanged_resume_works_without_a_warning(run, caplog):
    with caplog.at_level(logging.WARNING, logger="dflash"):
        trainer = Trainer(config_of(run)).setup()
    assert trainer.step == 2 and trainer.checkpointer.accepted_changes == {}
    assert CONTRACT not in caplog.text
    trainer.run()
    assert trainer.step == 4


def make_old(checkpoint) -> None:
    """What an earlier dflash wrote: the same step directory without contract.json (nor its manifest entry)."""
    (checkpoint / CONTRACT).unlink()
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    del manifest["files"][CONTRACT]
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    assert CheckpointManager.verify(checkpoint) is None


def test_an_old_checkpoint_without_the_record_resumes_with_one_warning(run, caplog):
    make_old(checkpoint_dir(run))
    with caplog.at_level(logging.WARNING, logger="dflash"):
        trainer = Trainer(config_of(run, drafter__gamma=5.0)).setup()  # nothing to compare with
    assert trainer.step == 2
    warnings = [r.getMessage() for r in caplog.records if CONTRACT in r.getMessage()]
    assert len(warnings) == 1 and "earlier dflash" in warnings[0]


def test_fewer_tapped_layers_are_refused_even_when_allowed(run):
    cfg = config_of(run, target__layer_ids=[1, 3], checkpoint__allow_changed=["target.layer_ids"])
    with pytest.raises(BadInput, match=r"target.layer_ids \[1, 3\] taps 2 layers but .* trained on 3"):
        Trainer(cfg).setup()


@pytest.mark.parametrize(("keys", "message"), [
    (["drafter.num_layers"], "cannot be accepted on resume"),
    (["drafter.gama"], "'drafter.gama' is not a resume-contract key; use any of drafter.block_size"),
    (["drafter.rope_scaling"], "not a resume-contract key"),
])
def test_allow_changed_names_only_keys_a_resume_can_take(tiny_dict, keys, message):
    tiny_dict["checkpoint"]["allow_changed"] = keys
    with pytest.raises(ConfigError, match=message):
        validate(_build(RunConfig, yaml.safe_load(yaml.safe_dump(tiny_dict)), ""))
