"""The evaluation component on its own (dflash.evaluation.evaluate.Evaluator): a tiny random-weight target, an untrained
drafter and the synthetic counting language, no Trainer. What it reports: the simulated tau over every held-out
sample at fixed anchors, the tau along the decoding path, the real acceptance length of its prompts, one record
(log line, metrics.jsonl, heartbeat fields); a stop request or a missing target yields no record."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from dflash.components.loss import BlockPass, valid_anchor_positions
from dflash.data.buckets import BatchShape
from dflash.data.chat import tokenize_conversations
from dflash.data.synthetic import build_tokenizer, generate_conversations
from dflash.evaluation.evaluate import (
    Evaluator,
    TargetFeatures,
    eos_ids_of,
    evaluate_speculative,
    prompts_from_tokenized,
)
from dflash.models.drafter import Drafter, arch_from_target
from dflash.models.target import Target, build_hf_model
from dflash.runtime import stop
from dflash.runtime.observability import RunObserver

TARGET = {"model_type": "qwen3", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512}
LAYERS = [1, 3, 4]
BLOCK = 8
ANCHORS = 16
PROMPTS = 3
MAX_NEW = 12


@pytest.fixture(scope="module")
def models():
    tokenizer = build_tokenizer(64)
    conversations = [row["messages"] for row in generate_conversations(10, 64, 12, 30, [1, 2], seed=3)]
    held_out = tokenize_conversations(tokenizer, conversations, 64, 8, "held-out")
    target = Target(build_hf_model(None, dict(TARGET), "float32", seed=0), LAYERS)
    arch = arch_from_target(target.model.config, num_layers=2, block_size=BLOCK, layer_ids=LAYERS,
                            mask_token_id=tokenizer.mask_token_id, vocab_size=TARGET["vocab_size"])
    torch.manual_seed(0)
    return tokenizer, held_out, target, Drafter(arch)


@dataclass
class ScriptedPass(BlockPass):
    """The real pass, with the drafter's predictions replaced: every label right, or every one wrong."""

    right: bool = True

    def __call__(self, *args, **kwargs):
        result = super().__call__(*args, **kwargs)
        result.correct = result.blocks.label_valid.clone() if self.right else torch.zeros_like(result.correct)
        return result


def evaluator(models, tmp_path=None, source=None, pass_type=BlockPass, **pass_kw) -> Evaluator:
    tokenizer, held_out, target, drafter = models
    block_pass = pass_type(drafter, BLOCK, 4.0, ANCHORS, 4096, "fused", "sdpa", torch.device("cpu"), **pass_kw)
    observer = RunObserver(tmp_path) if tmp_path is not None else None
    return Evaluator(drafter, source or TargetFeatures(target), prompts=prompts_from_tokenized(held_out, PROMPTS),
                     max_new_tokens=MAX_NEW, eos_ids=eos_ids_of(tokenizer), vocab_limit=len(tokenizer),
                     eval_set=held_out, batch_shape=BatchShape(token_budget=128, bucket_size=16, max_length=64),
                     pad_token_id=tokenizer.pad_token_id, block_pass=block_pass, observer=observer)


def test_the_record_holds_the_simulated_tau_the_walk_and_the_real_acceptance(models, tmp_path, caplog):
    import logging

    tokenizer, held_out, target, drafter = models
    ev = evaluator(models, tmp_path)
    drafter.train()
    with caplog.at_level(logging.INFO):
        record = ev.report(step=7)
    assert drafter.training  # the eval mode was undone
    assert set(record) == {"step", "tau", "acc", "tau_walk", "acceptance_length", "lossless", "prompts", "speedup"}
    assert record["step"] == 7 and 1.0 <= record["tau"] <= BLOCK and len(record["acc"]) == BLOCK - 1
    assert 1.0 <= record["tau_walk"] <= BLOCK
    # the real acceptance length is that of decoding its own prompts (the first PROMPTS held-out ones) directly
    direct = evaluate_speculative(target, drafter, prompts_from_tokenized(held_out, PROMPTS), MAX_NEW,
                                  eos_ids_of(tokenizer), vocab_limit=len(tokenizer), check_lossless=True)
    assert record["acceptance_length"] == pytest.approx(direct.acceptance_length)
    assert record["prompts"] == PROMPTS and record["lossless"] is True  # float32: equal to the target's greedy output
    # every held-out sample was read once, with up to ANCHORS anchors each
    stats = ev.block_stats()
    expected_blocks = sum(min(ANCHORS, valid_anchor_positions(mask, len(ids)).numel()) for ids, mask in held_out.samples)
    assert int(stats.num_blocks) == expected_blocks
    # fixed batches and anchors: the same drafter scores the same at every eval
    assert stats.tau == pytest.approx(record["tau"]) and stats.accuracy == pytest.approx(record["acc"])
    assert ev.walk_tau() == pytest.approx(record["tau_walk"])
    # the report: the record kept for the heartbeat, one metrics line, one log line
    assert ev.last is record
    assert ev.heartbeat_fields() == {"eval_step": 7, "eval_tau": record["tau"],
                                     "eval_acceptance_length": record["acceptance_length"]}
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["kind"] == "eval"
    assert {k: v for k, v in lines[0].items() if k not in ("kind", "time")} == record
    assert any(r.getMessage().startswith("eval step 7: simulated tau ") and "real acceptance length" in r.getMessage()
               for r in caplog.records)


def expected_walk(held_out) -> float:
    """A drafter that is always right, read along the decoding path: a sample's answer of n tokens (one run of
    loss positions) is crossed from its first token in rounds of up to B committed tokens; the walk ends where no
    later answer token is left to predict."""
    rounds = committed = 0
    for _, mask in held_out.samples:
        positions = torch.nonzero(mask).flatten()
        n = positions.numel()
        assert int(positions[-1] - positions[0]) == n - 1  # one contiguous answer
        rounds += math.ceil((n - 1) / BLOCK)
        committed += n - 1 + (1 if (n - 1) % BLOCK else 0)
    return committed / rounds


def test_the_walk_commits_what_a_perfect_drafter_would_and_one_token_per_round_for_a_wrong_one(models):
    _, held_out, _, _ = models
    right = evaluator(models, pass_type=ScriptedPass, right=True)
    assert right.walk_tau() == pytest.approx(expected_walk(held_out))
    stats = right.block_stats()
    assert stats.accuracy == pytest.approx([1.0] * (BLOCK - 1)) and stats.tau > 1.0
    wrong = evaluator(models, pass_type=ScriptedPass, right=False)
    assert wrong.walk_tau() == 1.0 and wrong.block_stats().tau == 1.0


def test_a_stop_request_ends_the_eval_without_a_record(models, tmp_path, monkeypatch, caplog):
    import logging

    _, _, _, drafter = models
    ev = evaluator(models, tmp_path)
    calls = []

    def check():  # the second held-out batch sees a stop request
        calls.append(1)
        if len(calls) == 2:
            raise stop.Interrupted("signal 15")

    monkeypatch.setattr(stop, "check", check)
    drafter.train()
    with caplog.at_level(logging.INFO):
        assert ev.report(step=3) is None
    assert len(calls) == 2 and drafter.training and ev.last is None
    assert not (tmp_path / "metrics.jsonl").exists()
    assert any("eval step 3: interrupted by a stop request" in r.getMessage() for r in caplog.records)


def test_without_a_target_in_the_process_there_is_no_eval(models, tmp_path):
    ev = evaluator(models, tmp_path, source=SimpleNamespace(target=None))  # a drafter rank fed by target ranks
    assert ev.report(step=1) is None and ev.speculative() is None
    assert ev.heartbeat_fields() == {"eval_step": None, "eval_tau": None, "eval_acceptance_length": None}
