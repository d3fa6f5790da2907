"""The best checkpoint: `checkpoints/best` names the checkpoint with the best real acceptance length; that
directory is never pruned by keep_last, and a kill at any point of its update leaves a valid best."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from dflash.cli import main
from dflash.components.checkpoint import BEST, BEST_TMP_PREFIX, CheckpointManager
from dflash.config import RunConfig, _build, validate
from dflash.training.trainer import Trainer

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml"


def write_payload(text):
    def write(tmp):
        (tmp / "model.safetensors").write_text(text)
        (tmp / "trainer_state.pt").write_text(text * 2)
    return write


def names(manager):
    return [p.name for p in manager.list()]


def save_and_score(manager, step, score):
    manager.save(step, write_payload(str(step)))
    return manager.keep_if_best(step, score)


def test_the_best_survives_keep_last_1(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=1)
    assert save_and_score(m, 1, 3.0)
    for step in (2, 3):
        m.save(step, write_payload(str(step)))
    assert names(m) == ["step-00000001", "step-00000003"]
    assert m.best_valid().name == "step-00000001"
    assert m.latest_valid().name == "step-00000003"
    record = json.loads((tmp_path / BEST).read_text())
    assert (record["checkpoint"], record["step"], record["metric"], record["score"]) == (
        "step-00000001", 1, "acceptance_length", 3.0)


def test_a_better_score_moves_the_best_and_worse_ones_are_pruned(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=1)
    assert save_and_score(m, 1, 2.0)
    assert save_and_score(m, 2, 5.0)  # the previous best is an ordinary checkpoint now: pruned
    assert names(m) == ["step-00000002"]
    assert not save_and_score(m, 3, 3.0)
    assert not save_and_score(m, 4, 5.0)  # a tie keeps the older best
    assert names(m) == ["step-00000002", "step-00000004"]
    assert m.best()["score"] == 5.0 and m.best_valid().name == "step-00000002"


def test_a_kill_before_the_pointer_moves_leaves_the_previous_best(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path, keep_last=1)
    save_and_score(m, 1, 2.0)
    m.save(2, write_payload("2"))  # the new best's directory is complete ...

    def killed(name, tmp_prefix, text):  # ... and the process dies writing the pointer
        (tmp_path / f"{tmp_prefix}{os.getpid()}").write_text(text[:5])
        raise KeyboardInterrupt

    monkeypatch.setattr(m, "_write_pointer", killed)
    with pytest.raises(KeyboardInterrupt):
        m.keep_if_best(2, 4.0)
    restarted = CheckpointManager(tmp_path, keep_last=1)
    restarted.recover()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(BEST_TMP_PREFIX)]
    assert restarted.best_valid().name == "step-00000001"  # the old best, still intact
    assert names(restarted) == ["step-00000001", "step-00000002"]
    assert restarted.keep_if_best(2, 4.0)  # the eval after the restart can make it the best
    assert names(restarted) == ["step-00000002"]


def test_a_kill_after_the_pointer_moved_prunes_the_old_best_at_the_next_save(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path, keep_last=1)
    save_and_score(m, 1, 2.0)
    m.save(2, write_payload("2"))
    monkeypatch.setattr(m, "_prune", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        m.keep_if_best(2, 4.0)
    restarted = CheckpointManager(tmp_path, keep_last=1)
    assert restarted.recover() == []
    assert restarted.best_valid().name == "step-00000002"
    restarted.save(3, write_payload("3"))
    assert names(restarted) == ["step-00000002", "step-00000003"]


@pytest.mark.parametrize("damage", ["missing", "bitrot", "garbage pointer"])
def test_a_best_pointer_to_a_lost_checkpoint_is_dropped_and_replaced(tmp_path, damage):
    m = CheckpointManager(tmp_path, keep_last=3)
    save_and_score(m, 1, 9.0)
    m.save(2, write_payload("2"))
    if damage == "missing":
        import shutil

        shutil.rmtree(tmp_path / "step-00000001")
    elif damage == "bitrot":
        (tmp_path / "step-00000001" / "model.safetensors").write_text("rot")
    else:
        (tmp_path / BEST).write_text("{not json")
    assert m.best_valid() is None
    assert any("best pointer" in line for line in m.recover())
    assert not (tmp_path / BEST).exists()
    assert m.keep_if_best(2, 1.0)  # a lower score than the lost best's: there is no best to beat
    assert m.best_valid().name == "step-00000002"


# ------------------------------------------------------------------------------------ in the trainer
SCORES = {2: 2.0, 4: 4.0, 6: 3.0, 8: 1.0}  # real acceptance length per eval step


def small_dict(tmp_path) -> dict:
    d = yaml.safe_load(TINY.read_text())
    d = copy.deepcopy(d)
    d["output_dir"] = str(tmp_path / "run")
    d["data"]["regenerate"] = None
    d["data"]["synthetic"]["num_samples"] = 64
    d["optim"]["max_steps"] = 8
    d["checkpoint"].update(interval=3, keep_last=1)  # eval steps 2 and 4 have no interval checkpoint
    d["logging"].update(interval=2, eval_interval=2)
    return d


def small_config(tmp_path) -> RunConfig:
    cfg = _build(RunConfig, small_dict(tmp_path), "")
    validate(cfg)
    return cfg


def scripted_real_eval(trainer):
    """The real acceptance length of step N is SCORES[N] (speculative decoding itself: tests/test_speculative.py)."""
    def speculative():
        prompt = SimpleNamespace(lossless=True)
        return SimpleNamespace(acceptance_length=SCORES[trainer.step], lossless=True, prompts=[prompt], speedup=None)
    return speculative


def test_the_run_keeps_the_best_eval_while_later_worse_ones_are_pruned(tmp_path, write_config, capsys):
    trainer = Trainer(small_config(tmp_path)).setup()
    trainer.evaluator.speculative = scripted_real_eval(trainer)
    result = trainer.run()
    assert result["step"] == 8 and result["eval_acceptance_length"] == 1.0
    ckpt = trainer.ckpt
    # step 2 was saved as a best and pruned when step 4 beat it; 6 and 8 scored lower: only interval/final saves
    assert names(ckpt) == ["step-00000004", "step-00000008"]
    assert ckpt.best_valid().name == "step-00000004"
    assert (ckpt.best()["step"], ckpt.best()["score"]) == (4, 4.0)
    assert ckpt.latest_valid().name == "step-00000008"
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["acceptance_length"] for e in events if e.get("kind") == "eval"] == [2.0, 4.0, 3.0, 1.0, 1.0]
    # `dflash eval RUN` and `dflash export RUN` take the same checkpoint, the best (--latest: the newest), and say so
    config, run = write_config(small_dict(tmp_path)), str(tmp_path / "run")
    for flags, step, why in [([], 4, "the run's best by real acceptance length: 4.000 at step 4; --latest for the "
                                     "newest"), (["--latest"], 8, "the run's newest (--latest)")]:
        capsys.readouterr()
        assert main(["export", run, str(tmp_path / f"out{step}"), *flags]) == 0
        assert capsys.readouterr().out.startswith(f"exported drafter {run}/checkpoints/step-{step:08d} ({why}) to ")
        assert main(["eval", str(config), run, "--num-prompts", "1", "--max-new-tokens", "4", "--json", *flags]) == 0
        captured = capsys.readouterr()
        assert f"dflash eval: drafter {run}/checkpoints/step-{step:08d} ({why})" in captured.err
        report = json.loads(captured.out)
        assert (report["drafter"], report["drafter_chosen"]) == (f"{run}/checkpoints/step-{step:08d}", why)
    # a fresh start over this run (checkpoint.resume=false) restarts the step numbers: the old score is forgotten
    fresh = small_config(tmp_path)
    fresh.checkpoint.resume = False
    restarted = Trainer(fresh).setup()
    assert restarted.step == 0 and restarted.ckpt.best() is None
    assert names(restarted.ckpt) == ["step-00000004", "step-00000008"]  # nothing deleted by the start itself


def test_drop_best_keeps_the_directory_as_an_ordinary_checkpoint(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=1)
    save_and_score(m, 1, 2.0)
    m.save(2, write_payload("2"))
    m.drop_best("a test")
    assert m.best() is None and names(m) == ["step-00000001", "step-00000002"]
    m.save(3, write_payload("3"))
    assert names(m) == ["step-00000003"]


def test_export_takes_a_runs_best_by_default_and_the_newest_when_asked(tmp_path):
    from dflash.components.export import choose_checkpoint, resolve_checkpoint

    run = tmp_path / "run"
    m = CheckpointManager(run / "checkpoints", keep_last=2)
    assert save_and_score(m, 1, 6.0)
    assert not save_and_score(m, 2, 4.0)
    m.save(3, write_payload("3"))
    for given in (run, run / "checkpoints"):
        assert resolve_checkpoint(given, "best").name == "step-00000001"
        assert resolve_checkpoint(given, "latest").name == "step-00000003"
        assert resolve_checkpoint(given).name == "step-00000003"  # what drafter.init_from of a run dir reads
        assert choose_checkpoint(given) == (run / "checkpoints" / "step-00000001", "the run's best by real "
                                            "acceptance length: 6.000 at step 1; --latest for the newest")
    (run / "checkpoints" / "step-00000001" / "manifest.json").write_text("{}")  # a damaged best: the newest
    assert choose_checkpoint(run) == (run / "checkpoints" / "step-00000003",
                                      "the run's newest: its best step-00000001 is unusable")
    (run / "checkpoints" / BEST).unlink()  # a run without a best: the newest
    assert resolve_checkpoint(run, "best").name == "step-00000003"
    assert choose_checkpoint(run)[1] == "the run's newest: it kept no best"


# ------------------------------------------------------------------------- a lossless mismatch is never the best
def test_an_eval_that_is_not_lossless_stops_the_run_and_never_becomes_the_best(tmp_path):
    """Step 4's eval scores highest, but one prompt differed from the target's greedy output: the run raises
    naming the prompt and the position, the best stays step 2's, and the checkpoints written so far are intact."""
    from dflash.evaluation.evaluate import EvalNotLossless

    trainer = Trainer(small_config(tmp_path)).setup()

    def speculative():
        bad = trainer.step == 4
        prompts = [SimpleNamespace(name="synthetic-eval#0", lossless=True, first_difference=None),
                   SimpleNamespace(name="synthetic-eval#1", lossless=not bad, first_difference=5 if bad else None)]
        return SimpleNamespace(acceptance_length=9.0 if bad else SCORES[trainer.step], lossless=not bad,
                               prompts=prompts, speedup=None)

    trainer.evaluator.speculative = speculative
    with pytest.raises(EvalNotLossless, match=r"eval step 4: speculative decoding is not lossless on prompt "
                                              r"synthetic-eval#1: first difference at generated position 5 \(1 of 2"):
        trainer.run()
    assert (trainer.ckpt.best()["step"], trainer.ckpt.best()["score"]) == (2, 2.0)
    assert names(trainer.ckpt) == ["step-00000002", "step-00000003"]
    assert all(CheckpointManager.verify(p) is None for p in trainer.ckpt.list())
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [e for e in events if e.get("kind") == "eval"][-1]
    assert (last["step"], last["lossless"], last["mismatch"]) == (4, False, {"prompt": "synthetic-eval#1",
                                                                              "position": 5})
    assert trainer.evaluator.heartbeat_fields()["eval_step"] == 2  # the failed eval's numbers are not reported
    trainer.checkpointer.keep_if_best(trainer.step, {"acceptance_length": 99.0, "lossless": False})  # nor ever made the best
    assert trainer.ckpt.best()["step"] == 2


def test_the_trainer_exits_2_on_a_real_mismatch_and_a_numerical_tie_is_none(tmp_path, write_config, monkeypatch,
                                                                            capsys):
    """The real decoding path with a speculative decoder that gets generated position 3 wrong from the second eval
    on: `dflash train` exits 2 (bad_input: a restart would decode the same way) with one line naming the prompt and
    the position. The same difference where the target's own top-2 logits tie (TIE_TOLERANCE) is no mismatch."""
    from dflash.evaluation import evaluate
    from dflash.evaluation.speculative import Generation, greedy_generate

    d = yaml.safe_load(TINY.read_text())
    d["data"]["regenerate"] = None
    d["data"]["synthetic"]["num_samples"] = 64
    d["optim"]["max_steps"] = 4
    d["checkpoint"].update(interval=3, keep_last=1)
    d["logging"].update(interval=2, eval_interval=2)
    d["eval"].update(speculative_prompts=2, max_new_tokens=8)
    calls = []

    def wrong_later(target, drafter, prompt, max_new_tokens, eos_ids, vocab_limit=None):
        calls.append(1)
        ref = greedy_generate(target, prompt, max_new_tokens, eos_ids, vocab_limit)
        tokens = list(ref.tokens)
        if len(calls) > 2 and len(tokens) > 3:  # the eval at step 4
            tokens[3] = (tokens[3] + 1) % 64
        return Generation(tokens, ref.seconds, acceptance=[1] * len(tokens))

    monkeypatch.setattr(evaluate, "speculative_generate", wrong_later)
    d["output_dir"] = str(tmp_path / "run")
    assert main(["train", str(write_config(d))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dflash: error: eval step 4: speculative decoding is not lossless on prompt "
                              "synthetic-eval#") and "first difference at generated position 3" in err[-1]
    beat = json.loads((tmp_path / "run" / "heartbeat.json").read_text())
    assert beat["status"] == "failed" and beat["failure_class"] == "bad_input" and "position 3" in beat["error"]
    ckpt = CheckpointManager(tmp_path / "run" / "checkpoints")
    assert ckpt.best()["step"] == 2 and [p.name for p in ckpt.list()] == ["step-00000002", "step-00000003"]

    def tie(target, prompt, max_new_tokens, eos_ids, vocab_limit=None):  # the target's top-2 logits tie everywhere
        ref = greedy_generate(target, prompt, max_new_tokens, eos_ids, vocab_limit)
        return Generation(ref.tokens, ref.seconds, margins=[0.0] * len(ref.tokens))

    monkeypatch.setattr(evaluate, "greedy_generate", tie)
    calls.clear()
    d["output_dir"] = str(tmp_path / "tied")
    assert main(["train", str(write_config(d, "tied.yaml"))]) == 0
    evals = [json.loads(line) for line in (tmp_path / "tied" / "metrics.jsonl").read_text().splitlines()]
    assert [e["lossless"] for e in evals if e.get("kind") == "eval"] == [True, True, True]  # 2, 4, the end
