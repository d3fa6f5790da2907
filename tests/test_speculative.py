"""Real speculative decoding: the cached drafter equals the training forward, rollback is exact for dense and
hybrid targets, and the output equals the target's own greedy decoding whatever the drafter proposes."""

import json

import pytest
import torch

from dflash.evaluation.speculative import (
    DrafterSession,
    first_difference,
    greedy_generate,
    speculative_generate,
)
from dflash.models.drafter import Drafter, arch_from_target
from dflash.models.target import Target, build_hf_model
from dflash.runtime.doctor import PROBE_HYBRID

QWEN3 = {"model_type": "qwen3", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
HYBRID = {**PROBE_HYBRID, "vocab_size": 50, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16,
          "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_hidden_layers": 6,
          "layer_types": ["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"]}
LAYERS = [1, 3, 4]
BLOCK = 8


def _pair(spec, seed=0):
    model = build_hf_model(None, dict(spec), "float32", seed=seed)
    target = Target(model, LAYERS)
    arch = arch_from_target(model.config, num_layers=2, block_size=BLOCK, layer_ids=LAYERS, mask_token_id=1,
                            vocab_size=spec["vocab_size"])
    torch.manual_seed(seed)
    return target, Drafter(arch).eval()


@pytest.fixture(scope="module", params=[QWEN3, HYBRID], ids=["dense", "hybrid"])
def pair(request):
    return _pair(request.param)


def test_cached_drafter_block_equals_the_training_forward(pair):
    target, drafter = pair
    ids = torch.randint(2, 50, (1, 24), generator=torch.Generator().manual_seed(1))
    feats = target.features(ids)
    for anchor in (1, 9, 17):
        block = torch.full((BLOCK,), 1)
        block[0] = ids[0, anchor]
        with torch.no_grad():
            ref = drafter(feats, block[None, None], torch.tensor([[anchor]]), target.embed_tokens)[0, 0]
        session = DrafterSession(drafter, target)
        session.append(feats[0, : anchor // 2])  # appended in two parts, as decoding does
        session.append(feats[0, anchor // 2: anchor])
        assert session.length == anchor
        assert torch.allclose(session.hidden(block), ref, atol=1e-5)


@pytest.mark.parametrize("correct", [0, 1, 3, BLOCK - 1])
def test_rollback_is_exact_for_every_acceptance(pair, correct, monkeypatch):
    """A drafter whose first `correct` proposals are the target's greedy tokens and the rest wrong: every full
    round commits exactly correct+1 tokens and the output equals plain greedy decoding (for the hybrid target
    this exercises the recurrent-state restore and re-read)."""
    target, drafter = pair
    prompt = torch.randint(2, 50, (9,), generator=torch.Generator().manual_seed(correct))
    n = 30
    ref = greedy_generate(target, prompt, n + BLOCK + 2, eos_ids=[])

    def propose(self, first_token, vocab_limit):
        g = self.length - prompt.numel()  # generated tokens already seen by the target
        assert first_token == ref.tokens[g]
        block = torch.tensor([first_token] + [ref.tokens[g + 1 + i] if i < correct else
                                              (ref.tokens[g + 1 + i] + 1) % 50 for i in range(BLOCK - 1)])
        return block

    monkeypatch.setattr(DrafterSession, "propose", propose)
    spec = speculative_generate(target, drafter, prompt, n, eos_ids=[])
    assert spec.tokens == ref.tokens[:n]
    assert spec.acceptance[:-1] == [correct + 1] * (len(spec.acceptance) - 1)


def test_random_drafter_is_lossless_and_stops_at_eos(pair):
    target, drafter = pair
    for seed in range(3):
        prompt = torch.randint(2, 50, (5 + seed,), generator=torch.Generator().manual_seed(seed))
        ref = greedy_generate(target, prompt, 25, eos_ids=[])
        eos = ref.tokens[7]  # make a token of the output the EOS: both must stop at its first occurrence
        ref_eos = greedy_generate(target, prompt, 25, eos_ids=[eos])
        spec = speculative_generate(target, drafter, prompt, 25, eos_ids=[eos])
        assert first_difference(ref_eos.tokens, spec.tokens) is None
        assert spec.tokens[-1] == eos and eos not in spec.tokens[:-1]
        assert all(1 <= a <= BLOCK for a in spec.acceptance)


def test_vocab_limit_keeps_argmax_inside_the_tokenizer(pair):
    target, drafter = pair
    prompt = torch.randint(2, 50, (6,), generator=torch.Generator().manual_seed(4))
    ref = greedy_generate(target, prompt, 20, eos_ids=[], vocab_limit=20)
    spec = speculative_generate(target, drafter, prompt, 20, eos_ids=[], vocab_limit=20)
    assert max(ref.tokens) < 20 and spec.tokens == ref.tokens


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


# --------------------------------------------------------------------------------------------- the trainer
def test_trainer_eval_logs_real_acceptance_beside_simulated_tau(tiny_config, tmp_path):
    from dflash.training.trainer import Trainer

    tiny_config.optim.max_steps = 4
    tiny_config.eval.speculative_prompts = 3
    tiny_config.eval.max_new_tokens = 12
    result = Trainer(tiny_config).setup().run()
    out = tmp_path / "run"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("kind") == "eval"]
    assert len(evals) == 1 and evals[0]["step"] == 4  # the final eval is in metrics.jsonl
    ev = evals[0]
    assert ev["prompts"] == 3 and ev["lossless"] is True and 1.0 <= ev["acceptance_length"] <= BLOCK
    assert result["eval_acceptance_length"] == pytest.approx(ev["acceptance_length"])
    beat = json.loads((out / "heartbeat.json").read_text())
    assert beat["eval_acceptance_length"] == pytest.approx(ev["acceptance_length"])
    assert beat["eval_tau"] == pytest.approx(ev["tau"]) and beat["eval_step"] == 4


def test_eval_cli_reports_and_refuses_a_drafter_of_other_layers(tiny_config, tiny_dict, write_config, tmp_path,
                                                                 capsys):
    from dflash.cli import main
    from dflash.training.trainer import Trainer

    tiny_config.optim.max_steps = 2
    tiny_config.eval.speculative_prompts = 0
    Trainer(tiny_config).setup().run()
    tiny_dict["output_dir"] = tiny_config.output_dir
    tiny_dict["data"]["synthetic"]["num_samples"] = 200
    cfg = write_config(tiny_dict)
    report = tmp_path / "report.json"
    rc = main(["eval", str(cfg), tiny_config.output_dir, "--num-prompts", "3", "--max-new-tokens", "10", "--json",
               "--out", str(report)])
    assert rc == 0, capsys.readouterr().err
    data = json.loads(report.read_text())
    assert data["num_prompts"] == 3 and data["lossless"] and sum(data["histogram"].values()) >= 3
    assert {"acceptance_length", "speedup", "target_tokens_per_s", "speculative_tokens_per_s"} <= set(data)
    assert len(data["prompts"]) == 3 and all(p["lossless"] for p in data["prompts"])
    rc = main(["eval", str(cfg), tiny_config.output_dir, "target.layer_ids=[1,2,4]"])
    assert rc == 2 and "taps target layers [1, 3, 4]" in capsys.readouterr().err
    rc = main(["eval", str(cfg), str(tmp_path / "missing")])
    assert rc == 2 and "no intact checkpoint" in capsys.readouterr().err


def test_eval_cli_decodes_what_the_run_evaluates_and_writes_no_cache_outside_the_run(tiny_dict, write_config,
                                                                                     tmp_path, capsys, monkeypatch):
    """`dflash eval CONFIG RUN` without --max-new-tokens decodes as far as the run's evals (here the regenerated
    answers' limit, eval.max_new_tokens being unset) and says so; it reads the held-out answers from RUN's cache
    and writes none: not into the config's output_dir (another directory), not into RUN."""
    from dflash.cli import main
    from dflash.config import RunConfig, _build
    from dflash.regenerate import hf
    from dflash.training.trainer import Trainer

    tiny_dict["output_dir"] = str(tmp_path / "run")
    tiny_dict["data"]["synthetic"]["num_samples"] = 64
    tiny_dict["data"]["regenerate"]["max_new_tokens"] = 12
    tiny_dict["eval"] = {"speculative_prompts": 0}
    trainer = Trainer(_build(RunConfig, tiny_dict, "")).setup()
    assert trainer.evaluator.max_new_tokens == 12  # the trainer's evals decode the same
    trainer.train_step()
    trainer.save_checkpoint()
    run, cached = tmp_path / "run", sorted((tmp_path / "run" / "regenerated").iterdir())
    tiny_dict["output_dir"] = str(tmp_path / "other")
    cfg = write_config(tiny_dict)

    def no_generation(*args, **kwargs):
        raise AssertionError("the run's cached answers were not read")

    monkeypatch.setattr(hf, "TransformersBackend", no_generation)
    capsys.readouterr()
    assert main(["eval", str(cfg), str(run), "--num-prompts", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["max_new_tokens"], data["eos_ids"]) == (12, [3])
    assert data["max_new_tokens_from"] == f"data.regenerate.max_new_tokens (the regenerated answers' limit) of {cfg}"
    assert all(p["new_tokens"] <= 12 for p in data["prompts"])
    assert sorted((run / "regenerated").iterdir()) == cached and not (tmp_path / "other").exists()

    monkeypatch.undo()
    for path in cached:  # no cache: the answers are generated in memory, and still nothing is written
        path.unlink()
    assert main(["eval", str(cfg), str(run), "--num-prompts", "2", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert ("decoded up to 5 new tokens per prompt (--max-new-tokens), stopping at EOS (token ids 3)\n"
            "real acceptance length ") in out
    assert not list((run / "regenerated").iterdir()) and not (tmp_path / "other").exists()


def test_the_eval_limit_is_the_configs_else_the_regenerated_answers_else_128(tmp_path):
    from dflash.config import RunConfig, _build
    from dflash.evaluation.evaluate import eval_token_limit

    def limit(**data):
        return eval_token_limit(_build(RunConfig, {"output_dir": str(tmp_path), "data": data,
                                                   "eval": eval_section}, ""))

    eval_section = {"max_new_tokens": 40}
    assert limit(regenerate={"max_new_tokens": 12}) == (40, "eval.max_new_tokens")
    eval_section = {}
    assert limit(regenerate={"max_new_tokens": 12})[0] == 12
    train = tmp_path / "train.jsonl"
    (tmp_path / "train.jsonl.manifest.json").write_text(json.dumps({"sampling": {"max_new_tokens": 300}}))
    assert limit(train_path=str(train)) == (300, "the regenerated answers' max_new_tokens (data.train_path's "
                                                 "manifest)")
    assert limit(train_path=str(tmp_path / "plain.jsonl")) == (128, "the default (eval.max_new_tokens unset, no "
                                                                     "regenerated answers)")


def test_the_tie_tolerance_is_the_dtype_the_target_computes_in(pair):
    """A float32 target decoded under a bfloat16 autocast (the trainer's evals on CUDA) rounds like bfloat16: its
    ties are judged with bfloat16's tolerance, not float32's (on an H200 a float32 SmolLM2 target's eval under
    autocast differed from its greedy reference on 5 of 12 prompts at near-ties, and float32's 1e-5 called them
    losses)."""
    from dflash.evaluation.evaluate import TIE_TOLERANCE, tie_tolerance_of

    target, _ = pair
    assert tie_tolerance_of(target) == TIE_TOLERANCE[torch.float32]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert tie_tolerance_of(target) == TIE_TOLERANCE[torch.bfloat16]
    with torch.autocast("cpu", enabled=False):
        assert tie_tolerance_of(target) == TIE_TOLERANCE[torch.float32]
