"""Defects that once passed the whole suite, each caught here by a test that fails with the defect in place
(docs/testing.md lists them): the losslessness check fed a mismatching pair, a finished `dflash regenerate` run
again, and the order of the checkpoint save's renames and fsyncs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dflash.cli import main
from dflash.components.checkpoint import CheckpointManager
from dflash.data.synthetic import generate_conversations
from dflash.evaluation import evaluate
from dflash.evaluation.evaluate import LosslessnessError, Prompt, evaluate_speculative
from dflash.evaluation.speculative import Generation, greedy_generate
from dflash.models.drafter import Drafter, arch_from_target
from dflash.models.target import Target, build_hf_model

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-cpu.yaml"


# ------------------------------------------------------------------------------------------- losslessness
@pytest.fixture(scope="module")
def pair():
    spec = {"model_type": "qwen3", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    model = build_hf_model(None, spec, "float32", seed=0)
    target = Target(model, [1, 3, 4])
    arch = arch_from_target(model.config, num_layers=2, block_size=8, layer_ids=[1, 3, 4], mask_token_id=1,
                            vocab_size=50)
    torch.manual_seed(0)
    return target, Drafter(arch).eval()


def _prompts():
    return [Prompt(f"p{i}", torch.randint(2, 50, (6 + i,), generator=torch.Generator().manual_seed(i)))
            for i in range(2)]


def _wrong_at(position: int):
    """A speculative decoder that returns the target's greedy output with the token at `position` changed."""

    def generate(target, drafter, prompt, max_new_tokens, eos_ids, vocab_limit=None):
        ref = greedy_generate(target, prompt, max_new_tokens, eos_ids, vocab_limit)
        tokens = list(ref.tokens)
        tokens[position] = (tokens[position] + 1) % 50
        return Generation(tokens, ref.seconds, acceptance=[1] * len(tokens))

    return generate


def test_the_losslessness_check_reports_a_mismatching_output(pair, monkeypatch):
    """Speculative output that differs from the target's greedy output at one position is not lossless: the
    check compares the two decodings, not one of them with itself."""
    target, drafter = pair
    prompts = _prompts()
    clean = evaluate_speculative(target, drafter, prompts, 12, eos_ids=[], timings=False, check_lossless=False)
    assert clean.lossless and all(p.first_difference is None for p in clean.prompts)

    monkeypatch.setattr(evaluate, "speculative_generate", _wrong_at(0))
    report = evaluate_speculative(target, drafter, prompts, 12, eos_ids=[], timings=False, check_lossless=False)
    assert not report.lossless
    assert [p.lossless for p in report.prompts] == [False, False]
    assert [p.first_difference for p in report.prompts] == [0, 0]
    assert report.to_dict()["lossless_prompts"] == 0
    with pytest.raises(LosslessnessError, match="not lossless on prompt p0: first difference at generated position 0"):
        evaluate_speculative(target, drafter, prompts, 12, eos_ids=[], timings=False, check_lossless=True)


def test_the_losslessness_check_finds_a_late_difference(pair, monkeypatch):
    target, drafter = pair
    monkeypatch.setattr(evaluate, "speculative_generate", _wrong_at(9))
    report = evaluate_speculative(target, drafter, _prompts(), 12, eos_ids=[], timings=False, check_lossless=False)
    # the target's fp32 margins at position 9 are no numerical tie: a real difference
    assert [p.first_difference for p in report.prompts] == [9, 9] and not report.lossless


# ------------------------------------------------------------------------------------------------ regenerate
def test_a_finished_regenerate_run_again_writes_every_row_once(tmp_path, capsys):
    """Re-running a finished `dflash regenerate` skips every shard and leaves OUTPUT as it was: one row per
    input conversation, not the parts merged a second time onto it."""
    convs = [r["messages"] for r in generate_conversations(7, 64, 4, 10, [1, 2], seed=3)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    out = tmp_path / "out.jsonl"
    argv = ["regenerate", str(inp), str(out), "--target-config", str(TINY), "--max-new-tokens", "6",
            "--shard-size", "3"]
    assert main(argv) == 0
    first = out.read_bytes()
    manifest = json.loads((tmp_path / "out.jsonl.manifest.json").read_text())
    assert len(first.splitlines()) == len(convs) == manifest["counts"]["written"]
    capsys.readouterr()

    assert main(argv) == 0
    assert "3 of its 3 shards done before, skipped" in capsys.readouterr().err
    again = out.read_bytes()
    assert len(again.splitlines()) == len(convs)
    assert again == first
    rerun = json.loads((tmp_path / "out.jsonl.manifest.json").read_text())
    assert rerun["counts"] == manifest["counts"] and rerun["output"]["sha256"] == manifest["output"]["sha256"]


# ------------------------------------------------------------------------------------------------ checkpoint
def _payload(text):
    def write(tmp):
        (tmp / "model.safetensors").write_text(text)
        (tmp / "trainer_state.pt").write_text(text * 2)
    return write


@pytest.fixture
def recorded(monkeypatch):
    """Every fsync, rename and replace of a checkpoint save, in order, with what `latest` said at that moment.
    The fsyncs are the kernel calls themselves (`os.fsync`, named by the file its descriptor is open on), not
    the helper that should make them: a helper that forgot to call `os.fsync` records nothing."""
    calls = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        calls.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        real_fsync(fd)

    def rename(src, dst):
        calls.append(("rename", Path(src).name, Path(dst).name))
        real_rename(src, dst)

    def replace(src, dst):
        calls.append(("replace", Path(src).name, Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    return calls


def test_checkpoint_save_fsyncs_renames_then_points_latest(tmp_path, recorded):
    m = CheckpointManager(tmp_path / "ckpt", keep_last=3)
    m.save(1, _payload("1"))
    recorded.clear()
    m.save(2, _payload("2"))
    tmp = f".tmp-step-00000002-{os.getpid()}"
    rename = recorded.index(("rename", tmp, "step-00000002"))
    latest = next(i for i, c in enumerate(recorded) if c[0] == "replace" and c[2] == "latest")
    # every file of the new checkpoint and its directory are on disk before the rename makes it visible
    before = {c[1] for c in recorded[:rename] if c[0] == "fsync"}
    assert {"model.safetensors", "trainer_state.pt", "manifest.json", tmp} <= before, recorded
    # the rename is made durable (directory fsync) before `latest` names the new step
    assert rename < latest, recorded
    assert ("fsync", "ckpt") in recorded[rename:latest], recorded
    # `latest` is written to a temp file, fsynced, then renamed over the old pointer, then the rename synced
    pointer_tmp = recorded[latest][1]
    assert pointer_tmp != "latest" and ("fsync", pointer_tmp) in recorded[rename:latest], recorded
    assert ("fsync", "ckpt") in recorded[latest:], recorded
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000002"


def test_a_save_killed_at_its_rename_leaves_latest_on_the_previous_checkpoint(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path, keep_last=3)
    m.save(1, _payload("1"))
    real_rename = os.rename

    def killed(src, dst):
        if Path(dst).name == "step-00000002":
            raise KeyboardInterrupt("killed between the writes and the rename")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        m.save(2, _payload("2"))
    monkeypatch.setattr(os, "rename", real_rename)
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    assert not (tmp_path / "step-00000002").exists()
    assert CheckpointManager(tmp_path).latest_valid().name == "step-00000001"
